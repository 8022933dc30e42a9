"""Fault injection for tests and chaos drills: $TRAINFORGE_FAULT="kill:rank=1:step=25[,...]".

Kinds: `kill` (SIGKILL this worker: a lost process), `raise` (an exception in the step: a user bug),
`hang` (stop making progress: a stuck collective). A fault fires once per job (a marker file in the run folder
remembers it), so the retried segment runs clean, as a replaced node would.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

ENV_VAR = "TRAINFORGE_FAULT"


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    rank: int
    step: int
    always: bool = False

    @property
    def marker(self) -> str:
        return f"{self.kind}-rank{self.rank}-step{self.step}"


def parse_faults(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        kind, *params = item.split(":")
        values = dict(p.split("=", 1) for p in params)
        faults.append(Fault(kind, int(values.get("rank", 0)), int(values["step"]), values.get("always") == "1"))
    return faults


class FaultInjector:
    def __init__(self, faults: list[Fault], run_dir: str, rank: int):
        self.faults = [f for f in faults if f.rank == rank]
        self.marker_dir = Path(run_dir) / "faults"

    @classmethod
    def from_env(cls, run_dir: str, rank: int) -> FaultInjector:
        return cls(parse_faults(os.environ.get(ENV_VAR, "")), run_dir, rank)

    def maybe_fire(self, step: int) -> None:
        for fault in self.faults:
            if fault.step != step:
                continue
            marker = self.marker_dir / fault.marker
            if not fault.always:
                if marker.exists():
                    continue
                self.marker_dir.mkdir(parents=True, exist_ok=True)
                marker.write_text(str(time.time()))
            if fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind == "raise":
                raise InjectedFault(f"injected failure at step {step}")
            elif fault.kind == "hang":
                time.sleep(3600)
