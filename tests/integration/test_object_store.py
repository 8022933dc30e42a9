"""One ObjectStore contract, run against both real implementations: the local folder and S3 (a real SeaweedFS
server on loopback, started once per session by tests/fixtures/s3.py).

Run: .venv/bin/python -m pytest tests/integration/test_object_store.py -q
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from trainforge.infra.storage import (
    LocalObjectStore,
    ObjectChangedError,
    ObjectExistsError,
    ObjectNotFoundError,
    PermissionDeniedError,
    StorageError,
    open_store,
)
from trainforge.infra.storage.iam import JobGrant, render_job_iam_policy
from trainforge.infra.storage.layout import (
    checkpoint_prefix,
    job_key,
    job_prefix,
    parse_checkpoint_step,
)

pytestmark = pytest.mark.timeout(180)

MiB = 1024 * 1024
PART = 5 * MiB  # S3's minimum part size


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.slow)])
def store(request, tmp_path):
    if request.param == "local":
        yield LocalObjectStore(tmp_path / "objects")
        return
    server = request.getfixturevalue("s3_server")
    bucket = server.make_bucket()
    try:
        # A root prefix, small parts and a low threshold, so the tests exercise multipart cheaply.
        yield server.store(bucket, "platform", multipart_threshold=6 * MiB, part_size=PART, max_concurrency=4)
    finally:
        server.delete_bucket(bucket)


def _rand(n: int) -> bytes:
    return os.urandom(n)


# ---- the contract ------------------------------------------------------------------------------------------


def test_round_trip_bytes_and_files(store, tmp_path):
    store.put_bytes("a/b/c.bin", b"hello")
    assert store.get_bytes("a/b/c.bin") == b"hello"
    assert store.exists("a/b/c.bin")
    store.put_bytes("a/b/c.bin", b"overwritten")  # plain puts overwrite
    assert store.get_bytes("a/b/c.bin") == b"overwritten"
    store.put_bytes("empty", b"")
    assert store.get_bytes("empty") == b""

    src = tmp_path / "src.bin"
    src.write_bytes(_rand(100_000))
    store.put_file("files/src.bin", src)
    dest = tmp_path / "out" / "dest.bin"
    store.get_file("files/src.bin", dest)
    assert dest.read_bytes() == src.read_bytes()
    assert [p.name for p in dest.parent.iterdir()] == ["dest.bin"]  # no temp files left behind


def test_not_found(store, tmp_path):
    with pytest.raises(ObjectNotFoundError):
        store.get_bytes("missing")
    with pytest.raises(ObjectNotFoundError):
        store.get_bytes("missing", byte_range=(0, 10))
    with pytest.raises(ObjectNotFoundError):
        store.get_bytes("missing", byte_range=(5, 5))
    with pytest.raises(ObjectNotFoundError):
        store.get_file("missing", tmp_path / "x")
    assert not (tmp_path / "x").exists()
    assert not store.exists("missing")
    store.delete("missing")  # deleting what is not there is not an error
    assert store.list("nothing/") == []


@pytest.mark.parametrize("key", ["../escape", "/abs", "a//b", "a/./b", ""])
def test_invalid_keys_rejected(store, key):
    with pytest.raises(ValueError):
        store.put_bytes(key, b"x")


def test_ranged_reads(store):
    data = _rand(1000)
    store.put_bytes("r", data)
    for start, end in [(0, 10), (10, 11), (500, 1000), (990, 1000), (995, 2000), (1000, 1010), (5, 5), (7, 3)]:
        assert store.get_bytes("r", byte_range=(start, end)) == data[start:end], (start, end)


def test_conditional_create(store):
    store.put_bytes("commit/manifest.json", b"first", if_none_match=True)
    with pytest.raises(ObjectExistsError):
        store.put_bytes("commit/manifest.json", b"second", if_none_match=True)
    assert store.get_bytes("commit/manifest.json") == b"first"


def test_conditional_overwrite_is_refused_by_the_store_once_the_etag_moved_on(store):
    store.put_bytes("job/fence.json", b"attempt 0")
    data, etag = store.get_with_etag("job/fence.json")
    assert data == b"attempt 0" and etag
    store.put_bytes("job/fence.json", b"attempt 1", if_match=etag)  # nobody wrote in between: it lands
    data, newer = store.get_with_etag("job/fence.json")
    assert data == b"attempt 1" and newer != etag
    with pytest.raises(ObjectChangedError) as refused:  # a writer still holding the old ETag
        store.put_bytes("job/fence.json", b"stale", if_match=etag)
    assert refused.value.status == 412  # the server's Precondition Failed (the local store answers the same)
    assert store.get_bytes("job/fence.json") == b"attempt 1"
    with pytest.raises(ObjectChangedError):  # a key that is gone has no ETag to match
        store.put_bytes("job/absent.json", b"x", if_match=etag)
    assert not store.exists("job/absent.json")
    with pytest.raises(ObjectNotFoundError):
        store.get_with_etag("job/absent.json")


def _race(store, key: str, writers: int, refused: type[Exception], **condition) -> None:
    """`writers` threads released at once each write `writer-i` to `key` under `condition`: exactly one wins, the
    others get `refused`, and the key holds the winner's bytes."""
    barrier = threading.Barrier(writers)

    def write(i: int) -> bool:
        barrier.wait(timeout=30)
        try:
            store.put_bytes(key, f"writer-{i}".encode(), **condition)
            return True
        except refused:
            return False

    with ThreadPoolExecutor(writers) as ex:
        won = list(ex.map(write, range(writers)))
    assert sum(won) == 1, won
    assert store.get_bytes(key) == f"writer-{won.index(True)}".encode()


def test_racing_conditional_overwrites_exactly_one_wins(store):
    store.put_bytes("cas/fence.json", b"base")
    _, etag = store.get_with_etag("cas/fence.json")
    _race(store, "cas/fence.json", 6, ObjectChangedError, if_match=etag)


def test_racing_conditional_writers_exactly_one_wins(store):
    for round_ in range(3):
        _race(store, f"race/{round_}/manifest.json", 8, ObjectExistsError, if_none_match=True)


def test_racing_conditional_uploads_of_big_files(store, tmp_path):
    files = []
    for i in range(2):
        p = tmp_path / f"big{i}"
        p.write_bytes(bytes([i]) * (PART + PART // 2 + 1))  # > the multipart threshold
        files.append(p)
    barrier = threading.Barrier(2)

    def write(i: int) -> bool:
        barrier.wait(timeout=30)
        try:
            store.put_file("race/big", files[i], if_none_match=True)
            return True
        except ObjectExistsError:
            return False

    with ThreadPoolExecutor(2) as ex:
        won = list(ex.map(write, range(2)))
    assert sum(won) == 1
    assert store.get_bytes("race/big") == files[won.index(True)].read_bytes()
    if hasattr(store, "head"):  # S3: one PutObject (a multipart ETag ends with -<parts>), whose condition holds
        assert "-" not in store.head("race/big")["etag"]


@pytest.mark.slow
def test_a_conditional_multipart_completion_refused_by_the_server_is_exists_and_aborted(s3_server, tmp_path,
                                                                                         monkeypatch):
    # Above conditional_put_limit the condition rides on CompleteMultipartUpload: the server's 412 there is
    # ObjectExistsError, the first writer's object stays, and no upload is left behind.
    bucket = s3_server.make_bucket()
    try:
        store = s3_server.store(bucket, "platform", multipart_threshold=6 * MiB, part_size=PART,
                                conditional_put_limit=6 * MiB)
        first, second = tmp_path / "first", tmp_path / "second"
        first.write_bytes(_rand(PART + PART // 2 + 1))
        second.write_bytes(_rand(PART + PART // 2 + 1))
        store.put_file("commit/big", first, if_none_match=True)
        assert store.head("commit/big")["etag"].strip('"').endswith("-2")
        monkeypatch.setattr(store, "exists", lambda key: False)  # past the early exit: the server must refuse
        with pytest.raises(ObjectExistsError):
            store.put_file("commit/big", second, if_none_match=True)
        assert store.get_bytes("commit/big") == first.read_bytes()
        assert not store._client.list_multipart_uploads(Bucket=bucket).get("Uploads")
    finally:
        s3_server.delete_bucket(bucket)


def test_multipart_file_bigger_than_part_size(store, tmp_path):
    src = tmp_path / "big.bin"
    src.write_bytes(_rand(2 * PART + PART // 3 + 123))  # 3 parts, the last one short
    store.put_file("ckpt/big.bin", src)
    dest = tmp_path / "big.out"
    store.get_file("ckpt/big.bin", dest)  # concurrent ranged GETs on S3
    assert dest.read_bytes() == src.read_bytes()
    size = src.stat().st_size
    assert store.get_bytes("ckpt/big.bin", byte_range=(PART - 5, PART + 5)) == src.read_bytes()[PART - 5:PART + 5]
    if hasattr(store, "head"):  # S3: a multipart ETag ends with -<number of parts>
        info = store.head("ckpt/big.bin")
        assert info["size"] == size and info["etag"].strip('"').endswith("-3"), info
    data = _rand(PART + PART // 2)  # put_bytes above the threshold goes multipart too
    store.put_bytes("ckpt/big2.bin", data)
    assert store.get_bytes("ckpt/big2.bin") == data


def test_pagination_over_1000_keys(store):
    n = 1050  # ListObjectsV2 returns at most 1000 keys a page
    keys = [f"many/k{i:05d}" for i in range(n)]
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda k: store.put_bytes(k, b"."), keys))
    store.put_bytes("other/x", b".")
    assert store.list("many/") == keys
    assert store.list("many/k0010") == keys[100:110]
    assert len(store.list()) == n + 1


def test_list_and_delete(store):
    for k in ["a/1", "a/2", "ab/3", "b/4"]:
        store.put_bytes(k, k.encode())
    assert store.list() == ["a/1", "a/2", "ab/3", "b/4"]
    assert store.list("a/") == ["a/1", "a/2"]
    assert store.list("a") == ["a/1", "a/2", "ab/3"]  # a prefix is a string prefix, as in S3
    store.delete("a/1")
    assert store.list("a/") == ["a/2"]
    assert not store.exists("a/1")
    with pytest.raises(ObjectNotFoundError):
        store.get_bytes("a/1")


def test_list_start_after_returns_only_later_keys(store):
    """A reader that remembers its last key lists only what is new (the channel's readers do, per node)."""
    from trainforge.infra.storage.base import list_after

    for k in ["up/n1/000000000001", "up/n1/000000000002", "up/n1/000000000003", "up/n2/000000000001"]:
        store.put_bytes(k, b".")
    assert store.list("up/n1/", start_after="up/n1/000000000001") == ["up/n1/000000000002", "up/n1/000000000003"]
    assert store.list("up/n1/", start_after="up/n1/000000000003") == []
    assert store.list("up/", start_after="up/n1/") == store.list("up/")  # a bound before every key: all of them
    assert list_after(store, "up/n1/", "up/n1/000000000002") == ["up/n1/000000000003"]


def test_scoped_handle_refuses_other_jobs(store, tmp_path):
    mine, other, sibling = job_prefix("nlp", "job-1"), job_prefix("nlp", "job-2"), job_prefix("nlp", "job-10")
    store.put_bytes(f"{other}/checkpoints/secret.bin", b"other job's data")
    store.put_bytes(f"{sibling}/x", b"sibling")
    job = store.scoped(mine)

    own_key = f"{checkpoint_prefix('nlp', 'job-1', 5)}/shard-0"
    job.put_bytes(own_key, b"mine", if_none_match=True)
    assert job.get_bytes(own_key) == b"mine"
    assert job.list() == [own_key]  # "" lists the scope only
    assert job.list(mine) == [own_key]  # never job-10's keys
    src = tmp_path / "f"
    src.write_bytes(b"file")

    other_key = f"{other}/checkpoints/secret.bin"
    refused = [
        lambda: job.put_bytes(other_key, b"overwrite"),
        lambda: job.put_bytes(f"{sibling}/y", b"x"),
        lambda: job.put_file(f"{other}/f", src),
        lambda: job.get_bytes(other_key),
        lambda: job.get_bytes(other_key, byte_range=(0, 4)),
        lambda: job.get_file(other_key, tmp_path / "stolen"),
        lambda: job.exists(other_key),
        lambda: job.delete(other_key),
        lambda: job.list(other),
        lambda: job.list("teams/nlp/"),
        lambda: job.scoped(other),  # a scoped handle cannot be widened or moved
        lambda: job.scoped("teams"),
    ]
    for attempt in refused:
        with pytest.raises(PermissionDeniedError):
            attempt()
    assert store.get_bytes(other_key) == b"other job's data"
    assert not (tmp_path / "stolen").exists()
    narrower = job.scoped(f"{mine}/checkpoints")
    assert narrower.list() == [own_key]


# ---- S3 only: what the server itself enforces ----------------------------------------------------------------


@pytest.mark.slow
def test_wrong_secret_refused_by_server(s3_server, s3_store):
    s3_store.put_bytes("k", b"v")
    bad = s3_store.with_credentials(s3_server.access_key, "not-the-secret")
    with pytest.raises(PermissionDeniedError, match="SignatureDoesNotMatch"):
        bad.put_bytes("k2", b"x")
    with pytest.raises(PermissionDeniedError, match="SignatureDoesNotMatch"):
        bad.get_bytes("k")
    unknown = s3_store.with_credentials("no-such-key", s3_server.secret_key)
    with pytest.raises(PermissionDeniedError, match="InvalidAccessKeyId"):
        unknown.list()
    assert not s3_store.exists("k2")


@pytest.mark.slow
def test_server_enforces_per_job_identity(s3_server, tmp_path):
    """Real per-job credentials: the SeaweedFS identity may act only under its job prefix. The handle here
    is deliberately NOT scoped on the client side, so every refusal below comes from the server (403)."""
    bucket = s3_server.make_bucket()
    try:
        admin = s3_server.store(bucket, "platform", multipart_threshold=6 * MiB, part_size=PART)
        mine, other, sibling = job_prefix("cv", "run-1"), job_prefix("cv", "run-2"), job_prefix("cv", "run-10")
        admin.put_bytes(f"{other}/x", b"other")
        admin.put_bytes(f"{sibling}/x", b"sibling")
        admin.put_bytes(f"{mine}/channel/segment-0/down/000000000001.json", b"{}")  # the control plane's command
        issuer = s3_server.identities()
        creds = issuer.issue(JobGrant(bucket, "cv", "run-1", "platform"), ttl_s=3600)
        job = admin.with_credentials(creds.access_key_id, creds.secret_access_key)
        assert job.prefix == ""  # no client-side scope

        a = f"{mine}/checkpoints/step-0000000001/a"
        job.put_bytes(a, b"mine", if_none_match=True)
        assert job.get_bytes(a) == b"mine"
        assert job.list(f"{mine}/checkpoints/") == [a]
        big = tmp_path / "big"
        big.write_bytes(_rand(PART + PART // 2))
        job.put_file(f"{mine}/chunks/ab/big", big)  # multipart inside a writable folder is allowed
        job.delete(f"{mine}/chunks/ab/big")
        job.put_bytes(f"{mine}/channel/segment-0/up/0000000000001-node-0-000000000001.jsonl", b"{}")
        job.put_bytes(f"{mine}/channel/segment-0/nodes/node-0.json", b"{}")
        assert job.get_bytes(f"{mine}/channel/segment-0/down/000000000001.json") == b"{}"  # commands: read only

        for attempt in [
            lambda: job.put_bytes(f"{mine}/channel/segment-0/down/000000000002.json", b"forged"),
            lambda: job.put_bytes(f"{mine}/job.json", b"x"),  # the job prefix itself is not writable
            lambda: job.put_bytes(f"{other}/x", b"overwrite"),
            lambda: job.put_bytes(f"{sibling}/y", b"x"),
            lambda: job.put_bytes("platform-wide.txt", b"x"),
            lambda: job.put_file(f"{other}/big", big),
            lambda: job.get_bytes(f"{other}/x"),
            lambda: job.delete(f"{other}/x"),
            lambda: job.list(f"{other}/"),
            lambda: job.list(),
        ]:
            with pytest.raises(PermissionDeniedError, match="refused by the server"):
                attempt()
        assert admin.get_bytes(f"{other}/x") == b"other"
        assert admin.list(f"{other}/") == [f"{other}/x"]
        # What a job's workers actually receive: the server identity plus the client-side scope.
        scoped = job.scoped(mine)
        assert a in scoped.list()
        # Revoked when the job ends: the same key is refused from then on.
        issuer.revoke(creds)
        with pytest.raises(PermissionDeniedError, match="SignatureDoesNotMatch|InvalidAccessKeyId"):
            job.get_bytes(a)
    finally:
        s3_server.delete_bucket(bucket)


@pytest.mark.slow
def test_open_store_from_environment(s3_env, s3_server):
    bucket = s3_server.make_bucket()
    try:
        store = open_store(f"s3://{bucket}/tf/root")
        assert store.url == f"s3://{bucket}/tf/root"
        store.put_bytes("x/y", b"z")
        assert store.get_bytes("x/y") == b"z"
        assert store.list() == ["x/y"]
        raw = s3_server.client().list_objects_v2(Bucket=bucket, Prefix="tf/")["Contents"]
        assert [o["Key"] for o in raw] == ["tf/root/x/y"]
    finally:
        s3_server.delete_bucket(bucket)


@pytest.mark.slow
def test_credentials_never_logged_or_pickled(s3_server, s3_store, caplog):
    caplog.set_level(logging.DEBUG)  # botocore at DEBUG logs requests and headers
    s3_store.put_bytes("k", b"v")
    s3_store.get_bytes("k")
    s3_store.list()
    bad = s3_store.with_credentials(s3_server.access_key, "wrong-secret-zzz")
    with pytest.raises(PermissionDeniedError) as err:
        bad.get_bytes("k")
    secret = s3_server.secret_key
    assert caplog.records, "expected botocore debug records"
    assert secret not in caplog.text
    assert "wrong-secret-zzz" not in caplog.text
    for text in (repr(s3_store), str(s3_store.url), str(err.value), repr(s3_server)):
        assert secret not in text and "wrong-secret-zzz" not in text
    with pytest.raises(TypeError, match="not picklable"):
        pickle.dumps(s3_store)


@pytest.mark.slow
def test_server_listens_on_loopback_only(s3_server):
    psutil = pytest.importorskip("psutil")
    conns = [c for c in psutil.Process(s3_server.proc.pid).net_connections(kind="inet")
             if c.status == psutil.CONN_LISTEN]
    assert conns
    assert {c.laddr.ip for c in conns} == {"127.0.0.1"}, conns


@pytest.mark.timeout(60)
def test_server_start_fails_fast_with_log_tail(tmp_path):
    from trainforge.infra.storage.seaweedfs import SeaweedFSError, SeaweedFSServer

    crash = tmp_path / "weed-crash"
    crash.write_text("#!/bin/sh\necho 'bind: address already in use' >&2\nexit 3\n")
    hang = tmp_path / "weed-hang"
    hang.write_text("#!/bin/sh\necho 'still booting'\nexec sleep 300\n")
    for script in (crash, hang):
        script.chmod(0o755)
    with pytest.raises(SeaweedFSError, match="(?s)exited with 3.*address already in use"):
        SeaweedFSServer(tmp_path / "a", weed=str(crash)).start(attempts=1)
    server = SeaweedFSServer(tmp_path / "b", weed=str(hang), ready_timeout=1.0)
    with pytest.raises(SeaweedFSError, match="(?s)not ready within 1s.*still booting"):
        server.start(attempts=1)
    assert server.proc is None  # the hung process was stopped


# ---- retries (a stub server that throttles, then accepts) ---------------------------------------------------


class _Throttling(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # answers botocore's Expect: 100-continue at once
    failures_left = 0
    requests = 0

    def do_PUT(self):  # noqa: N802 (http.server's naming)
        cls = type(self)
        cls.requests += 1
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if cls.failures_left > 0:
            cls.failures_left -= 1
            status, code = (503, "SlowDown") if cls.failures_left % 2 else (500, "InternalError")
            body = f"<Error><Code>{code}</Code><Message>try again</Message></Error>".encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("ETag", '"abc"')
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.timeout(60)
def test_retries_with_backoff_on_throttling_and_5xx(monkeypatch):
    from botocore.retries import standard

    from trainforge.infra.storage.s3 import S3ObjectStore

    backoffs: list[int] = []  # botocore's exponential backoff, recorded and shortened to keep the test fast
    monkeypatch.setattr(standard.ExponentialBackoff, "delay_amount",
                        lambda self, context: backoffs.append(context.attempt_number) or 0.01)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Throttling)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{httpd.server_address[1]}"
        store = S3ObjectStore("b", endpoint_url=endpoint, access_key_id="k", secret_access_key="s", max_attempts=4)
        _Throttling.failures_left, _Throttling.requests = 2, 0
        store.put_bytes("x", b"data")  # 503 SlowDown, 500, then 200
        assert _Throttling.requests == 3
        assert backoffs == [1, 2]
        _Throttling.failures_left, _Throttling.requests = 10, 0
        with pytest.raises(StorageError):
            store.put_bytes("x", b"data")
        assert _Throttling.requests == 4  # gives up after max_attempts
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_from_url_reads_environment(monkeypatch):
    from trainforge.infra.storage.s3 import S3ObjectStore

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("TRAINFORGE_S3_ENDPOINT", "http://127.0.0.1:2")  # the platform's own setting wins
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "super-secret-value")
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.setenv("TRAINFORGE_S3_PART_SIZE_MB", "8")
    monkeypatch.setenv("TRAINFORGE_S3_CONCURRENCY", "3")
    store = S3ObjectStore.from_url("s3://bkt/some/root/")
    assert (store.bucket, store.root, store.url) == ("bkt", "some/root", "s3://bkt/some/root")
    assert store.endpoint_url == "http://127.0.0.1:2" and store.region == "us-east-1"
    assert store.part_size == 8 * MiB and store.max_concurrency == 3
    assert "super-secret-value" not in repr(store) and "super-secret-value" not in str(vars(store))
    assert store.part_size_for(200 * 1024 * MiB) == 200 * 1024 * MiB // 10_000 + 1  # at most 10,000 parts
    with pytest.raises(ValueError):
        S3ObjectStore("bkt", part_size=MiB)  # below S3's 5 MiB minimum
    with pytest.raises(ValueError):
        S3ObjectStore.from_url("s3:///nobucket")


def test_upload_rate_limiter_bounds_average_rate():
    from trainforge.infra.storage.s3 import RateLimiter

    now = [0.0]
    slept: list[float] = []

    def sleep(dt: float) -> None:
        slept.append(dt)
        now[0] += dt

    limiter = RateLimiter(10 * MiB, clock=lambda: now[0], sleep=sleep)
    assert limiter.acquire(10 * MiB) == 0  # one second's burst is free
    for _ in range(5):
        limiter.acquire(4 * MiB)
    assert now[0] == pytest.approx(2.0)  # 20 MiB more at 10 MiB/s
    now[0] += 100.0  # idle: the bucket refills to one second's worth, no more
    assert limiter.acquire(10 * MiB) == 0
    assert limiter.acquire(5 * MiB) == pytest.approx(0.5)


# ---- layout and policy (pure) ----------------------------------------------------------------------------------


def test_layout_key_builders():
    assert job_prefix("nlp", "run-7") == "teams/nlp/jobs/run-7"
    assert checkpoint_prefix("nlp", "run-7", 1200) == "teams/nlp/jobs/run-7/checkpoints/step-0000001200"
    assert job_key("nlp", "run-7", "logs", "rank0.txt") == "teams/nlp/jobs/run-7/logs/rank0.txt"
    assert parse_checkpoint_step(checkpoint_prefix("a", "b", 42) + "/manifest.json") == 42
    assert parse_checkpoint_step("teams/a/jobs/b/logs/x") is None
    steps = [checkpoint_prefix("a", "b", s) for s in (9, 10, 100, 2)]
    assert sorted(steps) == [checkpoint_prefix("a", "b", s) for s in (2, 9, 10, 100)]  # lexicographic = numeric
    for bad in ["", "..", "a/b", "../x", "-x"]:
        with pytest.raises(ValueError):
            job_prefix("nlp", bad)
        with pytest.raises(ValueError):
            job_prefix(bad, "job")
    with pytest.raises(ValueError):
        checkpoint_prefix("a", "b", -1)
    with pytest.raises(ValueError):
        job_key("a", "b", "..")


def test_render_job_iam_policy():
    policy = render_job_iam_policy("ckpts", "nlp", "run-7")
    json.dumps(policy)  # serialisable as is
    objects, listing = policy["Statement"]
    assert objects["Effect"] == listing["Effect"] == "Allow"
    assert set(objects["Action"]) == {"s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"}
    assert objects["Resource"] == ["arn:aws:s3:::ckpts/teams/nlp/jobs/run-7/*"]
    assert listing["Action"] == ["s3:ListBucket"]
    assert listing["Resource"] == ["arn:aws:s3:::ckpts"]
    assert listing["Condition"] == {"StringLike": {"s3:prefix": ["teams/nlp/jobs/run-7/", "teams/nlp/jobs/run-7/*"]}}
    strict = render_job_iam_policy("ckpts", "nlp", "run-7", root="platform/", allow_abort_multipart=False)
    assert set(strict["Statement"][0]["Action"]) == {"s3:GetObject", "s3:PutObject", "s3:DeleteObject"}
    assert strict["Statement"][0]["Resource"] == ["arn:aws:s3:::ckpts/platform/teams/nlp/jobs/run-7/*"]
    every_action = [a for s in policy["Statement"] for a in s["Action"]]
    assert not any("*" in a for a in every_action)  # no wildcard actions, nothing bucket-wide but the listing
    with pytest.raises(ValueError):
        render_job_iam_policy("ckpts", "nlp", "../other")


def test_local_path_stays_local(tmp_path):
    store = LocalObjectStore(tmp_path)
    store.put_bytes("a/b", b"x")
    assert store.local_path("a/b") == Path(tmp_path).resolve() / "a" / "b"
