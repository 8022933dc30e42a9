"""Where the embedded defaults keep their state: $TRAINFORGE_HOME, else ~/.trainforge."""

from __future__ import annotations

import getpass
import os
from pathlib import Path


def home() -> Path:
    root = Path(os.environ.get("TRAINFORGE_HOME") or Path.home() / ".trainforge").expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    return root


def current_user() -> str:
    """Who is acting: $TRAINFORGE_USER, else the login (lineage audits it; the scheduler learns runtimes per user)."""
    try:
        return os.environ.get("TRAINFORGE_USER") or getpass.getuser()
    except (KeyError, OSError):
        return "unknown"
