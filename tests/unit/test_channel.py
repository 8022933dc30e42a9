"""The channel (trainforge/contract/channel.py) on the local-folder store: batches in per-node order, de-duplication
of re-sent batches, lost-node detection, commands down with acknowledgements up, the lease, malformed batches
skipped with a warning, and the ranks' Unix-socket path to their publisher.

Run: PYTHONPATH=$PWD .venv/bin/python -m pytest tests/unit/test_channel.py -q
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from trainforge.contract.channel import (
    Batch,
    ChannelLayout,
    ChannelReader,
    Command,
    CommandWriter,
    MalformedBatchError,
    NodePublisher,
    RankClient,
    channel_root,
    decode_batch,
    encode_batch,
    estimate_channel_load,
)
from trainforge.infra.storage import LocalObjectStore, ObjectExistsError

pytestmark = pytest.mark.timeout(60)

ROOT = channel_root("teams/t/jobs/j")


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _wait(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


@pytest.fixture
def store(tmp_path: Path) -> LocalObjectStore:
    return LocalObjectStore(tmp_path / "objects")


def _put(store: LocalObjectStore, node: str, seq: int, records: list[dict], *, stamp: int | None = None,
         **kw) -> bytes:
    """A batch as a publisher writes it; `stamp` (ms): the key's sort position, by default now."""
    data = encode_batch(Batch(node, seq, time.time(), records, **kw))
    store.put_bytes(ChannelLayout(ROOT).batch_key(node, seq, int(time.time() * 1000) if stamp is None else stamp),
                    data)
    return data


class CountingStore(LocalObjectStore):
    """Records each listing's (prefix, start_after) and counts GETs."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.listings: list[tuple[str, str]] = []
        self.gets = 0

    def list(self, prefix="", *, start_after=""):
        self.listings.append((prefix, start_after))
        return super().list(prefix, start_after=start_after)

    def get_bytes(self, key, byte_range=None):
        self.gets += 1
        return super().get_bytes(key, byte_range)


# ---- envelope --------------------------------------------------------------------------------------------------


def test_a_batch_round_trips_and_its_key_sorts_by_stamp_then_node_then_seq():
    b = Batch("n1", 7, 123.5, [{"type": "metrics", "loss": 1.5}], {"0": {"step": 3, "age_s": 0.1}},
              [{"seq": 2, "kind": "stop", "at": 1.0}], cmd_seq=2, closing=True)
    assert decode_batch(encode_batch(b), node="n1", seq=7) == b
    layout = ChannelLayout(ROOT)
    assert layout.batch_key("n1", 7, 1_700_000_000_123) == f"{ROOT}/up/1700000000123-n1-000000000007.jsonl"
    keys = [layout.batch_key("n1", 10, 2000), layout.batch_key("n1", 9, 2000), layout.batch_key("a-b.c", 3, 1999)]
    assert [ChannelLayout.parse_batch_key(k) for k in sorted(keys)] == [(1999, "a-b.c", 3), (2000, "n1", 9),
                                                                        (2000, "n1", 10)]
    assert ChannelLayout.parse_batch_key(layout.batch_key("x-000000000001", 5, 1)) == (1, "x-000000000001", 5)
    assert layout.stamp_key(2000) < layout.batch_key("a", 0, 2000) and layout.stamp_key(2001) > keys[0]
    assert ChannelLayout.parse_batch_key(f"{ROOT}/up/notes.txt") is None
    with pytest.raises(ValueError, match="invalid node name"):
        layout.batch_key("a/b", 0, 0)


@pytest.mark.parametrize(("data", "reason"), [
    (b"not json\n", "not JSON"),
    (b"[1, 2]\n", "not an envelope"),
    (b'{"v": 99, "node": "n1", "seq": 0, "sent_at": 1, "n_records": 0}\n', "version"),
    (b'{"v": 1, "node": "n1", "seq": "0", "sent_at": 1, "n_records": 0}\n', "'seq'"),
    (b'{"v": 1, "node": "n1", "seq": 0, "sent_at": 1, "n_records": 2}\n{}\n', "announces 2"),
    (b'{"v": 1, "node": "n1", "seq": 0, "sent_at": 1, "n_records": 1}\n[1]\n', "not a JSON object"),
    (b'{"v": 1, "node": "n2", "seq": 0, "sent_at": 1, "n_records": 0}\n', "the key disagrees"),
])
def test_a_malformed_batch_is_refused_with_the_reason(data: bytes, reason: str):
    with pytest.raises(MalformedBatchError, match=reason):
        decode_batch(data, key="k", node="n1", seq=0)


# ---- reading ---------------------------------------------------------------------------------------------------


def test_the_reader_yields_each_node_in_seq_order_and_only_what_is_new(store):
    reader = ChannelReader(store, ROOT, flush_interval_s=0.0)
    for seq in range(3):
        _put(store, "n1", seq, [{"i": seq}])
    _put(store, "n2", 0, [{"i": 100}])
    store.put_bytes(f"{ROOT}/nodes/n1.json", b"{}")
    store.put_bytes(f"{ROOT}/nodes/n2.json", b"{}")
    batches = reader.poll()
    assert [(b.node, b.seq) for b in batches] == [("n1", 0), ("n1", 1), ("n1", 2), ("n2", 0)]
    assert [r["i"] for _, _, _, r in reader.records(batches)] == [0, 1, 2, 100]
    assert reader.poll() == []
    _put(store, "n1", 3, [{"i": 3}])
    assert [(b.node, b.seq) for b in reader.poll()] == [("n1", 3)]


def test_a_re_sent_batch_is_delivered_once_and_a_resumed_reader_re_delivers_nothing(store):
    reader = ChannelReader(store, ROOT, nodes=["n1"], flush_interval_s=0.0)
    data = _put(store, "n1", 0, [{"i": 0}], stamp=5000)
    assert len(reader.poll()) == 1
    layout = ChannelLayout(ROOT)
    store.put_bytes(layout.batch_key("n1", 0, 5000), data)  # the publisher's retry of a PUT that landed
    store.put_bytes(layout.batch_key("n1", 0, 5400), data)  # and a retry under a fresh stamp
    assert reader.poll() == []
    _put(store, "n1", 1, [{"i": 1}], stamp=5500)
    resumed = ChannelReader(store, ROOT, last_seen=json.loads(json.dumps(reader.checkpoint())), flush_interval_s=0.0)
    assert [b.seq for b in resumed.poll()] == [1]


def test_two_copies_of_a_batch_in_one_listing_are_read_once_without_a_get_for_the_second(tmp_path):
    store = CountingStore(tmp_path / "objects")
    data = _put(store, "n1", 0, [{"i": 0}], stamp=5000)
    store.put_bytes(ChannelLayout(ROOT).batch_key("n1", 0, 5300), data)  # a timed-out PUT that had landed
    _put(store, "n1", 1, [{"i": 1}], stamp=6000)
    reader = ChannelReader(store, ROOT, nodes=["n1"], flush_interval_s=0.0)
    batches = reader.poll(discover=False)
    assert [(b.seq, [r["i"] for r in b.records]) for b in batches] == [(0, [0]), (1, [1])]
    assert store.gets == 2 and reader.requests == 3  # one LIST, two GETs


def test_one_listing_per_poll_whatever_the_number_of_nodes(tmp_path):
    store = CountingStore(tmp_path / "objects")
    nodes = [f"n{i:02d}" for i in range(40)]
    reader = ChannelReader(store, ROOT, nodes=nodes, flush_interval_s=0.0)
    for rnd in range(3):
        for i, n in enumerate(nodes):
            _put(store, n, rnd, [{"i": rnd}], stamp=10_000 + 1000 * rnd + i)
        store.listings.clear()
        before = reader.requests
        batches = reader.poll(discover=False)
        assert len(batches) == 40 and {b.seq for b in batches} == {rnd}
        assert store.listings == [(f"{ROOT}/up/", store.listings[0][1])]  # ONE listing of up/ for 40 nodes
        assert reader.requests - before == 1 + 40  # and one GET per new batch
    # the next listing starts after the oldest live cursor: the previous round's keys are not listed again
    assert reader._start_after(reader._clock()) == ChannelLayout(ROOT).batch_key("n00", 2, 12_000)


def test_a_batch_that_lands_late_inside_the_window_is_delivered(tmp_path):
    """PUTs complete out of order: n1's batch stamped before n2's lands after the reader read n2's. It sorts
    before n2's key, yet after n1's own cursor, where the listing starts: it is read, once."""
    store = CountingStore(tmp_path / "objects")
    reader = ChannelReader(store, ROOT, nodes=["n1", "n2"], flush_interval_s=0.0)
    _put(store, "n1", 0, [{"i": "a0"}], stamp=1000)
    _put(store, "n2", 0, [{"i": "b0"}], stamp=1010)
    assert {(b.node, b.seq) for b in reader.poll(discover=False)} == {("n1", 0), ("n2", 0)}
    _put(store, "n2", 1, [{"i": "b1"}], stamp=2010)
    assert [(b.node, b.seq) for b in reader.poll(discover=False)] == [("n2", 1)]
    _put(store, "n1", 1, [{"i": "a1"}], stamp=2000)  # stamped before n2's seq 1, visible only now
    _put(store, "n2", 2, [{"i": "b2"}], stamp=3010)
    got = reader.poll(discover=False)
    assert [(b.node, b.seq) for b in got] == [("n1", 1), ("n2", 2)]
    assert store.listings[-1][1] == ChannelLayout(ROOT).batch_key("n1", 0, 1000)  # from n1's cursor
    assert reader.poll(discover=False) == []


def test_a_slow_put_of_a_node_whose_clock_lags_is_still_found(store):
    """A live node is held at its own cursor, not at a window on anyone's clock: 60 s of skew loses nothing."""
    reader = ChannelReader(store, ROOT, nodes=["fast", "slow"], flush_interval_s=0.0, lookback_s=10.0)
    now = 1_800_000_000_000
    _put(store, "fast", 0, [], stamp=now)
    _put(store, "slow", 0, [], stamp=now - 60_000)  # its clock is a minute behind
    reader.poll(discover=False)
    for i in range(1, 4):
        _put(store, "fast", i, [], stamp=now + 1000 * i)
    _put(store, "slow", 1, [{"late": True}], stamp=now - 59_000)
    got = {(b.node, b.seq) for b in reader.poll(discover=False)}
    assert ("slow", 1) in got and ("fast", 3) in got


def test_a_lost_node_holds_the_listing_back_at_most_lookback_s(tmp_path):
    store = CountingStore(tmp_path / "objects")
    clock = FakeClock()
    layout = ChannelLayout(ROOT)
    reader = ChannelReader(store, ROOT, nodes=["n1", "n2"], flush_interval_s=1.0, lost_after_s=3.0, lookback_s=10.0,
                           clock=clock)
    _put(store, "n1", 0, [], stamp=100_000)
    _put(store, "n2", 0, [], stamp=100_000)
    reader.poll(discover=False)
    for i in range(1, 31):  # n2 died; n1 goes on for 30 s
        clock.t += 1.0
        _put(store, "n1", i, [], stamp=100_000 + 1000 * i)
        reader.poll(discover=False)
        if 2 <= i <= 3:  # not lost yet: held exactly at its cursor (n1's moved past it)
            assert store.listings[-1][1] == layout.batch_key("n2", 0, 100_000)
    assert reader.lost_nodes() == ["n2"]
    assert store.listings[-1][1] == layout.stamp_key(100_000 + 29_000 - 10_000)  # newest seen minus lookback
    _put(store, "n2", 1, [{"back": True}], stamp=100_000 + 30_500)  # it was slow, not dead: found again
    clock.t += 1.0
    assert [(b.node, b.seq) for b in reader.poll(discover=False)] == [("n2", 1)]
    assert reader.lost_nodes() == []


def test_a_resumed_reader_lists_from_its_checkpoint_not_from_the_beginning(tmp_path):
    store = CountingStore(tmp_path / "objects")
    for i in range(5):
        _put(store, "n1", i, [{"i": i}], stamp=1000 + i)
        _put(store, "n2", i, [{"i": i}], stamp=1000 + i)
    first = ChannelReader(store, ROOT, flush_interval_s=0.0, max_batches_per_node=3)
    assert [(b.node, b.seq) for b in first.poll(discover=False)] == [(n, s) for n in ("n1", "n2") for s in range(3)]
    saved = json.loads(json.dumps(first.checkpoint()))  # a restarted control plane keeps it as JSON
    assert saved == {"n1": {"seq": 2, "key": ChannelLayout(ROOT).batch_key("n1", 2, 1002)},
                     "n2": {"seq": 2, "key": ChannelLayout(ROOT).batch_key("n2", 2, 1002)}}
    store.listings.clear()
    gets = store.gets
    resumed = ChannelReader(store, ROOT, last_seen=saved, flush_interval_s=0.0)
    got = resumed.poll(discover=False)
    assert [(b.node, b.seq) for b in got] == [(n, s) for n in ("n1", "n2") for s in (3, 4)]
    assert store.listings == [(f"{ROOT}/up/", saved["n1"]["key"])]
    assert store.gets - gets == 4  # only the new batches are read
    legacy = ChannelReader(store, ROOT, last_seen={"n1": 3, "n2": 4}, flush_interval_s=0.0)  # bare seqs
    assert [(b.node, b.seq) for b in legacy.poll(discover=False)] == [("n1", 4)]


def test_a_publisher_retrying_a_put_that_landed_delivers_every_record_exactly_once(store):
    """The at-least-once case end to end: the first PUT of each batch lands and then reports a failure."""

    class LandsThenFails(LocalObjectStore):
        failed: set[int] = set()  # batch seqs whose first PUT failed (each retry goes under a fresh key)

        def put_bytes(self, key, data, *, if_none_match=False):
            super().put_bytes(key, data, if_none_match=if_none_match)
            parsed = ChannelLayout.parse_batch_key(key)
            if parsed and parsed[2] not in self.failed:
                self.failed.add(parsed[2])
                raise TimeoutError(f"read timeout on {key}")

    flaky = LandsThenFails(store.root)
    reader = ChannelReader(store, ROOT, nodes=["n1"], flush_interval_s=0.05)
    pub = NodePublisher(flaky, ROOT, "n1", flush_interval_s=0.05, max_backoff_s=0.05).start()
    for i in range(20):
        pub.publish({"i": i})
        time.sleep(0.01)
    pub.close()
    seen = [r["i"] for _, _, _, r in reader.records(reader.poll())]
    assert seen == list(range(20))
    assert pub.stats["put_failures"] >= 2


def test_a_batch_the_flush_thread_gave_up_on_at_stop_lands_under_its_own_seq_before_the_closing_one(store):
    """A stop while a batch's PUTs land but report failures: the flush thread backs off and gives the batch up
    after `stop_retry_s`; close() retries that batch (same seq) before the closing batch. A closing batch under the
    given-up seq would be dropped by the reader as a re-sent copy, its records lost."""

    class FailsOnTheFlushThread(LocalObjectStore):
        def put_bytes(self, key, data, *, if_none_match=False):
            super().put_bytes(key, data, if_none_match=if_none_match)
            if "/up/" in key and threading.current_thread().name == "channel-n1":
                raise TimeoutError(f"read timeout on {key}")

    reader = ChannelReader(store, ROOT, nodes=["n1"], flush_interval_s=0.05)
    pub = NodePublisher(FailsOnTheFlushThread(store.root), ROOT, "n1", flush_interval_s=0.05, max_backoff_s=0.05)
    pub.stop_retry_s = 0.2
    pub.start()
    pub.publish({"i": 0})
    deadline = time.monotonic() + 10
    while pub.stats["put_failures"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    pub.publish({"i": 1})
    pub.publish({"i": 2})
    pub.close()
    batches = reader.poll()
    assert [r["i"] for _, _, _, r in reader.records(batches)] == [0, 1, 2]
    assert [b.seq for b in batches] == [0, 1]  # the given-up batch (its first flush: [] or [0]), the closing one
    assert batches[-1].closing and reader.status()["n1"].state == "closed"
    assert 2 <= pub.stats["put_failures"] <= 20  # the retries back off while stopping too: no busy loop


def test_a_malformed_batch_is_skipped_with_a_warning_and_the_next_one_read(store, caplog):
    reader = ChannelReader(store, ROOT, nodes=["n1"], flush_interval_s=0.0)
    store.put_bytes(ChannelLayout(ROOT).batch_key("n1", 0, 7000), b'{"v": 1, "node": "n1"}\n')
    _put(store, "n1", 1, [{"i": 1}], stamp=7001)
    with caplog.at_level(logging.WARNING, logger="trainforge.contract.channel"):
        batches = reader.poll()
    assert [b.seq for b in batches] == [1]
    assert reader.skipped == [ChannelLayout(ROOT).batch_key("n1", 0, 7000)]
    assert any("skipping malformed batch" in r.message and "n1-000000000000.jsonl" in r.message
               for r in caplog.records)


def test_a_node_is_lost_when_no_batch_arrived_for_lost_after_s(store):
    clock = FakeClock()
    reader = ChannelReader(store, ROOT, nodes=["n1", "n2", "n3"], lost_after_s=3.0, flush_interval_s=1.0, clock=clock)
    _put(store, "n1", 0, [])
    _put(store, "n2", 0, [])
    _put(store, "n3", 0, [], closing=True)
    reader.poll()
    assert {n: s.state for n, s in reader.status().items()} == {"n1": "live", "n2": "live", "n3": "closed"}
    clock.t += 2.0
    _put(store, "n1", 1, [])
    reader.poll()
    clock.t += 1.5  # n2 silent for 3.5 s, n1 for 1.5 s; a closed node ended cleanly and is never lost
    reader.poll()
    assert reader.lost_nodes() == ["n2"]
    assert reader.status()["n2"].age_s == pytest.approx(3.5)
    _put(store, "n2", 1, [])  # it was slow, not dead: live again
    reader.poll()
    assert reader.lost_nodes() == []


def test_a_node_that_just_delivered_is_not_listed_again_until_its_next_flush_is_due(store):
    clock = FakeClock()
    reader = ChannelReader(store, ROOT, nodes=["n1"], flush_interval_s=1.0, clock=clock)
    _put(store, "n1", 0, [])
    assert len(reader.poll(discover=False)) == 1
    assert reader.requests == 2  # one LIST, one GET
    _put(store, "n1", 1, [])
    clock.t += 0.5
    assert reader.poll(discover=False) == [] and reader.requests == 2  # not due: no request at all
    clock.t += 0.3
    assert [b.seq for b in reader.poll(discover=False)] == [1]


def test_a_reader_that_fell_behind_catches_up_a_bounded_number_of_batches_per_poll(store):
    reader = ChannelReader(store, ROOT, nodes=["n1"], flush_interval_s=0.0, max_batches_per_node=4)
    for seq in range(10):
        _put(store, "n1", seq, [{"i": seq}])
    assert [[b.seq for b in reader.poll()] for _ in range(4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], []]


def test_a_node_that_never_publishes_is_lost_too(store):
    clock = FakeClock()
    reader = ChannelReader(store, ROOT, nodes=["n9"], lost_after_s=3.0, flush_interval_s=1.0, clock=clock)
    reader.poll()
    assert reader.status()["n9"].state == "waiting"
    clock.t += 3.1
    assert reader.lost_nodes() == ["n9"]


def test_publishers_are_discovered_and_beat_once_per_rank_per_flush(store):
    reader = ChannelReader(store, ROOT, flush_interval_s=0.05)
    with NodePublisher(store, ROOT, "n1", flush_interval_s=0.05) as pub:
        pub.heartbeat(0, step=5)
        pub.heartbeat(1, step=5)
        _wait(lambda: bool(reader.poll()) and set(reader.heartbeats.get("n1", {})) == {"0", "1"})
    assert reader.heartbeats["n1"]["0"]["step"] == 5
    # the publisher's last batch, marked closing
    _wait(lambda: reader.poll() is not None and reader.status()["n1"].state == "closed")


def test_a_restarted_publisher_continues_its_seqs_and_does_not_replay_handled_commands(store):
    writer = CommandWriter(store, ROOT)
    got: list[Command] = []
    pub = NodePublisher(store, ROOT, "n1", flush_interval_s=0.05)
    pub.on_command(got.append)
    pub.start()
    writer.send("dump_stacks")
    _wait(lambda: len(got) == 1)
    pub.close()
    last = pub.seq
    again: list[Command] = []
    pub2 = NodePublisher(store, ROOT, "n1", flush_interval_s=0.05)
    pub2.on_command(again.append)
    pub2.start()
    writer.send("stop")
    _wait(lambda: len(again) == 1)
    pub2.close()
    assert [c.kind for c in again] == ["stop"]
    seqs = [p[2] for k in store.list(ChannelLayout(ROOT).up_prefix) if (p := ChannelLayout.parse_batch_key(k))]
    assert sorted(seqs) == list(range(pub2.seq)) and pub2.seq > last


def test_a_publisher_restarted_after_a_crash_finds_its_last_seq_from_its_index(tmp_path):
    """No clean close (kill -9): the hello's index is older than the last batches; the restarted publisher lists
    only the stretch of up/ after the index and continues after the last seq it finds."""
    store = CountingStore(tmp_path / "objects")
    pub = NodePublisher(store, ROOT, "n1", flush_interval_s=0.02).start()
    _wait(lambda: pub.seq >= 5)
    pub._stop.set()  # a crash: its thread stops, no closing batch, no index after the start
    for t in pub._threads:
        t.join(5)
    hello = json.loads(store.get_bytes(ChannelLayout(ROOT).node_key("n1")))
    assert hello["next_seq"] == 0 and hello["first_seq"] == 0
    store.listings.clear()
    pub2 = NodePublisher(store, ROOT, "n1", flush_interval_s=0.02).start()
    pub2.close()
    assert store.listings[0] == (f"{ROOT}/up/", ChannelLayout(ROOT).stamp_key(hello["first_stamp_ms"]))
    seqs = [p[2] for k in store.list(ChannelLayout(ROOT).up_prefix) if (p := ChannelLayout.parse_batch_key(k))]
    assert sorted(seqs) == list(range(pub2.seq)) and pub2.seq > pub.seq
    hello2 = json.loads(store.get_bytes(ChannelLayout(ROOT).node_key("n1")))
    assert (hello2["first_stamp_ms"], hello2["next_seq"]) == (hello["first_stamp_ms"], pub2.seq)


# ---- commands and the lease ------------------------------------------------------------------------------------


def test_commands_reach_their_nodes_and_are_acknowledged_up(store):
    writer = CommandWriter(store, ROOT)
    reader = ChannelReader(store, ROOT, nodes=["n1", "n2"], flush_interval_s=0.05)
    got: dict[str, list[Command]] = {"n1": [], "n2": []}
    pubs = []
    for n in ("n1", "n2"):
        p = NodePublisher(store, ROOT, n, flush_interval_s=0.05)
        p.on_command(got[n].append)
        pubs.append(p.start())
    try:
        everyone = writer.send("preemption_notice", deadline_s=30)
        only_n2 = writer.send("profile_window", nodes=["n2"], start_step=10, end_step=12)

        def acked() -> bool:
            reader.poll()
            return reader.acked_by(everyone) == {"n1", "n2"} and reader.acked_by(only_n2) == {"n2"}

        _wait(acked)
    finally:
        for p in pubs:
            p.close()
    assert [c.kind for c in got["n1"]] == ["preemption_notice"]
    assert [(c.kind, c.args) for c in got["n2"]] == [("preemption_notice", {"deadline_s": 30}),
                                                    ("profile_window", {"start_step": 10, "end_step": 12})]


def test_a_command_is_checked_before_it_is_written_and_two_writers_never_share_a_seq(store):
    a = CommandWriter(store, ROOT)
    with pytest.raises(ValueError, match="unknown command kind 'reboot'"):
        a.send("reboot")
    with pytest.raises(ValueError, match=r"'resize_notice' needs the argument\(s\) \['num_nodes'\]"):
        a.send("resize_notice")
    with pytest.raises(ValueError, match="ttl_s must be a positive"):
        a.renew_lease(0)
    b = CommandWriter(store, ROOT)  # a second control plane, started before a wrote anything
    assert [a.send("stop"), b.send("dump_stacks"), a.send("dump_stacks")] == [0, 1, 2]
    kinds = [json.loads(store.get_bytes(k))["kind"] for k in store.list(ChannelLayout(ROOT).down_prefix)]
    assert kinds == ["stop", "dump_stacks", "dump_stacks"]
    with pytest.raises(ObjectExistsError):
        store.put_bytes(ChannelLayout(ROOT).command_key(0), b"{}", if_none_match=True)


class _CountingStore:
    """The local store, counting the requests a reader makes by kind."""

    def __init__(self, inner: LocalObjectStore) -> None:
        self.inner, self.lists, self.gets = inner, 0, 0

    def list(self, *a, **kw):
        self.lists += 1
        return self.inner.list(*a, **kw)

    def get_bytes(self, *a, **kw):
        self.gets += 1
        return self.inner.get_bytes(*a, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_node_polls_commands_with_a_get_of_the_next_seq_and_lists_only_now_and_then(store):
    from trainforge.contract.channel import CommandReader

    writer = CommandWriter(store, ROOT)
    writer.send("stop", nodes=["n2"])  # history from before the node started: read by the first poll's LIST
    counting = _CountingStore(store)
    reader = CommandReader(counting, ROOT, "n1", relist_every=6)
    assert reader.poll() == [] and (counting.lists, reader.last_seq) == (1, 0)
    counting.lists = counting.gets = 0
    for _ in range(3):
        assert reader.poll() == []
    assert (counting.lists, counting.gets) == (0, 3)  # one GET (a miss) per poll, no LIST
    a, b = writer.send("dump_stacks"), writer.send("profile_window", start_step=3, end_step=4)
    assert [(c.seq, c.kind) for c in reader.poll()] == [(a, "dump_stacks"), (b, "profile_window")]
    assert (counting.lists, counting.gets) == (0, 3 + 3)  # the two commands and the miss after them
    # A command removed by a cleanup leaves a hole the GETs cannot see past; the next listing steps over it.
    c, d = writer.send("stop"), writer.send("dump_stacks")
    store.delete(ChannelLayout(ROOT).command_key(c))
    assert reader.poll() == [] and reader.last_seq == b  # the reader's 6th poll: a GET, of the hole
    assert [x.seq for x in reader.poll()] == [d] and counting.lists == 1  # the 7th lists


def test_a_command_write_that_fails_gives_its_seq_back_so_readers_see_no_gap(store):
    class FailOnce:
        def __init__(self, inner):
            self.inner, self.failed = inner, False

        def put_bytes(self, *a, **kw):
            if not self.failed:
                self.failed = True
                raise OSError("connection reset")
            return self.inner.put_bytes(*a, **kw)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    from trainforge.contract.channel import CommandReader

    writer = CommandWriter(FailOnce(store), ROOT)
    reader = CommandReader(store, ROOT, "n1", relist_every=1_000)
    assert reader.poll() == []  # the listing poll: nothing yet
    with pytest.raises(OSError):
        writer.send("stop")
    assert writer.send("stop") == 0
    assert [c.seq for c in reader.poll()] == [0]  # found by a GET of seq 0: no hole at the failed write


def test_a_node_whose_lease_lapsed_stops_and_renewals_keep_it(store):
    writer = CommandWriter(store, ROOT)
    got: list[Command] = []
    renewed = NodePublisher(store, ROOT, "n1", flush_interval_s=0.05, lease_ttl_s=0.6)
    lapsed = NodePublisher(store, ROOT, "n2", flush_interval_s=0.05, lease_ttl_s=0.6)
    lapsed.on_command(got.append)
    renewed.start()
    lapsed.start()
    try:
        writer_for_n1 = CommandWriter(store, ROOT)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.2:
            writer_for_n1.send("lease", nodes=["n1"], ttl_s=0.6)
            time.sleep(0.15)
        assert not renewed.lease_expired()
        assert lapsed.lease_expired()
        _wait(lambda: [c.kind for c in got] == ["lease_expired"])
    finally:
        renewed.close()
        lapsed.close()
    assert writer.send("stop") > 0


# ---- ranks over the node-local socket --------------------------------------------------------------------------


def test_ranks_reach_their_publisher_over_a_unix_socket_both_ways(store, tmp_path):
    sock = f"@tf-channel-test-{os.getpid()}"
    rank = RankClient(sock, 3, lease_ttl_s=5.0)
    rank.publish({"type": "early"})  # no publisher yet: buffered, never blocks
    reader = ChannelReader(store, ROOT, nodes=["n1"], flush_interval_s=0.05)
    writer = CommandWriter(store, ROOT)
    pub = NodePublisher(store, ROOT, "n1", flush_interval_s=0.05, socket_path=sock).start()
    try:
        rank.heartbeat(step=7)  # sends the buffered record first
        rank.publish({"type": "late"})
        seq = writer.send("dump_stacks")
        records: list[dict] = []
        cmds: list[dict] = []

        def done() -> bool:
            records.extend(r for _, _, _, r in reader.records(reader.poll()))
            cmds.extend(rank.poll_commands())
            return len(records) == 2 and bool(cmds) and reader.acked_by(seq) == {"n1"}

        _wait(done)
        assert [r["type"] for r in records] == ["early", "late"]
        assert reader.heartbeats["n1"]["3"]["step"] == 7
        assert cmds[0]["kind"] == "dump_stacks"
        assert not rank.lease_expired()
        with pytest.raises(ValueError, match="at most 131072 bytes"):
            rank.publish({"pad": "x" * 200_000})
    finally:
        pub.close()
        rank.close()


def test_a_rank_whose_publisher_went_silent_sees_its_lease_lapse():
    rank = RankClient(f"@tf-channel-none-{os.getpid()}", 0, lease_ttl_s=0.2)
    for _ in range(1000):
        rank.publish({"i": 1})  # never blocks with nobody listening
    time.sleep(0.3)
    assert rank.lease_expired()
    rank.close()


def test_the_arithmetic_for_4096_ranks_on_512_nodes():
    load = estimate_channel_load(nodes=512, ranks_per_node=8)
    assert load["objects_per_s"] == 512  # one batch per node per second, whatever the ranks
    assert load["naive_objects_per_s"] == 4096 * 3  # a record object per rank per step + 2 heartbeats per second
    assert 1_000 < load["batch_bytes"] < 4_000
    assert load["detection_s"] <= 5.0
    assert load["usd_per_hour"] < load["naive_usd_per_hour"] / 5
    # the reader: a GET per batch plus a constant, not a LIST per node per poll
    assert load["reader_list_per_s"] == 4 + 1  # one page per poll (~700 keys) + one discovery LIST per second
    assert load["reader_per_s"] == 512 + 5 and load["per_node_reader_list_per_s"] == 1024
    small = estimate_channel_load(nodes=8, ranks_per_node=8)
    assert small["reader_list_per_s"] == load["reader_list_per_s"]
    assert load["usd_per_month"] == pytest.approx(730 * load["usd_per_hour"])


def test_a_store_outage_blocks_no_caller_and_loses_no_record(store):
    """The store refuses everything for a while: publish() stays instant, the reader warns instead of raising,
    and once the store is back every record arrives once, in order."""
    from trainforge.infra.storage import StorageError

    class Outage(LocalObjectStore):
        down = False

        def put_bytes(self, key, data, *, if_none_match=False):
            if self.down:
                raise StorageError("503 SlowDown")
            super().put_bytes(key, data, if_none_match=if_none_match)

        def list(self, prefix="", *, start_after=""):
            if self.down:
                raise StorageError("503 SlowDown")
            return super().list(prefix, start_after=start_after)

    flaky = Outage(store.root)
    reader = ChannelReader(flaky, ROOT, nodes=["n1"], flush_interval_s=0.0)
    pub = NodePublisher(flaky, ROOT, "n1", flush_interval_s=0.05, max_backoff_s=0.1).start()
    flaky.down = True
    slowest = 0.0
    for i in range(50):
        t = time.monotonic()
        pub.publish({"i": i})
        slowest = max(slowest, time.monotonic() - t)
        time.sleep(0.01)
    assert reader.poll() == []  # a warning, not an exception
    flaky.down = False
    pub.close()
    seen = [r["i"] for _, _, _, r in reader.records(reader.poll())]
    assert seen == list(range(50))
    assert pub.stats["put_failures"] > 0 and slowest < 0.05


def test_a_rank_client_shared_by_threads_sends_every_record_exactly_once():
    """One RankClient per process is shared by the heartbeat thread, the event writer and the loop: concurrent
    sends must neither duplicate nor lose a record (unlocked, two threads sent the same head record and both popped
    it; a resumed job died of `IndexError: pop from an empty deque`)."""
    import socket
    import threading

    path = f"@tf-channel-threads-{os.getpid()}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind("\0" + path[1:])
    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
    server.settimeout(2.0)
    rank = RankClient(path, 0)
    threads, per_thread = 6, 300
    received: list[tuple[int, int]] = []
    done = threading.Event()

    def receive() -> None:
        while not done.is_set() or len(received) < threads * per_thread:
            try:
                msg = json.loads(server.recv(1 << 17))
            except TimeoutError:
                return
            received.append((msg["rec"]["thread"], msg["rec"]["i"]))

    def send(t: int) -> None:
        for i in range(per_thread):
            rank.publish({"thread": t, "i": i})

    reader = threading.Thread(target=receive)
    reader.start()
    senders = [threading.Thread(target=send, args=(t,)) for t in range(threads)]
    for s in senders:
        s.start()
    for s in senders:
        s.join(30)
    assert rank.drain(timeout_s=10.0)
    done.set()
    reader.join(15)
    server.close()
    rank.close()
    assert sorted(received) == [(t, i) for t in range(threads) for i in range(per_thread)]
