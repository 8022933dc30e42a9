"""A segment that cannot launch because an optional package is missing (no torch for the local ranks) is given up
at once with the install hint, not retried as an infrastructure failure. Run: pytest tests/unit/test_missing_extra.py
"""

from __future__ import annotations

from types import SimpleNamespace

from trainforge._optional import MissingConditionalImportError
from trainforge.contract.controller import Action, History, SegmentController
from trainforge.tasks.driver import failure_outcome


def test_a_missing_extra_is_not_retried_but_a_broken_launch_is():
    record = SimpleNamespace(data={})
    controller = SegmentController(History(total_steps=10, max_retries=3, max_rollbacks=0))
    missing = failure_outcome(record, MissingConditionalImportError("torch", "trainer", "training on this machine"))
    assert missing.kind == "user" and "pip install 'trainforge[trainer]'" in missing.message
    assert controller.decide(missing).action is Action.GIVE_UP
    broken = failure_outcome(record, RuntimeError("torchrun did not start"))
    assert broken.kind == "infra" and controller.decide(broken).action is not Action.GIVE_UP
