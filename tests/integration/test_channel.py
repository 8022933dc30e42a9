"""The channel across processes on a real S3 server (SeaweedFS, tests/fixtures/s3.py): three node publishers as
real processes (`python -m trainforge.contract.channel publish`), read by the control side's ChannelReader.
One is killed with SIGKILL and must be reported lost within 5 s while the others stay live; commands written down
reach a publisher process and come back acknowledged; a stop ends the others cleanly.

Run: PYTHONPATH=$PWD .venv/bin/python -m pytest tests/integration/test_channel.py -q
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from trainforge.contract.channel import ChannelReader, CommandWriter, JsonLinesProcess, channel_root

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
CHANNEL = channel_root("teams/t/jobs/channel-it")


def _publisher(node: str, bucket: str, env: dict[str, str]) -> JsonLinesProcess:
    return JsonLinesProcess(
        [sys.executable, "-m", "trainforge.contract.channel", "publish", "--store", f"s3://{bucket}",
         "--root", CHANNEL, "--node", node, "--ranks", "2", "--flush-interval", "1.0"],
        name=node, cwd=ROOT, env=env)


def _until(cond: Callable[[], bool], timeout: float, what: str, step: float = 0.1) -> float:
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout, f"{what}: not within {timeout} s"
        time.sleep(step)
    return time.monotonic() - start


@pytest.fixture
def bucket(s3_server):
    name = s3_server.make_bucket()
    yield name
    s3_server.delete_bucket(name)


@pytest.mark.timing
def test_real_publishers_on_s3_a_killed_node_is_lost_within_5s_and_commands_are_acknowledged(s3_server, bucket):
    env = {**os.environ, **s3_server.env(), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for name in ("TRAINFORGE_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        env.pop(name, None)
    nodes = ["node0", "node1", "node2"]
    store = s3_server.store(bucket)
    reader = ChannelReader(store, CHANNEL, nodes=nodes)  # defaults: lost after 3 s
    writer = CommandWriter(store, CHANNEL)
    pubs = {n: _publisher(n, bucket, env) for n in nodes}
    try:
        for p in pubs.values():
            p.expect("ready", timeout=60)

        def all_live() -> bool:
            reader.poll()
            return all(s.state == "live" for s in reader.status().values())

        _until(all_live, 30, "all three publishers live")
        assert set(reader.heartbeats["node1"]) == {"0", "1"}  # one beat per rank rides on each batch

        # A command down reaches the process (no pid used) and comes back acknowledged in a batch.
        seq = writer.send("dump_stacks", nodes=["node1"])
        got = pubs["node1"].expect("command", timeout=15)
        assert (got["seq"], got["kind"]) == (seq, "dump_stacks")

        def acked() -> bool:
            reader.poll()
            return reader.acked_by(seq) == {"node1"}

        _until(acked, 15, "the dump_stacks acknowledgement")

        # SIGKILL: no last batch, no goodbye. The reader polls at its default cadence.
        pubs["node2"].proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()

        def node2_lost() -> bool:
            reader.poll()
            return "node2" in reader.lost_nodes()

        _until(node2_lost, 15, "node2 reported lost", step=0.25)
        detection_s = time.monotonic() - killed_at
        print(f"lost-node detection: {detection_s:.2f} s")
        assert detection_s <= 5.0, f"lost-node detection took {detection_s:.2f} s"
        states = {n: s.state for n, s in reader.status().items()}
        assert states == {"node0": "live", "node1": "live", "node2": "lost"}, states

        # A stop to everyone: the live ones acknowledge it and end cleanly (their last batch says closing).
        stop = writer.send("stop")
        for n in ("node0", "node1"):
            assert pubs[n].proc.wait(timeout=30) == 0
            pubs[n].expect("closed", timeout=5)
        reader.poll()
        assert reader.acked_by(stop) == {"node0", "node1"}
        assert {n: s.state for n, s in reader.status().items()} == {"node0": "closed", "node1": "closed",
                                                                     "node2": "lost"}
    finally:
        for p in pubs.values():
            p.kill()
        reader.close()
