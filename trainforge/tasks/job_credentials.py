"""The job's own object-store identity: issued at provision, handed to its workers only, revoked at the end.

The flow calls `issue` once the gang is admitted and `revoke` in its `finally`; every train-segment attempt
adds `worker_env(job_id)` to the workers' environment. The credentials stay in this process's memory (never a
task result, which Prefect may persist, nor the job record, which keeps the identity's name and the grant).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from pathlib import Path
from typing import Any

from trainforge.contract.config import SegmentConfig
from trainforge.datasets.catalog import SOURCE_FILE
from trainforge.infra.storage.credentials import CredentialIssuer, JobCredentials, issuer_from_env
from trainforge.infra.storage.iam import grant_from_uris, seaweedfs_actions, sts_session_policy
from trainforge.registry.secrets import register_secret

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_ISSUED: dict[str, tuple[CredentialIssuer, JobCredentials]] = {}


def sources(config: SegmentConfig) -> list[str | None]:
    """What the job reads besides its own prefix: its pinned dataset version where its shards stream from (the
    tokenizer ships inside it), or the s3:// prefix it reads in place. The code and the init_from weights are files
    on the flow's host, or, for a gang on other machines, under the job's own prefix (tasks/inputs.py), as is a
    local dataset version it ships (and an in-place version's manifest)."""
    return [dataset_source(config), *([in_place_source(config)] if config.dataset.in_place else [])]


def in_place_source(config: SegmentConfig) -> str | None:
    """What a dataset read in place may read (its manifest, in the flow's version folder, names it): its prefix,
    narrowed by a glob to the glob's literal start (`s3://b/shared/team-a-*.jsonl` reads `b/shared/team-a-*`, not
    the other teams' files beside it)."""
    if not config.dataset.in_place:
        return None
    manifest = json.loads((Path(config.dataset.path) / "manifest.json").read_text())
    source, pattern = str(manifest["source"]).rstrip("/"), str(manifest.get("pattern", ""))
    literal = re.split(r"[*?\[]", pattern, maxsplit=1)[0] if pattern else ""
    return f"{source}/{literal}*" if pattern else source


def dataset_source(config: SegmentConfig) -> str | None:
    """The dataset version's prefix as a URI (`s3://bucket/.../versions/v`), None when its shards are local files.
    The resolved folder's `source.json` names it for a remote catalog or lakeFS; the folder's own path never does
    (granting it granted nothing, and the workers' reads of a remote catalog outside the job's prefix were refused)."""
    if config.inputs is not None:
        store, prefix = config.inputs.dataset_store, config.inputs.dataset_prefix
    else:
        source = Path(config.dataset.path) / SOURCE_FILE
        if not config.dataset.path or not source.is_file():
            return None
        found = json.loads(source.read_text())
        store, prefix = found["store_url"], found["prefix"]
    return f"{store.rstrip('/')}/{prefix.strip('/')}"


def issue(config: SegmentConfig, ttl_s: float, issuer: CredentialIssuer | None = None) -> dict[str, Any]:
    """Credentials for the job's workers, kept here for `worker_env`; returns what the job record keeps."""
    grant = grant_from_uris(config.storage_url, config.team, config.job_id, sources(config))
    if grant is None:
        return {"isolation": "scoped-handle", "why": "local object store: no server to enforce an identity"}
    issuer = issuer or issuer_from_env()
    if issuer is None:
        log.warning("job %s: no per-job S3 identity ($TRAINFORGE_JOB_CREDENTIALS is unset or none): its workers "
                    "use the platform's own credentials and can reach every team's objects", config.job_id)
        return {"isolation": "none", "why": "TRAINFORGE_JOB_CREDENTIALS unset"}
    revoke(config.job_id)  # a resumed job gets a fresh identity; the old one is revoked first
    creds = issuer.issue(grant, ttl_s)
    for value in creds.values():
        register_secret(f"{creds.identity}/s3", value)
    with _LOCK:
        _ISSUED[config.job_id] = (issuer, creds)
    rendered = sts_session_policy(grant) if issuer.kind == "sts" else {"actions": seaweedfs_actions(grant)}
    return {"isolation": issuer.kind, "identity": creds.identity, "expires_at": creds.expires_at,
            "grant": rendered}


def worker_env(job_id: str) -> dict[str, str]:
    with _LOCK:
        issued = _ISSUED.get(job_id)
    return issued[1].env() if issued else {}


def revoke(job_id: str) -> bool:
    """Revoke the job's identity (idempotent); a failure is logged, never raised over the job's own outcome."""
    with _LOCK:
        issued = _ISSUED.pop(job_id, None)
    if issued is None:
        return False
    issuer, creds = issued
    try:
        issuer.revoke(creds)
    except Exception as exc:
        log.error("job %s: could not revoke S3 identity %s: %s", job_id, creds.identity, exc)
        return False
    return True
