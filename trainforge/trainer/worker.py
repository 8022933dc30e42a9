"""Worker entry point, run by torchrun on every rank: `python -m trainforge.trainer.worker`.

Reads the resolved job config from $TRAINFORGE_JOB_CONFIG, trains one segment, and on failure writes a report
(rank, exception, traceback, whether it is the user's code or the infrastructure) for the control plane before
exiting non-zero. Rank and world size come from torchrun's environment; the model code never sees them.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import socket
import sys
import time
import traceback
from pathlib import Path

from trainforge.contract.config import ENV_VAR, SegmentConfig
from trainforge.contract.events import Divergence
from trainforge.contract.script_env import script_environment
from trainforge.events import event_sink, rank_client, worker_sender
from trainforge.trainer import output_mask
from trainforge.trainer.health import HealthPolicy, current_monitor, start_monitor
from trainforge.trainer.inbox import NoticeWatch, rank_inbox

USER_ERRORS = ("UserCodeError", "OutOfMemoryError", "MemoryError", "FloatingPointError", "InjectedFault",
               # data read in place that changed since it was pinned, or cannot be parsed: a retry reads the same
               "DatasetChangedError", "DataFormatError")
INFRA_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError", "ConnectionError", "TimeoutError")


def classify(exc: BaseException) -> str:
    """`user` faults are not retried forever; `infra` faults are what segment retries exist for; `divergence`
    (policy: rollback) is retried from the last good checkpoint with the offending batch skipped."""
    if type(exc).__name__ == "DivergenceError":
        return "divergence" if getattr(exc, "action", "stop") == "rollback" else "user"
    names = {t.__name__ for t in type(exc).__mro__}
    if names & set(INFRA_ERRORS):
        return "infra"
    if names & set(USER_ERRORS):
        return "user"
    text = str(exc).lower()
    if any(s in text for s in ("gloo", "nccl", "connection reset", "connection closed", "timed out")):
        return "infra"
    # An exception raised from a frame outside the platform's own code is the user's.
    tb = traceback.extract_tb(exc.__traceback__)
    platform_root = str(Path(__file__).resolve().parents[1])
    if tb and not tb[-1].filename.startswith(platform_root) and "site-packages/torch" not in tb[-1].filename:
        return "user"
    return "user" if isinstance(exc, (ValueError, TypeError, AttributeError, KeyError, IndexError)) else "infra"


def write_failure(cfg: SegmentConfig, rank: int, exc: BaseException) -> None:
    """The rank's failure report: through the node's publisher to the control plane (which keeps it in the job's
    failures/ folder), or into run_dir/failures when the worker has no publisher."""
    attempt = os.environ.get("TRAINFORGE_SEGMENT_ATTEMPT", "0")
    mask = output_mask.start_from_env().mask  # what the report quotes is masked like the rank's own output
    report = {
        "rank": rank,
        "attempt": attempt,
        "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
        "kind": classify(exc),
        "exception": mask(f"{type(exc).__name__}: {exc}"),
        "traceback": mask("".join(traceback.format_exception(exc)))[-8000:],
        "time": time.time(),
    }
    if hasattr(exc, "step") and type(exc).__name__ == "DivergenceError":
        report.update(step=exc.step, reason=exc.reason)
    client = rank_client(rank)
    if client is not None:
        # The envelope's `type` tells the control plane it is a failure report (contract/events.py FailureReport).
        client.publish({"type": "failure", "host": socket.gethostname(), **report})
        client.drain(5.0)  # the process exits next (os._exit): nothing may stay in the client's buffer
        return
    folder = Path(cfg.run_dir) / "failures"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"segment-{attempt}-rank-{rank:05d}.json").write_text(json.dumps(report, indent=1))


def report_divergence(cfg: SegmentConfig, rank: int, exc: BaseException) -> None:
    """Rank 0's account of a divergence (every rank raises it: they agree on it in one all-reduce), sent before
    the failure report: the typed `Divergence` the control side journals. The rollback itself is decided from the
    failure report (kind `divergence`), which also names the offending samples (tasks/segment.py)."""
    if rank != 0 or type(exc).__name__ != "DivergenceError":
        return
    action = getattr(exc, "action", "stop")
    sink = event_sink(cfg.run_dir, True, worker_sender(cfg.job_id, rank))
    sink.publish(Divergence(step=int(getattr(exc, "step", 0)), reason=str(getattr(exc, "reason", exc)),
                            action=action if action in ("rollback", "stop") else "stop"))


def watch_notices(cfg: SegmentConfig, rank: int) -> NoticeWatch | None:
    """Report the preemption / resize / termination notices this rank gets (trainer/inbox.py); only with a node
    publisher (nobody would read them otherwise)."""
    inbox = rank_inbox()
    if inbox is None:
        return None
    return NoticeWatch(inbox, current_monitor(), rank=rank, src=worker_sender(cfg.job_id, rank)).start()


def run_script(cfg: SegmentConfig) -> None:
    """Script mode: run the user's own script in this process with the framework's distributed environment.
    The script initialises its own process group (torch env://, jax.distributed, TF_CONFIG)."""
    import runpy

    code = cfg.code
    script = Path(cfg.code_dir) / cfg.entrypoint
    if not script.is_file():
        from trainforge.trainer.loop import UserCodeError

        raise UserCodeError(f"script-mode entrypoint {cfg.entrypoint!r} is not a file under {cfg.code_dir}")
    os.environ.update(script_environment(code.framework, dict(os.environ)))
    os.environ["TRAINFORGE_RUN_DIR"] = cfg.run_dir
    sys.argv = [str(script), *code.args]
    sys.path.insert(0, str(script.parent))
    # A plain script reports no steps: its ranks get liveness checks only (lost heartbeat = lost rank), never the
    # start-up or step-progress hang timeouts. `trainforge.runtime.init()` moves it back under those.
    current_monitor().set_phase("script")
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:  # sys.exit(0) from the script is success, anything else a failure
        if exc.code not in (0, None):
            raise


def start_health(cfg: SegmentConfig, rank: int) -> HealthPolicy:
    """Heartbeats, stack dumps on SIGUSR1 and the termination-notice handler, before anything slow runs."""
    policy = cfg.health.with_env()
    managed = not cfg.script_mode  # a script handles its own SIGTERM
    start_monitor(policy, cfg.run_dir, rank, os.environ.get("TRAINFORGE_SEGMENT_ATTEMPT", "0"),
                  handle_sigterm=managed)
    return policy


def main() -> int:
    output_mask.start_from_env()  # before anything prints: the job's secrets never reach a captured stream
    cfg = SegmentConfig.load(os.environ[ENV_VAR])
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    policy = start_health(cfg, rank)
    watch_notices(cfg, rank)
    if os.environ.get("TRAINFORGE_JOB_S3_ACCESS_KEY_ID"):  # the job's own identity: report what it is refused
        from trainforge.trainer import store_audit

        store_audit.install(event_sink(cfg.run_dir, True, worker_sender(cfg.job_id, rank)).publish)
    # Imported here so a broken torch install is reported like any other failure.
    try:
        # A gang on other machines: the code, dataset and initial weights come from the object store into this
        # node's folder (nothing below reads the flow's host); one host: the config as it is.
        from trainforge.trainer.inputs import localize

        cfg = localize(cfg)
        if cfg.script_mode:
            run_script(cfg)
            # The script's globals hold themselves in a cycle (its functions point back at them): collected now, a
            # buffered file or an object that flushes in __del__ is closed before exit_now skips the teardown.
            gc.collect()
            current_monitor().close()  # the supervisor's last pass must see this rank finished, not lost
            return 0
        from trainforge.trainer.distributed import DistContext, shutdown
        from trainforge.trainer.loop import train

        # The process group lives on the agent's store, prefixed per restart attempt (DistContext.from_env).
        ctx = DistContext.from_env(min(cfg.collective_timeout_s, policy.collective_timeout_s))
        # train() owns the model: it is freed before the process group is destroyed (gloo shutdown trap).
        result = train(cfg, ctx)
        logging.getLogger(__name__).info("segment done: %s", result)
        shutdown(ctx)
        current_monitor().close()
    except BaseException as exc:  # report everything, then fail the worker
        current_monitor().close("failed")
        with contextlib.suppress(Exception):  # the failure report below is what the control plane needs
            report_divergence(cfg, rank, exc)
        write_failure(cfg, rank, exc)
        traceback.print_exc()
        sys.stderr.flush()
        output_mask.close()
        os._exit(1)  # peers may be blocked in a collective: don't wait for a clean interpreter exit
    return 0


if __name__ == "__main__":
    code = main()
    output_mask.close()
    from trainforge.trainer.process_exit import exit_now

    exit_now(code)  # not the interpreter's teardown: the segment's end would wait for it (process_exit.py)
