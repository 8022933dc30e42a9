"""On-demand `torch.profiler` for a window of steps on every rank, and the merged summary across ranks.

The window `a:b` (1-based steps, inclusive) comes from $TRAINFORGE_PROFILE_STEPS (or the config's
`profile_steps`) at launch, or from the channel's `profile_window` command, which `trainforge profile JOB --steps
a:b` sends while the job runs: the node's sidecar hands it to its ranks (and to a rank that starts later), each
rank reads it from its `CommandInbox` after every step (trainer/inbox.py); a rank that gets it after step a
skips the window, saying so in its log.

Each rank writes its Chrome trace (open it in Perfetto) and its summary. With a node publisher (a worker launched
by a backend) it writes them in a temporary folder of its own node, uploads both into the job's prefix in the
object store (`profiles/segment-{attempt}/rank{r}.trace.json` and `.summary.json`) and publishes a `Profile`
event with the trace's key; the control side copies them into the job's `profiles/` folder, where the flow
merges the summaries and logs everything as run artifacts. Without one (the trainer driven directly) it writes
`run_dir/profiles/rank{r}.trace.json` and `rank{r}.summary.json` itself.

Per-rank summary: the union of communication intervals (gloo/NCCL/c10d ops, on whatever thread runs them) and of
compute intervals (other aten ops), their overlap (the share of communication hidden under compute), and the
step times inside the window. The merge names the slowest rank of each step (the straggler).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import statistics
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainforge.contract.config import SegmentConfig
from trainforge.contract.events import Profile, Sender, dump_event
from trainforge.events import rank_client
from trainforge.trainer.inbox import rank_inbox

logger = logging.getLogger(__name__)

FINISH_TIMEOUT_S = 120.0
"""How long the end of a segment waits for a window's files to be written and uploaded."""
COMM_PATTERN = re.compile(r"gloo|nccl|c10d|all_?reduce|all_?gather|reduce_?scatter|broadcast|alltoall|all_to_all|"
                          r"send|recv|record_param_comms", re.IGNORECASE)


def parse_window(text: str | None) -> tuple[int, int] | None:
    """'a:b' -> (a, b), 1-based inclusive steps; None for empty. Raises ValueError with the fix on a bad value."""
    if not text:
        return None
    try:
        a, b = (int(x) for x in str(text).split(":"))
    except ValueError:
        raise ValueError(f"profile window {text!r}: write it as START:END steps, e.g. 10:12") from None
    if a < 1 or b < a:
        raise ValueError(f"profile window {text!r}: need 1 <= START <= END")
    return a, b


def union_length(intervals: Sequence[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def merge(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def overlap_length(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    """Length of (union a) ∩ (union b)."""
    ma, mb, i, j, total = merge(a), merge(b), 0, 0, 0.0
    while i < len(ma) and j < len(mb):
        lo, hi = max(ma[i][0], mb[j][0]), min(ma[i][1], mb[j][1])
        total += max(0.0, hi - lo)
        if ma[i][1] < mb[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize_intervals(comm: Sequence[tuple[float, float]], compute: Sequence[tuple[float, float]]
                        ) -> dict[str, float]:
    comm_s, compute_s = union_length(comm), union_length(compute)
    hidden = overlap_length(comm, compute)
    return {"comm_s": comm_s, "compute_s": compute_s, "comm_hidden_s": hidden,
            "comm_exposed_s": comm_s - hidden, "overlap_fraction": hidden / comm_s if comm_s else 0.0}


def merge_summaries(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-rank summaries -> the job's: slowest rank per step, straggler, mean overlap, achieved vs peak FLOP/s."""
    if not summaries:
        return {}
    by_rank = {int(s["rank"]): s for s in summaries}
    steps = sorted({int(k) for s in summaries for k in s.get("step_times", {})})
    slowest = {}
    for step in steps:
        times = {r: s["step_times"].get(str(step)) for r, s in by_rank.items() if str(step) in s.get("step_times", {})}
        rank = max(times, key=lambda r: times[r])
        slowest[str(step)] = {"rank": rank, "step_time_s": times[rank],
                              "median_s": statistics.median(times.values())}
    counts: dict[int, int] = {}
    for v in slowest.values():
        counts[v["rank"]] = counts.get(v["rank"], 0) + 1
    out: dict[str, Any] = {
        "ranks": sorted(by_rank),
        "window": summaries[0].get("window"),
        "slowest_rank_per_step": slowest,
        "straggler_rank": max(counts, key=lambda r: counts[r]) if counts else None,
        "overlap_fraction_mean": statistics.mean(s.get("overlap_fraction", 0.0) for s in summaries),
        "comm_exposed_s_max": max(s.get("comm_exposed_s", 0.0) for s in summaries),
    }
    achieved = [s["achieved_flops"] for s in summaries if s.get("achieved_flops")]
    peaks = [s["peak_flops"] for s in summaries if s.get("peak_flops")]
    if achieved and peaks:
        out["achieved_flops_per_rank"] = statistics.mean(achieved)
        out["peak_flops_per_rank"] = statistics.mean(peaks)
        out["achieved_fraction_of_peak"] = out["achieved_flops_per_rank"] / out["peak_flops_per_rank"]
    bubbles = [s["bubble_fraction"] for s in summaries if "bubble_fraction" in s]
    if bubbles:
        out["pipeline_bubble_fraction"] = max(bubbles)
    return out


def merge_folder(folder: Path) -> dict[str, Any] | None:
    summaries = [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.summary.json"))]
    if not summaries:
        return None
    merged = merge_summaries(summaries)
    (folder / "summary.json").write_text(json.dumps(merged, indent=1))
    return merged


def profile_key(storage_prefix: str, attempt: int | str, rank: int) -> str:
    """The object-store key of a rank's trace in the job's prefix (its summary: `.trace.json` -> `.summary.json`)."""
    return f"{storage_prefix.rstrip('/')}/profiles/segment-{attempt}/rank{rank}.trace.json"


def summary_key(trace_key: str) -> str:
    return trace_key.removesuffix(".trace.json") + ".summary.json"


def window_of(cmd: dict[str, Any]) -> tuple[int, int]:
    """A `profile_window` command's (start, end) steps. Raises ValueError naming the bad argument."""
    args = cmd.get("args") or {}
    a, b = args.get("start_step"), args.get("end_step")
    if not (isinstance(a, int) and isinstance(b, int)) or isinstance(a, bool) or isinstance(b, bool):
        raise ValueError(f"profile_window command {cmd.get('seq')}: start_step and end_step must be integers, "
                         f"got {a!r} and {b!r}")
    return parse_window(f"{a}:{b}")  # type: ignore[return-value]  # a window: never None for two integers


class StepProfiler:
    """Runs torch.profiler over the window's steps on this rank (the StepMeter calls `after_step`). `config`:
    the segment's config, for where to upload the trace when the worker has a node publisher."""

    def __init__(self, run_dir: str | Path, rank: int, window: tuple[int, int] | None, start_step: int,
                 peak_flops: float, flops_per_step_per_rank: float, bubble_fraction: float = 0.0, *,
                 config: SegmentConfig | None = None):
        self.run_dir, self.rank, self.window = Path(run_dir), rank, window
        self.peak, self.flops = peak_flops, flops_per_step_per_rank
        self.bubble_fraction = bubble_fraction
        self.config = config
        self.prof: Any = None
        self.step_times: dict[str, float] = {}
        self.done = False
        self.published: Profile | None = None
        self._writer: threading.Thread | None = None
        if window and window[0] <= start_step + 1 <= window[1]:
            self._start()

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        import torch

        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self.prof = profile(activities=activities, record_shapes=False, with_stack=False)
        self.prof.__enter__()

    def _poll_request(self, step: int) -> None:
        """A `profile_window` command from the control plane (one non-blocking read of the node socket)."""
        if self.window is not None:
            return
        inbox = rank_inbox()
        if inbox is None:
            return
        for cmd in inbox.take("profile_window"):
            try:
                window = window_of(cmd)
            except ValueError as exc:
                logger.warning("ignoring %s", exc)
                continue
            if window[0] > step:
                self.window = window
                logger.info("profile window %s:%s requested: starting at step %s", *window, window[0])
            else:
                logger.warning("profile window %s:%s requested, but this rank is past step %s already: skipped; "
                               "ask for a window that starts later", window[0], window[1], step)

    def after_step(self, step: int, step_time_s: float) -> None:
        """Called after step `step` (1-based) finished."""
        if self.done:
            return
        self._poll_request(step)
        if self.window is None:
            return
        a, b = self.window
        if self.prof is not None and a <= step <= b:
            self.step_times[str(step)] = step_time_s
        if self.prof is None and step == a - 1:
            self._start()
        elif self.prof is not None and step >= b:
            self._finish()

    def _finish(self) -> None:
        """Stop the profiler, then export, summarise and upload on a thread of its own: reading a window's events
        takes seconds (measured: 19 s for two steps on a loaded 2-core host), and a rank that spent them in its
        step loop would stall the gang's next collective long enough to be taken for a hang and killed."""
        prof, self.prof, self.done = self.prof, None, True
        prof.__exit__(None, None, None)
        self._writer = threading.Thread(target=self._write_out, args=(prof,), name="profile-writer", daemon=True)
        self._writer.start()

    def wait(self, timeout_s: float = FINISH_TIMEOUT_S) -> bool:
        """Wait for the window's files (and the upload and event); True when they are out."""
        if self._writer is None:
            return True
        self._writer.join(timeout_s)
        if self._writer.is_alive():
            logger.warning("the profile of steps %s is not written after %.0f s: the segment ends without it",
                           self.window, timeout_s)
            return False
        return True

    def _write_out(self, prof: Any) -> None:
        try:
            self._export(prof)
        except Exception:  # a profile must never fail the training
            logger.exception("writing the profile of steps %s failed", self.window)

    def _export(self, prof: Any) -> None:
        client = rank_client(self.rank) if self.config is not None else None
        # With a node publisher the files go to the job's store, not to a folder the control plane would share.
        out = Path(tempfile.mkdtemp(prefix=f"trainforge-profile-rank{self.rank}-")) if client is not None \
            else self.run_dir / "profiles"
        out.mkdir(parents=True, exist_ok=True)
        trace = out / f"rank{self.rank}.trace.json"
        prof.export_chrome_trace(str(trace))
        comm, compute = [], []
        for ev in prof.events():
            span = (ev.time_range.start / 1e6, ev.time_range.end / 1e6)
            if COMM_PATTERN.search(ev.name):
                comm.append(span)
            elif ev.name.startswith("aten::"):
                compute.append(span)
        summary = summarize_intervals(comm, compute)
        window_s = sum(self.step_times.values())
        summary.update(rank=self.rank, window=list(self.window or ()), step_times=self.step_times,
                       peak_flops=self.peak, bubble_fraction=self.bubble_fraction,
                       achieved_flops=self.flops * len(self.step_times) / window_s if window_s else 0.0,
                       top_ops=[{"name": e.key, "self_cpu_s": e.self_cpu_time_total / 1e6}
                                for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]])
        tmp = out / f".rank{self.rank}.summary.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(summary, indent=1))
        os.replace(tmp, out / f"rank{self.rank}.summary.json")
        if client is None:
            logger.info("profile of steps %s written to %s", self.window, out)
            return
        try:
            self._upload(client, trace, out / f"rank{self.rank}.summary.json", summary)
        finally:
            shutil.rmtree(out, ignore_errors=True)

    def _upload(self, client: Any, trace: Path, summary_path: Path, summary: dict[str, Any]) -> None:
        """The trace and summary into the job's store, then the `Profile` event that says where they are."""
        from trainforge.infra.storage import open_store

        assert self.config is not None
        attempt = os.environ.get("TRAINFORGE_SEGMENT_ATTEMPT", "0")
        key = profile_key(self.config.storage_prefix, attempt, self.rank)
        store = open_store(self.config.storage_url)
        store.put_file(key, trace)
        store.put_file(summary_key(key), summary_path)
        a, b = self.window or (0, 0)
        numbers = {k: float(v) for k, v in summary.items()
                   if isinstance(v, int | float) and not isinstance(v, bool) and k != "rank"}
        self.published = Profile(rank=self.rank, start_step=a, end_step=b, trace=key, summary=numbers,
                                 src=Sender(job=self.config.job_id, attempt=int(attempt) if attempt.isdigit()
                                            else None, rank=self.rank))
        client.publish(dump_event(self.published))
        logger.info("profile of steps %s:%s uploaded to %s", a, b, key)

    def close(self) -> None:
        if self.prof is not None:  # the segment ended inside the window
            self._finish()
        self.wait()
