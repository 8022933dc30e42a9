"""infra/backends/node_folders.py: a hosts job's folders on a machine are held while its agent runs, removed when the
job ends (never from under a running agent), and swept by age when the end was never seen there."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from trainforge.infra.backends.hosts import remove_job_folders
from trainforge.infra.backends.node_folders import JOB_MARK, hold, main, release, remove_node, sweep


def job_tree(work: Path, job: str, nodes: list[str], segments: int = 2) -> None:
    (work / job).mkdir(parents=True)
    (work / job / JOB_MARK).touch()  # as `hold` leaves it
    for node in nodes:
        (work / job / node / "inputs" / "datasets").mkdir(parents=True)
        (work / job / node / "inputs" / "datasets" / "shard-0.bin").write_bytes(b"x" * 100)
        for n in range(segments):
            (work / job / f"segment-{n}" / node / "logs").mkdir(parents=True)
            (work / job / f"segment-{n}" / node / "agent.log").write_text("log")


def test_a_held_folder_is_in_use_and_removed_once_its_agent_let_go(tmp_path):
    job_tree(tmp_path, "job-a", ["n1", "n2"])
    fd = hold(tmp_path / "job-a" / "n1")
    assert remove_node(tmp_path, "job-a", "n1") == "in use"
    assert (tmp_path / "job-a" / "n1" / "inputs").is_dir() and (tmp_path / "job-a" / "segment-1" / "n1").is_dir()
    os.close(fd)  # the agent ended
    assert remove_node(tmp_path, "job-a", "n1") == "removed"
    assert not (tmp_path / "job-a" / "n1").exists()
    assert not list((tmp_path / "job-a").glob("segment-*/n1"))
    assert not list((tmp_path / "job-a").glob(".removing-*"))
    # the other node's folders are its own host's business
    assert (tmp_path / "job-a" / "n2" / "inputs").is_dir() and (tmp_path / "job-a" / "segment-0" / "n2").is_dir()
    assert remove_node(tmp_path, "job-a", "n2") == "removed"
    assert not (tmp_path / "job-a").exists()  # the last node's removal takes the job's folder
    assert remove_node(tmp_path, "job-a", "n2") == "absent"


def test_hold_makes_the_folder_and_marks_it_used_now(tmp_path):
    folder = tmp_path / "job-b" / "n1"
    fd = hold(folder)
    try:
        assert folder.is_dir() and time.time() - folder.stat().st_mtime < 60
        os.utime(folder, (0, 0))
        fd2 = hold(folder)  # a second agent of the job on this host (shared locks)
        assert folder.stat().st_mtime > 0
        os.close(fd2)
    finally:
        os.close(fd)


def test_an_agent_starting_while_its_folder_is_removed_gets_a_fresh_one(tmp_path, monkeypatch):
    """The remover renames the folder away under its exclusive lock; an agent that opened the old folder and waited
    for the lock must not hold a folder that is about to be deleted."""
    import fcntl

    from trainforge.infra.backends import node_folders

    folder = tmp_path / "job-c" / "n1"
    folder.mkdir(parents=True)
    (folder / "old").write_text("from before")
    remover = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(remover, fcntl.LOCK_EX)
    opened = threading.Event()
    real_open = node_folders._open_dir

    def open_and_tell(path: Path) -> int:
        fd = real_open(path)
        opened.set()
        return fd

    monkeypatch.setattr(node_folders, "_open_dir", open_and_tell)
    result: list[int] = []
    waiter = threading.Thread(target=lambda: result.append(hold(folder, timeout_s=20)))
    waiter.start()
    assert opened.wait(20)  # the agent opened the old folder and waits for the lock
    os.rename(folder, folder.with_name(".removing-n1-test"))
    os.close(remover)
    waiter.join(20)
    assert result, "hold never returned"
    fd = result[0]
    assert os.fstat(fd).st_ino == os.stat(folder).st_ino and not (folder / "old").exists()
    os.close(fd)


def test_release_marks_the_folder_used_until_the_agent_ended(tmp_path):
    folder = tmp_path / "job-h" / "n1"
    fd = hold(folder)
    os.utime(folder, (0, 0))  # a segment that ran for days: nothing touched the folder itself meanwhile
    release(fd)
    assert time.time() - folder.stat().st_mtime < 60
    assert sweep(tmp_path, "n1", keep_job="other", max_age_s=3600) == []


def test_links_never_point_the_removal_elsewhere(tmp_path):
    """A work folder others can write to (the default is under /tmp) may hold planted links: a link named like a
    job, a segment or a node folder is never followed."""
    outside = tmp_path / "outside"
    (outside / "n1").mkdir(parents=True)
    (outside / "n1" / "precious").write_text("not the job's")
    (outside / JOB_MARK).touch()
    work = tmp_path / "work"
    job_tree(work, "job-i", ["n2"])
    (work / "job-i" / "segment-7").symlink_to(outside)  # segment-7/n1 -> outside/n1
    (work / "job-j").mkdir()
    (work / "job-j" / JOB_MARK).touch()
    (work / "job-j" / "n1").symlink_to(outside / "n1")  # the node folder itself a link
    (work / "job-k").symlink_to(outside)  # a whole job folder a link
    assert remove_node(work, "job-i", "n1") == "absent"
    assert remove_node(work, "job-j", "n1") == "absent"
    assert remove_node(work, "job-k", "n1") == "absent"
    assert sweep(work, "n1", keep_job="none", max_age_s=0) == []
    assert (outside / "n1" / "precious").read_text() == "not the job's"


def test_a_removal_that_did_not_finish_is_finished_by_the_next(tmp_path):
    job_tree(tmp_path, "job-l", ["n1"])
    # a removal killed after its renames: the node's folders are hidden, nobody else will look at them
    (tmp_path / "job-l" / "n1").rename(tmp_path / "job-l" / ".removing-n1-dead0001")
    (tmp_path / "job-l" / "segment-0" / "n1").rename(tmp_path / "job-l" / "segment-0" / ".removing-n1-dead0002")
    old = time.time() - 30 * 3600
    os.utime(tmp_path / "job-l" / "segment-1" / "n1", (old, old))
    assert sweep(tmp_path, "n1", keep_job="other", max_age_s=6 * 3600) == ["job-l"]
    assert not (tmp_path / "job-l").exists()


def test_the_sweep_removes_only_unheld_folders_of_other_jobs_unused_for_long_enough(tmp_path):
    for job in ("old-free", "old-held", "recent", "this-job"):
        job_tree(tmp_path, job, ["n1", "n2"], segments=1)
    long_ago = time.time() - 7 * 3600
    for job in ("old-free", "old-held", "this-job"):
        for node in ("n1", "n2"):
            os.utime(tmp_path / job / node, (long_ago, long_ago))
    fd = hold(tmp_path / "old-held" / "n1")
    os.utime(tmp_path / "old-held" / "n1", (long_ago, long_ago))  # a segment that has run for 7 hours
    try:
        assert sweep(tmp_path, "n1", keep_job="this-job", max_age_s=6 * 3600) == ["old-free"]
    finally:
        os.close(fd)
    assert not (tmp_path / "old-free" / "n1").exists() and not (tmp_path / "old-free" / "segment-0" / "n1").exists()
    assert (tmp_path / "old-free" / "n2").is_dir()  # another host's node
    for job in ("old-held", "recent", "this-job"):
        assert (tmp_path / job / "n1" / "inputs").is_dir(), job
    assert sweep(tmp_path / "missing", "n1", keep_job="x", max_age_s=0) == []
    # nothing but what `hold` made: a folder in the work folder without the job mark (a home, a user's) stays
    (tmp_path / "homes" / "n1").mkdir(parents=True)
    os.utime(tmp_path / "homes" / "n1", (long_ago, long_ago))
    assert sweep(tmp_path, "n1", keep_job="this-job", max_age_s=0) == ["old-held", "recent"]  # its agent ended
    assert (tmp_path / "homes" / "n1").is_dir()


def test_the_command_prints_its_outcome_and_refuses_a_path_for_a_name(tmp_path, capsys):
    job_tree(tmp_path, "job-d", ["n1"])
    assert main(["remove", "--work-dir", str(tmp_path), "--job", "job-d", "--node", "n1"]) == 0
    assert json.loads(capsys.readouterr().out) == {"outcome": "removed"}
    (tmp_path / "keep").mkdir()
    for job, node in (("..", "keep"), ("job-d/../..", "n1"), ("job-d", "../keep"), (".hidden", "n1")):
        assert main(["remove", "--work-dir", str(tmp_path / "job-d"), "--job", job, "--node", node]) == 1
        assert "is not a plain folder name" in json.loads(capsys.readouterr().out)["error"]
    assert (tmp_path / "keep").is_dir()


def test_the_flow_removes_a_jobs_folders_on_every_host_through_the_runner(tmp_path):
    job_tree(tmp_path, "job-e", ["h1", "h2", "h3"])
    fd = hold(tmp_path / "job-e" / "h3")  # h3's agent still runs (a host partitioned away, its agent stopped)
    try:
        outcomes = remove_job_folders("env TF_TEST_HOST={host} sh -c {command}", sys.executable, str(tmp_path),
                                      "job-e", ["h1", "h2", "h3", "h4"])
    finally:
        os.close(fd)
    assert outcomes == {"h1": "removed", "h2": "removed", "h3": "in use", "h4": "absent"}
    assert sorted(p.name for p in (tmp_path / "job-e").iterdir()) == [JOB_MARK, "h3", "segment-0", "segment-1"]


def test_a_host_that_does_not_answer_keeps_its_folders_and_is_named(tmp_path):
    t0 = time.monotonic()
    outcomes = remove_job_folders("sh -c 'sleep 30' {host} {argv}", sys.executable, str(tmp_path), "job-f",
                                  ["h1", "h2"], timeout_s=1.0)
    assert time.monotonic() - t0 < 10
    assert outcomes == {"h1": "no answer within 1 s", "h2": "no answer within 1 s"}
    outcomes = remove_job_folders("no-such-runner-{host} {argv}", sys.executable, str(tmp_path), "job-f", ["h1"])
    assert outcomes["h1"].startswith("its runner could not be started")


@pytest.mark.parametrize("keep_h", [0.0, 2.0])
def test_the_launcher_keeps_a_finished_jobs_folders_only_when_asked(tmp_path, keep_h):
    from trainforge.plan.cluster import LauncherSpec
    from trainforge.registry.jobs import JobStore
    from trainforge.tasks.segment import remove_node_folders

    record = JobStore(tmp_path / "jobs").create("job-g")
    record.update(segments=[{"attempt": 0, "nodes": ["h1", "h2", "h4"]}, {"attempt": 1, "nodes": ["h2", "h3"]}],
                  incidents=[{"scope": "node", "host": "h4", "attempt": 0, "kind": "lost"},
                             {"scope": "rank", "host": "h2", "attempt": 1, "kind": "exit"}])
    work = tmp_path / "work"
    job_tree(work, "job-g", ["h1", "h2", "h3", "h4"])
    launcher = LauncherSpec(backend="hosts", runner="env H={host} sh -c {command}", work_dir=str(work),
                            keep_node_folders_h=keep_h)
    outcomes = remove_node_folders(record, launcher)
    if keep_h:
        assert outcomes == {} and (work / "job-g" / "h1" / "inputs").is_dir()
    else:
        # the host the job lost is not waited on (it may not answer): its next agent sweeps its folders
        assert outcomes == {"h1": "removed", "h2": "removed", "h3": "removed",
                            "h4": "lost by the job: left to the host's next agent"}
        assert sorted(p.name for p in (work / "job-g").iterdir()) == [JOB_MARK, "h4", "segment-0", "segment-1"]


def test_a_host_named_like_a_segment_folder_is_refused():
    from pydantic import ValidationError

    from trainforge.plan.cluster import HostSpec

    with pytest.raises(ValidationError, match="also the name of a job's segment folder"):
        HostSpec(name="segment-3", address="10.0.0.3")
    assert HostSpec(name="segment-a", address="10.0.0.3").name == "segment-a"
