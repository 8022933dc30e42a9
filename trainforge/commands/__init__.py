"""CLI command modules; each registers its commands on `trainforge.cli.app`."""
