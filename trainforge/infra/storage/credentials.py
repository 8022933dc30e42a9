"""Per-job object-store credentials, made by the server at provision and revoked when the job ends.

An issuer turns a `JobGrant` (iam.py: the job's enumerated allow-list) into credentials that only that job's
workers receive, through their process environment (`TRAINFORGE_JOB_S3_*`, which `launch.worker_environment`
puts in place of the platform's own keys). The values never go to a log (they are registered for redaction
and masked in every captured stream), the spec, the job record, MLflow or a manifest; the record keeps the
identity's name and the grant only.

Issuers, chosen by $TRAINFORGE_JOB_CREDENTIALS (`issuer_from_env`):
  seaweedfs:PATH   SeaweedFS's `-s3.config` identities file at PATH (the embedded stack's and the test
                   server's): an identity per job, the server reloaded (SIGHUP to the pid in `weed.pid` beside
                   it) and the new key probed until the server accepts it. Revoking keeps the entry with no
                   actions and a new random secret: weed 4.48 ignores an identity that just disappears from the
                   file on reload (measured), so a removed entry would stay valid until the server restarts.
  sts:ROLE_ARN     AWS STS AssumeRole on the jobs role with the grant as session policy (the intersection is
                   what the keys can do), lasting the job's max_runtime (at most 12 h: the role's limit).
                   STS session credentials cannot be revoked one by one; they expire.
  none             no per-job identity: workers get the platform's credentials (a warning says so).
Unset: `none` for a local store; for an `s3://` store with no issuer the flow warns and records it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import signal
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from trainforge.infra.storage.iam import JobGrant, seaweedfs_actions, sts_session_policy

ENV_VAR = "TRAINFORGE_JOB_CREDENTIALS"
KEY_ENV, SECRET_ENV, TOKEN_ENV = ("TRAINFORGE_JOB_S3_ACCESS_KEY_ID", "TRAINFORGE_JOB_S3_SECRET_ACCESS_KEY",
                                  "TRAINFORGE_JOB_S3_SESSION_TOKEN")
PID_FILE = "weed.pid"


PLATFORM_CREDENTIAL_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                            "AWS_DEFAULT_PROFILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE",
                            "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_AUTHORIZATION_TOKEN")


def without_platform_credentials(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with no way back to the platform's identity or other jobs' secrets: the platform's AWS keys and every
    variable that points botocore at other credentials, the env secret store's TRAINFORGE_SECRET_* (every team's),
    and any job identity. For processes that run user code: workers (which then get their own job's keys) and
    the offline evaluate/export processes (which read local files only)."""
    return {k: v for k, v in env.items()
            if k not in PLATFORM_CREDENTIAL_VARS and not k.startswith(("TRAINFORGE_SECRET_", "TRAINFORGE_JOB_S3_"))}


class CredentialError(RuntimeError):
    """Credentials could not be issued (the job does not start without the isolation it asked for)."""


@dataclass(frozen=True, slots=True)
class JobCredentials:
    identity: str
    """A name for the record and the logs (never the key)."""
    access_key_id: str
    secret_access_key: str
    session_token: str | None = None
    expires_at: float | None = None

    def env(self) -> dict[str, str]:
        """What the workers' environment gets (launch.worker_environment swaps them in as AWS_*)."""
        env = {KEY_ENV: self.access_key_id, SECRET_ENV: self.secret_access_key}
        if self.session_token:
            env[TOKEN_ENV] = self.session_token
        return env

    def values(self) -> list[str]:
        """The values to mask wherever output is kept."""
        return [v for v in (self.secret_access_key, self.session_token, self.access_key_id) if v]

    def __repr__(self) -> str:  # never the secret
        return f"JobCredentials(identity={self.identity!r})"


class CredentialIssuer(Protocol):
    kind: str

    def issue(self, grant: JobGrant, ttl_s: float) -> JobCredentials: ...

    def revoke(self, credentials: JobCredentials) -> None: ...


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One writer of the identities file at a time, across processes (flows of several jobs share a server)."""
    fd = os.open(path.with_suffix(path.suffix + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


class SeaweedFSIdentities:
    """Edits a running SeaweedFS's `-s3.config` file and makes the server load it."""

    kind = "seaweedfs"

    def __init__(self, config_path: str | Path, *, endpoint: str | None = None, reload_timeout_s: float = 15.0):
        self.config_path = Path(config_path)
        self.endpoint = endpoint
        self.reload_timeout_s = reload_timeout_s

    # -- the file --------------------------------------------------------------------------------------------
    def read(self) -> list[dict[str, Any]]:
        try:
            return list(json.loads(self.config_path.read_text()).get("identities", []))
        except FileNotFoundError:
            return []

    def _write(self, identities: list[dict[str, Any]]) -> None:
        tmp = self.config_path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"identities": identities}, f)
        os.replace(tmp, self.config_path)  # the server never reads half a file

    def write(self, identities: list[dict[str, Any]]) -> None:
        with _locked(self.config_path):
            self._write(identities)

    def put(self, identity: dict[str, Any]) -> None:
        """Add or replace (by name) one identity and reload the server."""
        with _locked(self.config_path):
            identities = [i for i in self.read() if i.get("name") != identity["name"]] + [identity]
            self._write(identities)
        self._reload()

    def _reload(self) -> None:
        pid_path = self.config_path.with_name(PID_FILE)
        try:
            pid = int(pid_path.read_text().strip())
        except (OSError, ValueError):
            return  # not running: it reads the file when it starts
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGHUP)

    # -- the issuer ------------------------------------------------------------------------------------------
    def issue(self, grant: JobGrant, ttl_s: float) -> JobCredentials:
        access_key = "TFJOB" + secrets.token_hex(8).upper()
        creds = JobCredentials(identity=f"job-{grant.team}-{grant.job}"[:120], access_key_id=access_key,
                               secret_access_key=secrets.token_urlsafe(30), expires_at=time.time() + ttl_s)
        self.put({"name": creds.identity, "credentials": [{"accessKey": access_key,
                                                            "secretKey": creds.secret_access_key}],
                  "actions": seaweedfs_actions(grant)})
        self.wait_for(creds, accepted=True)
        return creds

    def revoke(self, credentials: JobCredentials) -> None:
        # A tombstone, not a removal: see the module docstring.
        self.put({"name": credentials.identity, "actions": [],
                  "credentials": [{"accessKey": credentials.access_key_id, "secretKey": secrets.token_urlsafe(30)}]})
        self.wait_for(credentials, accepted=False)

    def wait_for(self, creds: JobCredentials, *, accepted: bool) -> None:
        """Until the server accepts (or refuses) the key: a signed request tells, whatever the identity may do."""
        if not self.endpoint:
            return
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError

        client = boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id=creds.access_key_id,
            aws_secret_access_key=creds.secret_access_key,
            config=Config(s3={"addressing_style": "path"}, connect_timeout=2, read_timeout=2,
                          retries={"mode": "standard", "total_max_attempts": 1}))
        deadline = time.monotonic() + self.reload_timeout_s
        while True:
            try:
                client.list_buckets()
                known = True
            except ClientError as e:
                known = e.response.get("Error", {}).get("Code") not in ("InvalidAccessKeyId", "SignatureDoesNotMatch")
            except BotoCoreError:
                known = not accepted  # unreachable: keep waiting either way
            if known == accepted:
                return
            if time.monotonic() > deadline:
                state = "accepted" if accepted else "refused"
                raise CredentialError(f"the S3 server at {self.endpoint} has not {state} identity "
                                      f"{creds.identity!r} within {self.reload_timeout_s:g}s after reloading "
                                      f"{self.config_path}: is the server's -s3.config this file?")
            time.sleep(0.1)


class StsIssuer:
    """Short-lived credentials of the jobs role, narrowed to the grant by a session policy."""

    kind = "sts"
    MAX_S = 12 * 3600

    def __init__(self, role_arn: str, client: Any = None):
        self.role_arn = role_arn
        self._client = client

    def client(self) -> Any:
        if self._client is None:
            import boto3

            self._client = boto3.client("sts")
        return self._client

    def issue(self, grant: JobGrant, ttl_s: float) -> JobCredentials:
        name = f"tf-{grant.team}-{grant.job}"[:64]
        out = self.client().assume_role(RoleArn=self.role_arn, RoleSessionName=name,
                                        Policy=json.dumps(sts_session_policy(grant), separators=(",", ":")),
                                        DurationSeconds=int(min(max(ttl_s, 900), self.MAX_S)))
        c = out["Credentials"]
        expiry = c.get("Expiration")
        return JobCredentials(identity=name, access_key_id=c["AccessKeyId"], secret_access_key=c["SecretAccessKey"],
                              session_token=c.get("SessionToken"),
                              expires_at=expiry.timestamp() if hasattr(expiry, "timestamp") else None)

    def revoke(self, credentials: JobCredentials) -> None:
        """Nothing to call: a session's keys cannot be revoked alone; they expire with the job's max_runtime."""


def issuer_from_env(env: Mapping[str, str] | None = None) -> CredentialIssuer | None:
    """The issuer $TRAINFORGE_JOB_CREDENTIALS names (None for `none` or unset); a bad value names the fix."""
    env = os.environ if env is None else env
    value = env.get(ENV_VAR, "").strip()
    if value in ("", "none"):
        return None
    kind, _, arg = value.partition(":")
    if kind == "seaweedfs" and arg:
        return SeaweedFSIdentities(arg, endpoint=env.get("AWS_ENDPOINT_URL"))
    if kind == "sts" and arg.startswith("arn:"):
        return StsIssuer(arg)
    raise ValueError(f"{ENV_VAR}={value!r}: use seaweedfs:/path/to/s3-identities.json, sts:arn:aws:iam::ACCOUNT:"
                     "role/NAME or none")


def with_job_credentials(store: Any) -> Any:
    """The job's own S3 identity when the platform handed one to the workers (TRAINFORGE_JOB_S3_ACCESS_KEY_ID /
    TRAINFORGE_JOB_S3_SECRET_ACCESS_KEY; in production rendered from `render_job_iam_policy`): the server then
    refuses anything outside the job prefix, on top of the handle's own scope."""
    key, secret = os.environ.get("TRAINFORGE_JOB_S3_ACCESS_KEY_ID"), os.environ.get("TRAINFORGE_JOB_S3_SECRET_ACCESS_KEY")
    if key and secret and hasattr(store, "with_credentials"):
        return store.with_credentials(key, secret)
    return store
