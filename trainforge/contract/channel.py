"""The channel: every message between the control plane and a job's nodes, both ways, through the object store.

No shared disk and no process ids: a node's publisher writes batches into the job's prefix, the control plane lists
and reads them; commands go the other way as objects the publisher polls. The default store is the job's prefix in
the object store (a local folder embedded, S3 in production); only the `ObjectStore` interface is used.

Layout under the channel's root (e.g. `teams/{team}/jobs/{job}/channel`, see `channel_root`)::

    nodes/{node}.json                               a publisher's hello (discovery: host, ranks, first seq and the
                                                    stamp its batches start after), rewritten as its restart index
    up/{stamp_ms:013d}-{node}-{seq:012d}.jsonl      one batch per flush of one node (all of its ranks)
    down/{seq:012d}.json                            commands, one sequence for the job; each names its nodes

A batch is JSON lines: the envelope first (`v`, `node`, `seq`, `sent_at`, `n_records`, `heartbeats` {rank: last
beat + its age}, `acks` [command seqs handled since the last batch], `cmd_seq` (the last command handled),
`closing`), then one line per record. Records are JSON objects the channel does not interpret (the typed
`SegmentEvent`s live in `trainforge.contract.events`); only the envelope is validated, and a malformed batch is
skipped with a warning naming its key.

Batch keys sort by their stamp (the publisher's wall clock in ms when it wrote that copy, never decreasing per
node), so the reader makes ONE listing of `up/` per poll for the whole job, whatever its number of nodes, starting
after the oldest cursor it must keep: each live node's cursor is the key of the last batch read from it, and a
node's next batch sorts after its own last key (its stamps never go back), however late the PUT lands and however
skewed its clock. A listing repeats about one flush of keys already read (skipped by their (node, seq), no GET);
lost and closed nodes hold it back at most `lookback_s`. Reader requests per second are then the batches per
second (one GET each) plus a constant (about one LIST page per poll and one discovery LIST per second).

Delivery is at-least-once with de-duplication: a PUT that failed (or timed out after landing) is re-sent with the
same seq and the same bytes under a fresh stamp (so that a copy lands inside any reader's window); the reader
keeps the last seq per node and drops anything at or below it without reading it (its `checkpoint()`: seqs and
cursors, lets a restarted control plane resume without re-delivery and without listing from the beginning). A
batch is written every `flush_interval_s` even when empty: its arrival is the node's liveness, and it carries one
heartbeat per rank. A node is lost when no new batch arrived for `lost_after_s` (arrival is measured on the
reader's own clock, so no clock skew enters): with the defaults (flush 1 s, lost after 3 s, poll 0.25 s) a dead
node is reported within lost_after_s + 2 * poll_interval_s + one listing, about 3.6 s.

Commands down (stop, dump_stacks, preemption_notice, resize_notice, profile_window, lease, kill_rank) are written by the
control side's `CommandWriter` with a conditional create (two writers cannot take one seq); each node's publisher
polls them on its own thread (`CommandReader`), hands them to its handlers and to its ranks, and acknowledges each
in its next batch. The lease: a node starts with `lease_ttl_s` granted and every renewal it sees after its first
poll extends it to now + ttl (its own clock again); a node whose lease lapsed reports `lease_expired()` and its
ranks stop: a gang whose control plane is gone stops within its lease.

Ranks of the node reach their publisher without the object store through a Unix datagram socket (`socket_path`;
a leading '@' means Linux's abstract namespace: no file to clean up, and private to the node's network namespace).
Datagrams and not a spool folder: no disk I/O or fsync on the training hosts, one message is one datagram (no
framing), a full queue answers EAGAIN at once (so `RankClient` never blocks; it buffers a bounded amount), and the
publisher answers each rank on the same socket (commands, lease) because a datagram carries its sender's address.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import math
import os
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from trainforge.infra.storage.base import ObjectExistsError, ObjectNotFoundError, ObjectStore, list_after

__all__ = [
    "COMMAND_KINDS", "Batch", "ChannelLayout", "ChannelReader", "Command", "CommandReader", "CommandWriter",
    "JsonLinesProcess", "MalformedBatchError", "NodePublisher", "NodeStatus", "RankClient", "channel_root", "decode_batch",
    "encode_batch", "estimate_channel_load", "format_channel_load",
]

log = logging.getLogger(__name__)

ENVELOPE_VERSION = 1
SEQ_WIDTH = 12
STAMP_WIDTH = 13  # milliseconds since the epoch: 13 digits until the year 2286
FLUSH_INTERVAL_S = 1.0
LOST_AFTER_S = 3.0
POLL_INTERVAL_S = 0.25
LEASE_TTL_S = 30.0
LOOKBACK_S = 10.0
"""How far the reader's listing reaches back for a node it has no exact cursor for (lost, closed, or known by name
only): it bounds the clock skew tolerated for such a node, and what a lost node costs the listing."""
INDEX_INTERVAL_S = 30.0
"""A publisher rewrites its hello (`nodes/{node}.json`) with its next seq this often (and at close), so that a
restarted publisher finds its last seq by listing at most this long a stretch of `up/`."""
STOP_RETRY_S = 5.0
"""How long the flush thread still retries a batch once stopping; then close() retries it (same seq, same bytes)."""
DISCOVER_INTERVAL_S = 1.0
LIST_PAGE = 1000  # keys per S3 ListObjectsV2 page: a listing of K keys is ceil(K / 1000) requests
MAX_DATAGRAM = 128 * 1024
"""The largest record a rank hands its publisher over the socket (Linux's default socket buffer is ~208 KiB)."""

COMMAND_KINDS: dict[str, tuple[str, ...]] = {
    "stop": (),
    "dump_stacks": (),
    "preemption_notice": ("deadline_s",),
    "resize_notice": ("num_nodes",),
    "profile_window": ("start_step", "end_step"),
    "lease": ("ttl_s",),
    "kill_rank": ("rank",),
}
"""Every command kind and the arguments it requires (more are allowed, passed through)."""

_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_BATCH = re.compile(r"/up/(\d{13})-([A-Za-z0-9][A-Za-z0-9._-]{0,127})-(\d{12})\.jsonl$")
_COMMAND = re.compile(r"/(\d{12})\.json$")
COMMAND_RELIST_EVERY = 30  # a node's command polls: a GET of the next seq, and a LIST every 30th poll


def channel_root(job_prefix: str) -> str:
    """The channel of a job: `{job_prefix}/channel` (inside the job's prefix, so its scoped credential covers it)."""
    return f"{job_prefix.rstrip('/')}/channel"


def _check_node(node: str) -> str:
    if not isinstance(node, str) or not _NODE.match(node):
        raise ValueError(f"invalid node name {node!r}: letters, digits, '.', '_', '-' (at most 128, no '/')")
    return node


@dataclass(frozen=True)
class ChannelLayout:
    """Where the channel's objects live under `root` (pure string builders)."""

    root: str

    def node_key(self, node: str) -> str:
        return f"{self.root}/nodes/{_check_node(node)}.json"

    @property
    def nodes_prefix(self) -> str:
        return f"{self.root}/nodes/"

    @property
    def up_prefix(self) -> str:
        return f"{self.root}/up/"

    def batch_key(self, node: str, seq: int, stamp_ms: int) -> str:
        return f"{self.root}/up/{stamp_ms:0{STAMP_WIDTH}d}-{_check_node(node)}-{seq:0{SEQ_WIDTH}d}.jsonl"

    def stamp_key(self, stamp_ms: int) -> str:
        """A `start_after` bound: sorts before every batch key stamped `stamp_ms` or later."""
        return f"{self.root}/up/{max(0, stamp_ms):0{STAMP_WIDTH}d}"

    @staticmethod
    def parse_batch_key(key: str) -> tuple[int, str, int] | None:
        """(stamp_ms, node, seq) of a batch key, None for anything else."""
        m = _BATCH.search(key)
        return (int(m.group(1)), m.group(2), int(m.group(3))) if m else None

    @property
    def down_prefix(self) -> str:
        return f"{self.root}/down/"

    def command_key(self, seq: int) -> str:
        return f"{self.down_prefix}{seq:0{SEQ_WIDTH}d}.json"


# ---- batches (up) -------------------------------------------------------------------------------------------


class MalformedBatchError(ValueError):
    """A batch object whose envelope or lines do not parse; the reader skips it with a warning."""


@dataclass
class Batch:
    node: str
    seq: int
    sent_at: float
    records: list[dict[str, Any]]
    heartbeats: dict[str, dict[str, Any]] = field(default_factory=dict)
    acks: list[dict[str, Any]] = field(default_factory=list)
    cmd_seq: int = -1
    closing: bool = False


def encode_batch(batch: Batch) -> bytes:
    head = {"v": ENVELOPE_VERSION, "node": batch.node, "seq": batch.seq, "sent_at": batch.sent_at,
            "n_records": len(batch.records), "heartbeats": batch.heartbeats, "acks": batch.acks,
            "cmd_seq": batch.cmd_seq, "closing": batch.closing}
    lines = [json.dumps(head, separators=(",", ":"))]
    lines += [json.dumps(r, separators=(",", ":"), default=str) for r in batch.records]
    return ("\n".join(lines) + "\n").encode()


def decode_batch(data: bytes, *, key: str = "?", node: str | None = None, seq: int | None = None) -> Batch:
    """Parse and validate a batch's envelope (not its records' contents). `node`/`seq`: what its key says."""
    try:
        lines = data.decode().splitlines()
        head = json.loads(lines[0]) if lines else None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MalformedBatchError(f"{key}: the envelope is not JSON ({e})") from None
    if not isinstance(head, dict):
        raise MalformedBatchError(f"{key}: the first line is not an envelope object")
    if head.get("v") != ENVELOPE_VERSION:
        raise MalformedBatchError(f"{key}: envelope version {head.get('v')!r}, this reader knows {ENVELOPE_VERSION}")
    for name, kind in (("node", str), ("seq", int), ("sent_at", (int, float)), ("n_records", int)):
        if not isinstance(head.get(name), kind) or isinstance(head.get(name), bool):
            raise MalformedBatchError(f"{key}: envelope field {name!r} is {head.get(name)!r}")
    if node is not None and head["node"] != node or seq is not None and head["seq"] != seq:
        raise MalformedBatchError(f"{key}: envelope says node {head['node']!r} seq {head['seq']}, the key disagrees")
    body = [ln for ln in lines[1:] if ln.strip()]
    if len(body) != head["n_records"]:
        raise MalformedBatchError(f"{key}: {len(body)} record lines, the envelope announces {head['n_records']}")
    records = []
    for i, ln in enumerate(body):
        try:
            rec = json.loads(ln)
        except json.JSONDecodeError as e:
            raise MalformedBatchError(f"{key}: record {i} is not JSON ({e})") from None
        if not isinstance(rec, dict):
            raise MalformedBatchError(f"{key}: record {i} is not a JSON object")
        records.append(rec)
    hb, acks = head.get("heartbeats", {}), head.get("acks", [])
    if not isinstance(hb, dict) or not isinstance(acks, list):
        raise MalformedBatchError(f"{key}: 'heartbeats' must be an object and 'acks' a list")
    return Batch(head["node"], head["seq"], float(head["sent_at"]), records, hb, acks,
                 int(head.get("cmd_seq", -1)), bool(head.get("closing", False)))


# ---- commands (down) ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    seq: int
    kind: str
    args: dict[str, Any]
    nodes: tuple[str, ...] | None  # None: every node
    sent_at: float

    def for_node(self, node: str) -> bool:
        return self.nodes is None or node in self.nodes

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "kind": self.kind, "args": self.args,
                "nodes": list(self.nodes) if self.nodes is not None else None, "sent_at": self.sent_at}


def _check_command(kind: str, args: dict[str, Any]) -> None:
    if kind not in COMMAND_KINDS:
        raise ValueError(f"unknown command kind {kind!r}; one of {sorted(COMMAND_KINDS)}")
    missing = [a for a in COMMAND_KINDS[kind] if a not in args]
    if missing:
        raise ValueError(f"command {kind!r} needs the argument(s) {missing}")
    if kind == "lease" and not (isinstance(args["ttl_s"], int | float) and args["ttl_s"] > 0):
        raise ValueError(f"lease ttl_s must be a positive number of seconds, got {args['ttl_s']!r}")


class CommandWriter:
    """The control side's end of the commands: `send("stop")`, `send("dump_stacks", nodes=["n3"])`, `renew_lease()`.

    Seqs are taken with a conditional create, so a second control-plane instance (a restarted flow) never
    overwrites a command: it moves on to the next free seq."""

    def __init__(self, store: ObjectStore, root: str, *, wall: Callable[[], float] = time.time):
        self.store, self.layout, self._wall = store, ChannelLayout(root), wall
        self._lock = threading.Lock()
        keys = store.list(self.layout.down_prefix)
        seqs = [int(m.group(1)) for k in keys if (m := _COMMAND.search(k))]
        self._next = max(seqs, default=-1) + 1

    def send(self, kind: str, *, nodes: Iterable[str] | None = None, **args: Any) -> int:
        _check_command(kind, args)
        targets = None if nodes is None else tuple(_check_node(n) for n in nodes)
        with self._lock:
            while True:
                seq = self._next
                self._next += 1
                body = {"seq": seq, "kind": kind, "args": args, "nodes": list(targets) if targets else None,
                        "sent_at": self._wall()}
                try:
                    data = json.dumps(body).encode()
                except TypeError as e:
                    raise ValueError(f"command {kind!r}: arguments must be JSON values ({e})") from None
                try:
                    self.store.put_bytes(self.layout.command_key(seq), data, if_none_match=True)
                    return seq
                except ObjectExistsError:
                    continue  # another writer took this seq
                except BaseException:
                    # Nothing was written at this seq: give it back, or the readers (which GET the next seq)
                    # would wait at the gap until their next listing.
                    self._next = seq
                    raise

    def renew_lease(self, ttl_s: float = LEASE_TTL_S) -> int:
        return self.send("lease", ttl_s=ttl_s)


class CommandReader:
    """A node's end: the commands for `node` written since the last poll, in seq order.

    Seqs are dense (the writer takes them with a conditional create and never skips one), so a poll is a GET of
    the next seq, which is a 404 on almost every poll: on S3 a GET costs a twelfth of a LIST, and 512 nodes polling
    once a second are the channel's largest request stream. The first poll, and every `relist_every`-th after it,
    LISTs instead, which reads history on a (re)start and steps over a seq that a cleanup removed."""

    def __init__(self, store: ObjectStore, root: str, node: str, *, after_seq: int = -1,
                 relist_every: int = COMMAND_RELIST_EVERY):
        self.store, self.layout, self.node = store, ChannelLayout(root), _check_node(node)
        self.last_seq = after_seq
        self.relist_every = max(1, relist_every)
        self._polls = 0

    def poll(self) -> list[Command]:
        listing = self._polls % self.relist_every == 0
        self._polls += 1
        if listing:
            start = self.layout.command_key(self.last_seq) if self.last_seq >= 0 else ""
            keys: Iterable[str] = list_after(self.store, self.layout.down_prefix, start)
        else:
            keys = self._next_keys()
        out = []
        for key in keys:
            m = _COMMAND.search(key)
            if not m:
                continue
            seq = int(m.group(1))
            try:
                d = json.loads(self.store.get_bytes(key))
                cmd = Command(seq, str(d["kind"]), dict(d.get("args") or {}),
                              None if d.get("nodes") is None else tuple(d["nodes"]), float(d["sent_at"]))
            except ObjectNotFoundError:
                break  # listed but gone (a cleanup), or no command at the next seq yet: the next poll starts here
            except (ValueError, KeyError, TypeError) as e:
                log.warning("channel: skipping malformed command %s: %s", key, e)
                self.last_seq = seq
                continue
            self.last_seq = seq
            if cmd.for_node(self.node):
                out.append(cmd)
        return out

    def _next_keys(self) -> Iterator[str]:
        """The keys of the seqs after the last one read, one at a time: poll() GETs each and stops at the first
        that is not there."""
        while True:
            yield self.layout.command_key(self.last_seq + 1)


# ---- the node side ------------------------------------------------------------------------------------------


def _bind_address(path: str) -> str:
    return "\0" + path[1:] if path.startswith("@") else path


class NodePublisher:
    """One per node: batches every record of the node's ranks into one object per flush.

    Ranks in this process call `publish(record)` / `heartbeat(rank, **info)` (never block: a bounded queue);
    ranks in other processes of the node use a `RankClient` on `socket_path`. `on_command(fn)` registers a handler
    called on the publisher's thread for each command (and once with kind "lease_expired")."""

    def __init__(self, store: ObjectStore, root: str, node: str, *, flush_interval_s: float = FLUSH_INTERVAL_S,
                 lease_ttl_s: float = LEASE_TTL_S, socket_path: str | None = None, max_pending: int = 100_000,
                 max_backoff_s: float = 5.0, info: dict[str, Any] | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        if flush_interval_s <= 0 or lease_ttl_s <= 0:
            raise ValueError("flush_interval_s and lease_ttl_s must be positive")
        self.store, self.layout, self.node = store, ChannelLayout(root), _check_node(node)
        self.flush_interval_s, self.lease_ttl_s = flush_interval_s, lease_ttl_s
        self.socket_path, self.max_pending, self.max_backoff_s = socket_path, max_pending, max_backoff_s
        self.info = dict(info or {})
        self._clock, self._wall = clock, wall
        self._lock = threading.Lock()
        self._pending: collections.deque[dict[str, Any]] = collections.deque()
        self._beats: dict[str, tuple[float, dict[str, Any]]] = {}
        self._acks: list[dict[str, Any]] = []
        self._handlers: list[Callable[[Command], None]] = []
        self._ranks: dict[str, Any] = {}  # rank -> its socket address
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self._flusher: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._lease_deadline = clock() + lease_ttl_s
        self._lease_notified = False
        self._commands: CommandReader | None = None
        self.seq = 0
        self._stamp = 0  # the last stamp used (ms): never decreases, so this node's keys sort in seq order
        self._hello: dict[str, Any] = {}
        self._last_key = ""
        self._index_at = 0.0
        self._hello_written = False
        self._unsent: tuple[Batch, bytes] | None = None  # a batch a stop gave up on, for close() to retry
        self.stop_retry_s = STOP_RETRY_S
        # requests: every store request of this publisher (the bench counts them)
        self.stats = {"batches": 0, "records": 0, "put_failures": 0, "dropped": 0, "commands": 0, "polls": 0,
                      "requests": 0}

    # -- the rank-facing API (any thread) --

    def publish(self, record: dict[str, Any]) -> None:
        with self._lock:
            if len(self._pending) >= self.max_pending:
                self._pending.popleft()
                self.stats["dropped"] += 1
                if self.stats["dropped"] == 1:
                    log.warning("channel %s: more than %d records pending (the store is slow or down): "
                                "dropping the oldest", self.node, self.max_pending)
            self._pending.append(record)

    def heartbeat(self, rank: int | str, /, **info: Any) -> None:
        with self._lock:
            self._beats[str(rank)] = (self._clock(), info)

    def on_command(self, handler: Callable[[Command], None]) -> None:
        self._handlers.append(handler)

    def wake(self) -> None:
        """Flush now instead of at the next interval (news that must not wait: a rank of the node died)."""
        self._wake.set()

    def beats(self) -> dict[str, dict[str, Any]]:
        """The latest heartbeat info of each rank of the node (a copy)."""
        with self._lock:
            return {r: dict(info) for r, (_, info) in self._beats.items()}

    def lease_expired(self) -> bool:
        return self._clock() > self._lease_deadline

    def lease_remaining_s(self) -> float:
        return self._lease_deadline - self._clock()

    # -- lifecycle --

    def start(self) -> NodePublisher:
        # Continue after the last seq this node wrote (a restarted publisher must not reuse one: the reader
        # would drop it as a duplicate) and after the last command it handled.
        cmd_seq, first = self._resume()
        self._commands = CommandReader(self.store, self.layout.root, self.node, after_seq=cmd_seq)
        self._lease_deadline = self._clock() + self.lease_ttl_s  # the initial grant runs from the start
        self._stamp = max(self._stamp, self._wall_ms())
        # first_stamp_ms: every batch of this node (all its restarts) sorts after it, so a reader that knows the
        # node by its hello alone lists from there; kept across restarts so no earlier batch falls before it.
        self._hello = {"node": self.node, "host": socket.gethostname(), "first_seq": self.seq,
                       "first_stamp_ms": self._stamp, **first, "started_at": self._wall(),
                       "flush_interval_s": self.flush_interval_s, **self.info}
        self._write_index(cmd_seq)
        if self.socket_path:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            if not self.socket_path.startswith("@") and os.path.exists(self.socket_path):
                os.unlink(self.socket_path)
            self._sock.bind(_bind_address(self.socket_path))
            self._sock.settimeout(0.2)
            self._threads.append(threading.Thread(target=self._recv_loop, name=f"channel-recv-{self.node}",
                                                  daemon=True))
        self._flusher = threading.Thread(target=self._run, name=f"channel-{self.node}", daemon=True)
        self._threads.append(self._flusher)
        for t in self._threads:
            t.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Stop, after a last batch (marked closing, so the reader tells a clean end from a lost node)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout=timeout)
        self._drain_socket()  # what the ranks sent just before the stop is still in the socket's queue
        if self._flusher is not None and self._flusher.is_alive():
            # Its PUT hangs past the timeout: a second writer now would put another batch under the same seq.
            log.error("channel %s: the flush thread is stuck in a write after %.0f s: no closing batch",
                      self.node, timeout)
        else:
            self._flush_once(closing=True, deadline=self._clock() + timeout)
        if self._sock is not None:
            self._sock.close()
            if self.socket_path and not self.socket_path.startswith("@"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.socket_path)

    def __enter__(self) -> NodePublisher:
        return self.start()

    def _wall_ms(self) -> int:
        return int(self._wall() * 1000)

    def _resume(self) -> tuple[int, dict[str, Any]]:
        """From this node's hello (its restart index) and the stretch of `up/` written since it: the next seq,
        the last command handled, and the first seq and stamp to keep (a fresh node: none of them)."""
        self.stats["requests"] += 1
        try:
            hello = json.loads(self.store.get_bytes(self.layout.node_key(self.node)))
        except ObjectNotFoundError:
            return -1, {}
        except ValueError:
            log.warning("channel %s: its hello %s is not JSON: starting at seq 0", self.node,
                        self.layout.node_key(self.node))
            return -1, {}
        if not isinstance(hello, dict):
            return -1, {}
        first = {k: hello[k] for k in ("first_seq", "first_stamp_ms") if isinstance(hello.get(k), int)}
        next_seq, cmd_seq = int(hello.get("next_seq", 0)), int(hello.get("cmd_seq", -1))
        after = str(hello.get("last_key") or self.layout.stamp_key(int(hello.get("first_stamp_ms", 0))))
        self.stats["requests"] += 1
        last: tuple[int, int, str] | None = None  # (seq, stamp, key) of this node's newest batch since the index
        for key in list_after(self.store, self.layout.up_prefix, after):
            parsed = ChannelLayout.parse_batch_key(key)
            if parsed and parsed[1] == self.node and (last is None or parsed[2] > last[0]):
                last = (parsed[2], parsed[0], key)
        if last is not None and last[0] >= next_seq:
            next_seq = last[0] + 1
            self._stamp = max(self._stamp, last[1])
            self._last_key = last[2]
            self.stats["requests"] += 1
            with contextlib.suppress(MalformedBatchError, ObjectNotFoundError):
                cmd_seq = max(cmd_seq, decode_batch(self.store.get_bytes(last[2])).cmd_seq)
        self.seq = next_seq
        self._stamp = max(self._stamp, int(hello.get("stamp_ms", 0)))
        return cmd_seq, first

    def _write_index(self, cmd_seq: int) -> None:
        """The hello with where this node stands (next seq, last key and stamp, last command handled): written at
        start, every `INDEX_INTERVAL_S` and after the closing batch. A failure only costs a restart a longer list."""
        body = {**self._hello, "next_seq": self.seq, "last_key": self._last_key, "stamp_ms": self._stamp,
                "cmd_seq": cmd_seq}
        self.stats["requests"] += 1
        self._index_at = self._clock()
        try:
            self.store.put_bytes(self.layout.node_key(self.node), json.dumps(body).encode())
        except Exception as e:
            if not self._hello_written:
                raise  # the first hello: a store that refuses it refuses everything, say so at start
            log.warning("channel %s: rewriting its hello failed: %s: %s", self.node, type(e).__name__, e)
        self._hello_written = True

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the publisher's threads --

    def _run(self) -> None:
        assert self._commands is not None
        first_poll = True
        next_flush = self._clock()
        while not self._stop.is_set():
            self._poll_commands(first_poll)
            first_poll = False
            self._check_lease()
            self._flush_once(closing=False, deadline=None)
            next_flush = max(next_flush + self.flush_interval_s, self._clock())
            if self._wake.wait(max(0.0, next_flush - self._clock())):
                self._wake.clear()
                next_flush = self._clock()

    def _poll_commands(self, first_poll: bool) -> None:
        assert self._commands is not None
        self.stats["polls"] += 1
        before = self._commands.last_seq
        try:
            commands = self._commands.poll()
        except Exception as e:  # the store is down: the lease runs out if it stays down
            log.warning("channel %s: polling commands failed: %s: %s", self.node, type(e).__name__, e)
            return
        finally:
            self.stats["requests"] += 1 + self._commands.last_seq - before  # one LIST, one GET per command
        for cmd in commands:
            self.stats["commands"] += 1
            if cmd.kind == "lease":
                # Renewals already there at the first poll are history: the initial grant covers them.
                if not first_poll:
                    self._lease_deadline = self._clock() + float(cmd.args["ttl_s"])
                    self._lease_notified = False
                continue
            self._deliver(cmd)
            with self._lock:
                self._acks.append({"seq": cmd.seq, "kind": cmd.kind, "at": self._wall()})

    def _check_lease(self) -> None:
        for addr in list(self._ranks.values()):
            self._send_rank(addr, {"t": "lease", "remaining_s": self.lease_remaining_s()})
        if self.lease_expired() and not self._lease_notified:
            self._lease_notified = True
            log.warning("channel %s: the lease lapsed (no renewal for %.1f s): the node must stop",
                        self.node, self.lease_ttl_s)
            self._deliver(Command(-1, "lease_expired", {}, (self.node,), self._wall()))

    def _deliver(self, cmd: Command) -> None:
        for handler in self._handlers:
            try:
                handler(cmd)
            except Exception:
                log.exception("channel %s: command handler failed on %s", self.node, cmd.kind)
        for addr in list(self._ranks.values()):
            self._send_rank(addr, {"t": "cmd", "cmd": cmd.to_dict()})

    def deliver_to(self, rank: int | str, cmd: Command) -> bool:
        """One command to one rank of the node, outside the delivery of commands as they arrive: for a rank that
        registered after a command every rank must see (the sidecar replays a profile window to a rank that
        started, or restarted, later). False when the rank has not reached the publisher yet."""
        addr = self._ranks.get(str(rank))
        if addr is None:
            return False
        self._send_rank(addr, {"t": "cmd", "cmd": cmd.to_dict()})
        return True

    def _send_rank(self, addr: Any, msg: dict[str, Any]) -> None:
        if self._sock is None:
            return
        try:
            self._sock.sendto(json.dumps(msg).encode(), socket.MSG_DONTWAIT, addr)
        except OSError:
            # A rank that is gone (or not reading): forget it; it registers again with its next message.
            self._ranks = {r: a for r, a in self._ranks.items() if a != addr}

    def _take_batch(self, closing: bool) -> Batch:
        now = self._clock()
        with self._lock:
            records = list(self._pending)
            self._pending.clear()
            acks, self._acks = self._acks, []
            beats = {r: {**info, "age_s": round(now - t, 3)} for r, (t, info) in self._beats.items()}
        cmd_seq = self._commands.last_seq if self._commands else -1
        return Batch(self.node, self.seq, self._wall(), records, beats, acks, cmd_seq, closing)

    def _flush_once(self, *, closing: bool, deadline: float | None) -> None:
        """Write the batch a stop left unsent (if any), then one batch of what is pending."""
        if self._unsent is not None:
            if not self._land(*self._unsent, deadline=deadline):
                return
            self._unsent = None
        batch = self._take_batch(closing)
        data = encode_batch(batch)
        if not self._land(batch, data, deadline=deadline):
            # Kept, same seq and bytes, for the next flush (close()'s last one): a copy may have landed, so a
            # new batch under this seq would be dropped by the reader as a re-sent copy, its records lost.
            self._unsent = (batch, data)

    def _land(self, batch: Batch, data: bytes, *, deadline: float | None) -> bool:
        """PUT one batch, retrying the same bytes (same seq) with backoff until it lands (True) or, once
        stopping, `deadline` passes (False)."""
        delay = 0.1
        while True:
            # Each try under a fresh stamp (same seq, same bytes): a copy that lands late still sorts inside the
            # window of a reader that gave this node up as lost; the reader reads one copy per seq.
            self._stamp = max(self._stamp, self._wall_ms())
            key = self.layout.batch_key(self.node, batch.seq, self._stamp)
            self.stats["requests"] += 1
            try:
                self.store.put_bytes(key, data)
                break
            except Exception as e:
                self.stats["put_failures"] += 1
                log.warning("channel %s: writing %s failed (%s: %s); retrying in %.1f s", self.node, key,
                            type(e).__name__, e, delay)
                if deadline is not None and self._clock() + delay > deadline:
                    log.error("channel %s: giving up on %s at close (%d records not delivered)", self.node, key,
                              len(batch.records))
                    return False
                if deadline is None:
                    if self._stop.wait(delay):
                        # stopping: a few more tries, then close() takes the batch over
                        deadline = self._clock() + self.stop_retry_s
                else:
                    time.sleep(delay)  # stopping still backs off: a store in trouble is not hammered
                delay = min(self.max_backoff_s, delay * 2) * (0.5 + random.random() / 2)
        self.seq += 1
        self._last_key = key
        self.stats["batches"] += 1
        self.stats["records"] += len(batch.records)
        if batch.closing or self._clock() - self._index_at >= INDEX_INTERVAL_S:
            self._write_index(batch.cmd_seq)
        return True

    def _drain_socket(self) -> None:
        if self._sock is None:
            return
        self._sock.setblocking(False)
        while True:
            try:
                data, addr = self._sock.recvfrom(MAX_DATAGRAM + 1024)
            except OSError:
                return
            self._take(data, addr)

    def _recv_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                data, addr = self._sock.recvfrom(MAX_DATAGRAM + 1024)
            except TimeoutError:
                continue
            except OSError:
                return
            self._take(data, addr)

    def _take(self, data: bytes, addr: Any) -> None:
        try:
            msg = json.loads(data)
            rank = str(msg["rank"])
        except (ValueError, KeyError, TypeError):
            log.warning("channel %s: dropping a malformed datagram from a rank", self.node)
            return
        if addr:
            self._ranks[rank] = addr
        if msg.get("t") == "rec" and isinstance(msg.get("rec"), dict):
            self.publish(msg["rec"])
        elif msg.get("t") == "hb" and isinstance(msg.get("info") or {}, dict):
            self.heartbeat(rank, **(msg.get("info") or {}))


class RankClient:
    """A rank's end of its node's publisher socket: publish records and heartbeats, receive commands and the lease.

    Never blocks: a send the socket cannot take now (publisher busy or not up yet) waits in a bounded buffer and
    goes with the next call. `lease_expired()` is also true when the publisher has been silent for the lease's
    length: a rank that nobody supervises stops.

    Thread-safe: one client per process is shared by the heartbeat thread, the event writer's thread and the
    training loop, so the buffer and the socket are used under one lock (without it two threads sent the same
    head record and both popped it: a duplicate, a lost record, or IndexError on an emptied buffer)."""

    def __init__(self, socket_path: str, rank: int, *, lease_ttl_s: float = LEASE_TTL_S, max_buffer: int = 10_000,
                 clock: Callable[[], float] = time.monotonic):
        self.address, self.rank, self._clock = _bind_address(socket_path), rank, clock
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind("")  # Linux autobind: a unique abstract address the publisher can answer
        self._sock.setblocking(False)
        self._buffer: collections.deque[bytes] = collections.deque(maxlen=max_buffer)
        self._commands: list[dict[str, Any]] = []
        self._lease_deadline = clock() + lease_ttl_s
        # Reentrant: the SIGTERM handler (trainer/health.py) sends a heartbeat on the main thread, which may be
        # inside a send already.
        self._lock = threading.RLock()
        self.dropped = 0

    def publish(self, record: dict[str, Any]) -> None:
        data = json.dumps({"t": "rec", "rank": self.rank, "rec": record}, default=str).encode()
        if len(data) > MAX_DATAGRAM:
            raise ValueError(f"a channel record is at most {MAX_DATAGRAM} bytes, this one is {len(data)}: put "
                             "large payloads (profiles, long tracebacks) in the object store and send the key")
        self._send(data)

    def heartbeat(self, **info: Any) -> None:
        self._send(json.dumps({"t": "hb", "rank": self.rank, "info": info}, default=str).encode())

    def _send(self, data: bytes | None) -> None:
        with self._lock:
            if data is not None:
                if len(self._buffer) == self._buffer.maxlen:
                    self.dropped += 1
                self._buffer.append(data)
            while self._buffer:
                try:
                    head = self._buffer.popleft()
                except IndexError:  # emptied by a signal handler's send on this thread (the lock is reentrant)
                    return
                try:
                    self._sock.sendto(head, self.address)
                except (BlockingIOError, ConnectionRefusedError, FileNotFoundError):
                    self._buffer.appendleft(head)  # keep it for the next call
                    return

    def flush(self) -> None:
        self._send(None)

    def drain(self, timeout_s: float = 2.0) -> bool:
        """Send what is buffered, waiting up to `timeout_s` for the publisher to take it (a rank about to exit
        calls this: its last records must not die in its buffer). True when nothing is left."""
        deadline = self._clock() + timeout_s
        self._send(None)
        while self._buffer and self._clock() < deadline:
            time.sleep(0.02)
            self._send(None)
        return not self._buffer

    def _drain(self) -> None:
        with self._lock:
            while True:
                try:
                    data = self._sock.recv(MAX_DATAGRAM + 1024)
                except (BlockingIOError, InterruptedError):
                    return
                msg = json.loads(data)
                if msg.get("t") == "cmd":
                    self._commands.append(msg["cmd"])
                elif msg.get("t") == "lease":
                    self._lease_deadline = self._clock() + float(msg["remaining_s"])

    def poll_commands(self) -> list[dict[str, Any]]:
        self._drain()
        with self._lock:
            out, self._commands = self._commands, []
        return out

    def lease_expired(self) -> bool:
        self._drain()
        return self._clock() > self._lease_deadline

    def close(self) -> None:
        self._sock.close()


# ---- the control side ---------------------------------------------------------------------------------------


@dataclass
class NodeStatus:
    node: str
    state: str  # "waiting" (known, nothing yet) | "live" | "lost" | "closed"
    last_seq: int
    age_s: float  # since the last new batch arrived (reader's clock), or since the node became known
    last_sent_at: float | None


class ChannelReader:
    """Reads a job's channel: new batches since the last seen seq per node, de-duplicated, in per-node order.

    One listing of `up/` per poll for the whole job (see the module's docstring), starting after the oldest
    cursor it must keep, then one GET per new batch. `poll()` returns the new batches (each node's in seq order);
    `status()` / `lost_nodes()` say which nodes are live; `heartbeats` holds each node's latest beat per rank;
    `acks` maps a command seq to {node: ack time}. `nodes` are the nodes the control plane launched (a node that
    never publishes is lost too); others are discovered from `nodes/` (every `discover_interval_s`) and from the
    keys of `up/`. `requests` counts every store request (a listing of K keys counts ceil(K / 1000) pages)."""

    def __init__(self, store: ObjectStore, root: str, *, nodes: Iterable[str] = (), lost_after_s: float = LOST_AFTER_S,
                 flush_interval_s: float = FLUSH_INTERVAL_S, last_seen: dict[str, Any] | None = None,
                 max_concurrency: int = 16, max_batches_per_node: int = 16, lookback_s: float = LOOKBACK_S,
                 discover_interval_s: float = DISCOVER_INTERVAL_S, clock: Callable[[], float] = time.monotonic):
        self.store, self.layout, self.lost_after_s, self._clock = store, ChannelLayout(root), lost_after_s, clock
        # No listing at all while every node delivered less than three quarters of a flush ago (none is due):
        # a small job lists about twice per flush instead of on every poll; late nodes keep it listing each poll.
        self._quiet_s = 0.75 * flush_interval_s
        # A reader that fell behind reads at most this many batches of a node per poll, so that one poll stays
        # short and every node is visited (a backlog proves its node alive; the rest comes with the next polls).
        self.max_batches_per_node = max_batches_per_node
        self.lookback_ms = int(lookback_s * 1000)
        self.discover_interval_s = discover_interval_s
        now = clock()
        self._last_seq: dict[str, int] = {}
        self._cursor: dict[str, str] = {}  # node -> key of the last batch read (its next one sorts after it)
        self._floor: dict[str, str] = {}  # node -> from its hello: every batch of it sorts after this
        self._arrived: dict[str, float] = {}
        self._sent_at: dict[str, float] = {}
        self._closed: set[str] = set()
        self._newest_ms: int | None = None  # the newest stamp listed: "now" on the publishers' clocks
        self._next_discover = now
        for n in nodes:
            self._know(n, now)
        for n, v in (last_seen or {}).items():
            self._know(n, now)
            if isinstance(v, dict):  # checkpoint(): {"seq": s, "key": k}
                self._last_seq[n] = int(v["seq"])
                if v.get("key"):
                    self._cursor[n] = str(v["key"])
                    self._saw(str(v["key"]))
            else:  # a bare seq: no cursor, this node is found by the lookback (or a full listing)
                self._last_seq[n] = int(v)
        self.heartbeats: dict[str, dict[str, dict[str, Any]]] = {}
        self.acks: dict[int, dict[str, float]] = {}
        self.skipped: list[str] = []
        self.requests = 0
        self.listed_keys = 0  # keys returned by the listings (the reader's parsing work)
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="channel-read")

    def _know(self, node: str, now: float) -> None:
        if node not in self._last_seq:
            self._last_seq[_check_node(node)] = -1
            self._arrived[node] = now

    def _saw(self, key: str) -> None:
        parsed = ChannelLayout.parse_batch_key(key)
        if parsed and (self._newest_ms is None or parsed[0] > self._newest_ms):
            self._newest_ms = parsed[0]

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def checkpoint(self) -> dict[str, dict[str, Any]]:
        """Per node the last seq read and its key (JSON values): hand it back as `last_seen` to resume without
        re-delivery, listing from the oldest cursor rather than from the beginning."""
        return {n: {"seq": s, "key": self._cursor.get(n)} for n, s in self._last_seq.items()}

    def _discover(self) -> None:
        self.requests += 1
        now = self._clock()
        try:
            keys = self.store.list(self.layout.nodes_prefix)
        except Exception as e:
            log.warning("channel: listing %s failed: %s: %s", self.layout.nodes_prefix, type(e).__name__, e)
            return
        self.requests += max(0, math.ceil(len(keys) / LIST_PAGE) - 1)
        fresh = []
        for key in keys:
            name = key[len(self.layout.nodes_prefix):].removesuffix(".json")
            if _NODE.match(name):
                self._know(name, now)
                if name not in self._cursor and name not in self._floor:
                    fresh.append(name)
        # Each hello is read once: its first stamp gives a node known by name an exact place in the listing.
        for name, floor in zip(fresh, self._pool.map(self._read_hello, fresh), strict=True):
            self.requests += 1
            if floor is not None:
                self._floor[name] = floor

    def _read_hello(self, node: str) -> str | None:
        try:
            hello = json.loads(self.store.get_bytes(self.layout.node_key(node)))
            return self.layout.stamp_key(int(hello["first_stamp_ms"]))
        except Exception:  # absent, older or malformed: the node is found by the lookback instead
            return None

    def _start_after(self, now: float) -> str:
        """The oldest key this poll must list after. A live node (or one waiting with a known hello) holds the
        window at its exact cursor; a lost or closed one, or one known by name only, at most `lookback_s` behind
        the newest stamp seen (none seen yet: from the beginning)."""
        bound = "" if self._newest_ms is None else self.layout.stamp_key(self._newest_ms - self.lookback_ms)
        starts = []
        for node in self._last_seq:
            exact = self._cursor.get(node) or self._floor.get(node)
            if exact is None:
                starts.append(bound)
            elif self._state(node, now) in ("live", "waiting"):
                starts.append(exact)
            else:
                starts.append(max(exact, bound))
        return min(starts, default="")

    def _get(self, key: str) -> bytes | None | Exception:
        try:
            return self.store.get_bytes(key)
        except ObjectNotFoundError:
            return None
        except Exception as e:  # the store is slow or down: this node stops here, the next poll goes on
            return e

    def poll(self, *, discover: bool = True) -> list[Batch]:
        start = self._clock()
        if discover and start >= self._next_discover:
            self._next_discover = start + self.discover_interval_s
            self._discover()
        due = not self._last_seq or any(n not in self._cursor or start - self._arrived[n] >= self._quiet_s
                                        for n in self._last_seq)
        if not due:
            return []
        after = self._start_after(start)
        self.requests += 1
        try:
            keys = list_after(self.store, self.layout.up_prefix, after)
        except Exception as e:
            log.warning("channel: listing %s failed: %s: %s", self.layout.up_prefix, type(e).__name__, e)
            return []
        self.requests += max(0, math.ceil(len(keys) / LIST_PAGE) - 1)
        self.listed_keys += len(keys)
        new: dict[str, list[tuple[int, str]]] = {}
        for key in keys:
            parsed = ChannelLayout.parse_batch_key(key)
            if parsed is None:
                continue
            stamp, node, seq = parsed
            if self._newest_ms is None or stamp > self._newest_ms:
                self._newest_ms = stamp
            self._know(node, start)
            if seq > self._last_seq[node]:  # at or below: read already (a re-sent copy), no GET
                new.setdefault(node, []).append((seq, key))
        todo: list[tuple[str, int, str]] = []
        for node in sorted(new):
            seen: set[int] = set()
            for seq, key in sorted(new[node]):
                if seq in seen:
                    continue  # two copies of one batch in one listing: read the first
                seen.add(seq)
                if len(seen) > self.max_batches_per_node:
                    break
                todo.append((node, seq, key))
        found = list(self._pool.map(self._get, [key for _, _, key in todo]))
        self.requests += len(todo)
        now = self._clock()
        batches: list[Batch] = []
        failed: set[str] = set()
        for (node, seq, key), data in zip(todo, found, strict=True):
            if node in failed:
                continue
            if isinstance(data, Exception):
                log.warning("channel: reading %s failed: %s: %s", key, type(data).__name__, data)
                failed.add(node)  # its later batches wait for the next poll: per-node order is kept
                continue
            self._last_seq[node] = seq
            self._cursor[node] = key
            self._arrived[node] = now
            if data is None:
                continue  # listed but gone (a cleanup)
            try:
                batch = decode_batch(data, key=key, node=node, seq=seq)
            except MalformedBatchError as e:
                log.warning("channel: skipping malformed batch %s", e)
                self.skipped.append(key)
                continue
            self._sent_at[node] = batch.sent_at
            self.heartbeats[node] = batch.heartbeats
            for ack in batch.acks:
                if isinstance(ack, dict) and isinstance(ack.get("seq"), int):
                    self.acks.setdefault(ack["seq"], {})[node] = float(ack.get("at", batch.sent_at))
            if batch.closing:
                self._closed.add(node)
            else:
                self._closed.discard(node)
            batches.append(batch)
        return batches

    def records(self, batches: Iterable[Batch]) -> Iterator[tuple[str, int, int, dict[str, Any]]]:
        """(node, seq, index, record) for each record: (node, seq, index) identifies it for de-duplication."""
        for b in batches:
            for i, r in enumerate(b.records):
                yield b.node, b.seq, i, r

    def _state(self, node: str, now: float) -> str:
        if node in self._closed:
            return "closed"
        if now - self._arrived[node] > self.lost_after_s:
            return "lost"
        return "live" if self._last_seq[node] >= 0 else "waiting"

    def status(self) -> dict[str, NodeStatus]:
        now = self._clock()
        return {node: NodeStatus(node, self._state(node, now), seq, now - self._arrived[node],
                                 self._sent_at.get(node))
                for node, seq in self._last_seq.items()}

    def lost_nodes(self) -> list[str]:
        return sorted(n for n, s in self.status().items() if s.state == "lost")

    def acked_by(self, command_seq: int) -> set[str]:
        return set(self.acks.get(command_seq, {}))


# ---- the arithmetic (docs/contract.md quotes it) -----------------------------------------------------------

S3_PRICES_USD_PER_1000 = {"PUT": 0.005, "LIST": 0.005, "GET": 0.0004}
"""S3 Standard request prices in us-east-1 as published on aws.amazon.com/s3/pricing: PUT/COPY/POST/LIST $0.005 and
GET/SELECT $0.0004 per 1,000 requests (unchanged on that page from at least 2018 through 2024; not re-checked from
this offline build: check the page before quoting a bill)."""


def estimate_channel_load(*, nodes: int, ranks_per_node: int, records_per_rank_per_s: float = 1.0,
                          record_bytes: int = 200, flush_interval_s: float = FLUSH_INTERVAL_S,
                          poll_interval_s: float = POLL_INTERVAL_S, lost_after_s: float = LOST_AFTER_S,
                          lease_renew_s: float = LEASE_TTL_S / 3, listing_s: float = 0.1,
                          discover_interval_s: float = DISCOVER_INTERVAL_S,
                          index_interval_s: float = INDEX_INTERVAL_S,
                          command_relist_every: int = COMMAND_RELIST_EVERY) -> dict[str, float]:
    """Requests, bytes and S3 cost of one job's channel at the defaults, and the same job's traffic in the scheme
    the channel replaces (one object per rank per step plus a heartbeat object per rank every 0.5 s).
    The batch size is measured by encoding a representative batch, not assumed."""
    per_flush = max(1, round(records_per_rank_per_s * flush_interval_s))
    pad = "x" * max(0, record_bytes - 60)
    sample = Batch("node-0511", 123456, 1.8e9,
                   [{"type": "rank_metrics", "rank": r, "step": 100000 + i, "loss": 2.123456, "pad": pad}
                    for r in range(ranks_per_node) for i in range(per_flush)],
                   {str(r): {"step": 100000, "phase": "step", "age_s": 0.25} for r in range(ranks_per_node)},
                   [], 41, False)
    batch_bytes = len(encode_batch(sample))
    batches = nodes / flush_interval_s
    puts = batches + nodes / index_interval_s + 1 / lease_renew_s
    # The reader lists once per poll from the oldest live cursor: about one flush of every node's keys plus what
    # arrived during a poll and a listing, in pages of 1,000; and the nodes/ folder once per discovery interval.
    window_keys = nodes * (flush_interval_s + poll_interval_s + listing_s) / flush_interval_s
    reader_lists = math.ceil(window_keys / LIST_PAGE) / poll_interval_s + math.ceil(nodes / LIST_PAGE) / discover_interval_s
    # Each publisher polls the commands once per flush: a GET of the next seq (a miss, mostly), a LIST every
    # `command_relist_every`-th poll; and every node reads each lease renewal.
    publisher_lists = nodes / flush_interval_s / command_relist_every
    command_gets = nodes / flush_interval_s * (1 - 1 / command_relist_every) + nodes / lease_renew_s
    gets = batches + command_gets  # and a GET per batch
    cost = 3600 * (puts * S3_PRICES_USD_PER_1000["PUT"] + (reader_lists + publisher_lists) * S3_PRICES_USD_PER_1000["LIST"]
                   + gets * S3_PRICES_USD_PER_1000["GET"]) / 1000
    # the read path this one replaced: one LIST per node at most twice per flush
    per_node_lists = nodes * (1 + math.ceil(0.25 * flush_interval_s / poll_interval_s)) / flush_interval_s
    ranks = nodes * ranks_per_node
    naive_puts = ranks * records_per_rank_per_s + ranks / 0.5
    naive_cost = 3600 * naive_puts * (S3_PRICES_USD_PER_1000["PUT"] + S3_PRICES_USD_PER_1000["GET"]) / 1000
    return {"nodes": nodes, "ranks": ranks, "batch_bytes": batch_bytes, "objects_per_s": batches,
            "bytes_per_s": batch_bytes * batches, "put_per_s": puts, "list_per_s": reader_lists + publisher_lists,
            "reader_list_per_s": reader_lists, "publisher_list_per_s": publisher_lists, "get_per_s": gets,
            "command_get_per_s": command_gets,
            "reader_per_s": reader_lists + batches, "per_node_reader_list_per_s": per_node_lists,
            "usd_per_hour": cost, "usd_per_month": cost * 730,
            "detection_s": lost_after_s + 2 * poll_interval_s + listing_s,
            "naive_objects_per_s": naive_puts, "naive_usd_per_hour": naive_cost}


def format_channel_load(load: dict[str, float]) -> str:
    return "\n".join([
        f"{load['ranks']:,.0f} ranks on {load['nodes']:,.0f} nodes, one batch per node per flush",
        f"batch: {load['batch_bytes']:,.0f} bytes; objects/s: {load['objects_per_s']:,.0f}; "
        f"bytes/s: {load['bytes_per_s']:,.0f}",
        f"requests/s: PUT {load['put_per_s']:,.1f}, LIST {load['list_per_s']:,.1f} (reader "
        f"{load['reader_list_per_s']:,.1f}, command polls {load['publisher_list_per_s']:,.1f}), "
        f"GET {load['get_per_s']:,.1f} (command polls and lease reads {load['command_get_per_s']:,.0f})",
        f"the reader: {load['reader_per_s']:,.0f} requests/s (one LIST per node per poll before: "
        f"{load['per_node_reader_list_per_s']:,.0f} LISTs/s)",
        f"S3 cost: ${load['usd_per_hour']:,.2f} per hour, ${load['usd_per_month']:,.0f} per month (730 h)",
        f"lost-node detection: at most {load['detection_s']:.1f} s",
        f"per-rank objects instead: {load['naive_objects_per_s']:,.0f} objects/s, "
        f"${load['naive_usd_per_hour']:,.2f} per hour (PUT + one GET each, before any LIST)",
    ])


# ---- command line: real publisher processes for the tests and the bench -------------------------------------


class JsonLinesProcess:
    """A child process that reports on stdout as JSON lines (`{"event": ...}`): the publisher processes of the
    integration test and of the bench. Both streams are read on threads, so every wait is bounded and a chatty
    stderr never blocks the child; `expect()` names the process, its exit code and its last stderr lines when the
    line does not come."""

    def __init__(self, argv: list[str], *, name: str, **popen: Any):
        self.name = name
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self._stderr: collections.deque[str] = collections.deque(maxlen=40)
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    self.lines.put(json.loads(line))

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line)

    def stderr_tail(self) -> str:
        return "".join(self._stderr)

    def expect(self, event: str, timeout: float) -> dict[str, Any]:
        """The next line whose "event" is `event` (earlier other lines are dropped); TimeoutError past `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{self.name}: no {event!r} line within {timeout:g} s (exit code "
                                   f"{self.proc.poll()}); its stderr ends with:\n{self.stderr_tail()[-2000:]}") from None
            if msg.get("event") == event:
                return msg

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def _publish_main(args: argparse.Namespace) -> int:
    from trainforge.infra.storage import open_store

    store = open_store(args.store)
    stop = threading.Event()
    names = [args.node] if args.count == 1 else [f"{args.node}{i}" for i in range(args.count)]
    out_lock = threading.Lock()

    def say(**msg: Any) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(msg) + "\n")
            sys.stdout.flush()

    pubs = []
    for name in names:
        pub = NodePublisher(store, args.root, name, flush_interval_s=args.flush_interval, lease_ttl_s=args.lease_ttl,
                            socket_path=args.socket if args.count == 1 else None)

        def handle(cmd: Command, name: str = name) -> None:
            say(event="command", node=name, seq=cmd.seq, kind=cmd.kind, args=cmd.args)
            if cmd.kind in ("stop", "lease_expired"):
                stop.set()

        pub.on_command(handle)
        pubs.append(pub.start())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    say(event="ready", nodes=names, pid=os.getpid())
    i = 0
    period = 1.0 / args.rate if args.rate > 0 else None
    pad = "x" * args.record_bytes
    next_t = time.monotonic()
    while not stop.is_set():
        now = time.monotonic()
        for pub in pubs:
            for r in range(args.ranks):
                pub.heartbeat(r, step=i)
            if period is not None:
                pub.publish({"type": "bench", "t_pub": time.time(), "i": i, "pad": pad})
        i += 1
        next_t = max(next_t + (period or 0.5), now)
        stop.wait(max(0.0, next_t - time.monotonic()))
    for pub in pubs:
        pub.close(timeout=5.0)
    say(event="closed", nodes=names)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainforge.contract.channel",
                                     description="Run node publishers on a channel (tests, bench, drills).")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("publish", help="publish heartbeats (and records at --rate) until stopped")
    p.add_argument("--store", required=True, help="object store URL: a folder, file:///path or s3://bucket/prefix")
    p.add_argument("--root", required=True, help="the channel's root key, e.g. teams/t/jobs/j/channel")
    p.add_argument("--node", required=True, help="node name (with --count N: a prefix, nodes PREFIX0..PREFIXN-1)")
    p.add_argument("--count", type=int, default=1, help="publishers in this process (threads), default 1")
    p.add_argument("--ranks", type=int, default=1, help="ranks beating per node")
    p.add_argument("--rate", type=float, default=0.0, help="records per second per node (each stamped t_pub)")
    p.add_argument("--record-bytes", type=int, default=0, help="padding per record")
    p.add_argument("--flush-interval", type=float, default=FLUSH_INTERVAL_S)
    p.add_argument("--lease-ttl", type=float, default=LEASE_TTL_S)
    p.add_argument("--socket", default=None, help="Unix socket for the node's ranks ('@name': abstract)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return _publish_main(args)


if __name__ == "__main__":
    sys.exit(main())
