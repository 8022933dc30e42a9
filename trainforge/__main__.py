"""`python -m trainforge` is the `trainforge` command."""

from trainforge.cli import main

main()
