"""Where a job's objects live: `teams/{team}/jobs/{job}/...`. Pure string builders, no I/O.

Every key a job writes sits under its job prefix, so one prefix-scoped credential (a scoped handle here,
an IAM policy in production: see `render_job_iam_policy`) covers all of it and nothing else.
Checkpoint steps are zero-padded so that a plain lexicographic listing is in step order.
"""

from __future__ import annotations

import re

_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
STEP_WIDTH = 10
_STEP_DIR = re.compile(r"(?:^|/)checkpoints/step-(\d+)(?:/|$)")


def _segment(kind: str, value: str) -> str:
    if not isinstance(value, str) or not _SEGMENT.match(value) or ".." in value:
        raise ValueError(f"invalid {kind} name {value!r}: letters, digits, '.', '_', '-' (no '/', no '..')")
    return value


def team_prefix(team: str) -> str:
    return f"teams/{_segment('team', team)}"


def job_prefix(team: str, job: str) -> str:
    """`teams/{team}/jobs/{job}`: the whole of what one job may read and write."""
    return f"{team_prefix(team)}/jobs/{_segment('job', job)}"


def job_key(team: str, job: str, *parts: str) -> str:
    """A key under the job prefix, e.g. job_key("nlp", "run-1", "logs", "rank0.txt")."""
    for p in parts:
        if not p or p in (".", "..") or "/" in p:
            raise ValueError(f"invalid key part {p!r}")
    return "/".join((job_prefix(team, job), *parts))


def checkpoints_prefix(team: str, job: str) -> str:
    return f"{job_prefix(team, job)}/checkpoints"


def checkpoint_prefix(team: str, job: str, step: int) -> str:
    """`teams/{team}/jobs/{job}/checkpoints/step-{step:010d}`."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"invalid checkpoint step {step!r}")
    return f"{checkpoints_prefix(team, job)}/step-{step:0{STEP_WIDTH}d}"


def parse_checkpoint_step(key: str) -> int | None:
    """The step of the checkpoint folder a key lies in, or None if it lies in none."""
    m = _STEP_DIR.search(key)
    return int(m.group(1)) if m else None
