"""Where the embedded defaults keep their state: $TRAINFORGE_HOME, else ~/.trainforge."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    root = Path(os.environ.get("TRAINFORGE_HOME") or Path.home() / ".trainforge").expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    return root
