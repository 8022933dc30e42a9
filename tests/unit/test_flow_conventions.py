"""The train-job flow's Prefect conventions, without a server: its `spec` parameter is a JobSpec (the deployment's
schema the UI renders as a form), validated by trainforge's own parser before the flow starts (every problem named,
a literal secret never logged); the flow run takes the job's id as its name; a gang waiting in the queue is told
its position and the scheduler's reason (pure `queue_wait`, and the watcher thread around a blocking request).

Run: .venv/bin/python -m pytest tests/unit/test_flow_conventions.py -q
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import yaml
from prefect.exceptions import ParameterTypeError
from prefect.utilities.callables import parameter_schema

from tests.integration.test_train_job import EXAMPLES
from trainforge.flows.train_job import train_job
from trainforge.registry.jobs import is_job_id, new_job_id
from trainforge.spec import JobSpec
from trainforge.tasks.provision import QueueWait, queue_wait, watching_queue

SECRET = "sk-live-0123456789abcdefghijklmnopqrstuv"


def demo_doc() -> dict:
    return yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())


def test_the_spec_parameter_is_a_jobspec_form():
    schema = parameter_schema(train_job).model_dump_for_openapi()
    assert list(schema["properties"]) == ["spec", "source", "base_dir", "job_id", "resume"]
    assert schema["required"] == ["spec"]
    spec = schema["properties"]["spec"]
    assert spec["$ref"] == "#/definitions/JobSpec" and "job spec" in spec["description"]
    job = schema["definitions"]["JobSpec"]
    assert {"name", "team", "code", "dataset", "resources", "training"} <= set(job["required"])
    assert schema["definitions"]["GpuType"]["enum"]  # choices render as a select
    assert job["additionalProperties"] is False


def test_a_document_becomes_a_jobspec_and_a_bad_one_is_refused_with_its_problems(caplog):
    assert isinstance(train_job.validate_parameters({"spec": demo_doc()})["spec"], JobSpec)
    bad = demo_doc()
    bad["training"]["max_stepz"] = 3
    bad["env"] = {"API_KEY": SECRET}
    with caplog.at_level(logging.DEBUG), pytest.raises(ParameterTypeError) as info:
        train_job.validate_parameters({"spec": bad})
    message = str(info.value)
    assert "training.max_stepz: unknown field" in message and "did you mean `max_steps`" in message
    assert "env.API_KEY" in message and "secret store" in message
    assert SECRET not in message and SECRET not in caplog.text  # Prefect would log the parameters verbatim
    assert "Parameter validation failed for flow 'train-job'" in caplog.text


def test_job_ids_name_flow_runs():
    job_id = new_job_id("tiny-cpu")
    assert is_job_id(job_id, "tiny-cpu")
    assert not is_job_id(job_id, "tiny") and not is_job_id("tiny-cpu-mine", "tiny-cpu")
    assert not is_job_id("curious-otter", "tiny-cpu")  # a random Prefect run name is not taken for an id


def row(job_id, state="pending", priority="normal", gpu="h100", since=10.0, reason="waiting for 8 free h100 GPUs",
        position=None):
    return {"job_id": job_id, "state": state, "priority": priority, "gpu_type": gpu, "since_s": since,
            "reason": reason, "position": position}


@pytest.mark.parametrize(("rows", "job", "expected"), [
    ([], "a", None),
    ([row("a", state="running", reason="")], "a", None),
    ([row("a", position=1)], "a", QueueWait(1, 1, "h100", "waiting for 8 free h100 GPUs")),
    # the position is the scheduler's (its pass order), not the rows' priority or age: a poorer team's normal
    # gang goes ahead of a richer team's high job however recent
    ([row("a", since=50.0, priority="high", position=2), row("b", since=1.0, position=1)], "a",
     QueueWait(2, 2, "h100", "waiting for 8 free h100 GPUs")),
    # other GPU types and running jobs are not counted
    ([row("a", reason="quota", position=1), row("b", gpu="a100-80gb", since=99.0, position=1),
      row("c", state="running", since=99.0)], "a", QueueWait(1, 1, "h100", "quota")),
])
def test_queue_wait(rows, job, expected):
    assert queue_wait(rows, job) == expected


def test_watching_queue_reports_changes_while_the_request_blocks():
    class Scheduler:
        def __init__(self):
            self.rows = [row("a", since=1.0), row("b", since=9.0)]

        def queue(self):
            return list(self.rows)

    sched, heard = Scheduler(), []
    with watching_queue(sched, "a", heard.append, every_s=0.02):
        deadline = time.monotonic() + 5
        while len(heard) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # unchanged: said once
        sched.rows = [row("a", since=2.0)]  # b was admitted
        while len(heard) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert [(w.position, w.pending) for w in heard] == [(2, 2), (1, 1)]
    assert not any(t.name == "queue-watch-a" for t in threading.enumerate())  # stopped with the request


def test_the_last_checkpoint_is_exported_as_it_commits_only_when_promotion_will_take_it():
    from trainforge.flows.train_job import promotes_on_commit

    doc = demo_doc()
    ranked = JobSpec.model_validate(doc)  # the demo ranks its checkpoints by eval_loss (keep_best)
    doc["checkpoint"].pop("keep_best")
    newest = JobSpec.model_validate(doc)
    total = newest.training.total_steps
    assert promotes_on_commit(total, total, newest)
    assert not promotes_on_commit(total - 1, total, newest)  # a later one will be newer
    assert not promotes_on_commit(total, total, ranked)  # the best by an evaluation still to come
