"""Per-job credentials: the grant (pure), its SeaweedFS and STS renderings, the STS issuer against botocore's
Stubber, the issuer setting, the flow-side holder, and the worker's report of what the store refused.
The server's own enforcement is tested on SeaweedFS in tests/integration/test_object_store.py and, with a job's
model code attacking another team, in tests/integration/test_checkpoint_s3.py."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from trainforge.contract.events import AccessDenied
from trainforge.contract.router import EventRouter, Log, RecordSecurity
from trainforge.infra.storage.credentials import (
    ENV_VAR,
    JobCredentials,
    SeaweedFSIdentities,
    StsIssuer,
    issuer_from_env,
)
from trainforge.infra.storage.iam import JobGrant, grant_from_uris, seaweedfs_actions, sts_session_policy

JOB = "platform/teams/nlp/jobs/run-7"


def test_grant_writes_only_where_workers_write_and_reads_its_sources():
    grant = grant_from_uris("s3://ckpts/platform", "nlp", "run-7",
                            ["s3://data/datasets/web/v3/", "/local/code", None, "s3://ckpts/platform/teams/nlp/jobs/p"])
    assert grant is not None and grant.prefix == JOB
    assert grant.reads == ("ckpts/platform/teams/nlp/jobs/p", "data/datasets/web/v3")
    assert grant.write_patterns() == [f"ckpts/{JOB}/{w}/*" for w in
                                      ("checkpoints", "chunks", "channel/*/up", "channel/*/nodes", "profiles", "logs")]
    assert grant.read_patterns() == [f"ckpts/{JOB}/*", "ckpts/platform/teams/nlp/jobs/p/*", "data/datasets/web/v3/*"]
    actions = seaweedfs_actions(grant)
    assert f"Read:ckpts/{JOB}/*" in actions and f"Write:ckpts/{JOB}/checkpoints/*" in actions
    assert not any(a.startswith("Write:") and "down" in a for a in actions)  # commands are never writable
    assert not any(a.startswith("Write:data/") for a in actions)  # sources are read-only
    assert grant_from_uris("file:///var/store", "nlp", "run-7", []) is None
    for bad in (lambda: JobGrant("a/b", "nlp", "r"), lambda: JobGrant("b", "nlp", "r", reads=("nobucket",)),
                lambda: JobGrant("b", "nlp", "r", reads=("b/../x",)), lambda: JobGrant("b", "nlp", "../r").prefix):
        with pytest.raises(ValueError):
            bad()


def test_sts_session_policy_is_the_same_allow_list():
    grant = JobGrant("ckpts", "nlp", "run-7", "platform", reads=("data/datasets/web/v3",))
    policy = sts_session_policy(grant)
    json.dumps(policy)
    by_sid = {s["Sid"]: s for s in policy["Statement"]}
    assert by_sid["JobRead"]["Resource"] == [f"arn:aws:s3:::ckpts/{JOB}/*", "arn:aws:s3:::data/datasets/web/v3/*"]
    assert by_sid["JobRead"]["Action"] == ["s3:GetObject", "s3:GetObjectVersion"]
    assert set(by_sid["JobWrite"]["Action"]) == {"s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"}
    assert by_sid["JobWrite"]["Resource"] == [f"arn:aws:s3:::{p}" for p in grant.write_patterns()]
    listings = {s["Resource"][0]: s["Condition"]["StringLike"]["s3:prefix"] for s in policy["Statement"]
                if s["Action"] == ["s3:ListBucket"]}
    assert listings == {"arn:aws:s3:::ckpts": [f"{JOB}/", f"{JOB}/*"],
                        "arn:aws:s3:::data": ["datasets/web/v3/", "datasets/web/v3/*"]}
    assert not any("*" in a for s in policy["Statement"] for a in s["Action"])


def test_sts_issuer_assumes_the_role_with_the_grant_as_session_policy():
    import boto3
    from botocore.stub import Stubber

    client = boto3.client("sts", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="y")
    grant = JobGrant("ckpts", "nlp", "run-7", "platform")
    expiry = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    with Stubber(client) as stub:
        stub.add_response("assume_role", {
            "Credentials": {"AccessKeyId": "ASIAJOB000000000", "SecretAccessKey": "s" * 40, "SessionToken": "t" * 40,
                            "Expiration": expiry}},
            {"RoleArn": "arn:aws:iam::123456789012:role/tf-jobs", "RoleSessionName": "tf-nlp-run-7",
             "Policy": json.dumps(sts_session_policy(grant), separators=(",", ":")), "DurationSeconds": 43200})
        creds = StsIssuer("arn:aws:iam::123456789012:role/tf-jobs", client).issue(grant, ttl_s=7 * 86400)
    assert creds.env() == {"TRAINFORGE_JOB_S3_ACCESS_KEY_ID": "ASIAJOB000000000",
                           "TRAINFORGE_JOB_S3_SECRET_ACCESS_KEY": "s" * 40, "TRAINFORGE_JOB_S3_SESSION_TOKEN": "t" * 40}
    assert creds.expires_at == expiry.timestamp()
    assert "s" * 40 not in repr(creds) and "t" * 40 not in repr(creds)


def test_issuer_setting(tmp_path):
    assert issuer_from_env({}) is None and issuer_from_env({ENV_VAR: "none"}) is None
    sw = issuer_from_env({ENV_VAR: f"seaweedfs:{tmp_path}/ids.json", "AWS_ENDPOINT_URL": "http://10.0.0.1:8333"})
    assert isinstance(sw, SeaweedFSIdentities) and sw.endpoint == "http://10.0.0.1:8333"
    assert isinstance(issuer_from_env({ENV_VAR: "sts:arn:aws:iam::1:role/r"}), StsIssuer)
    for bad in ("seaweedfs:", "sts:role", "vault:x"):
        with pytest.raises(ValueError, match=ENV_VAR):
            issuer_from_env({ENV_VAR: bad})


def test_identities_file_keeps_others_and_tombstones_a_revoked_key(tmp_path):
    path = tmp_path / "s3-identities.json"
    ids = SeaweedFSIdentities(path)  # no endpoint: no server to probe
    ids.write([{"name": "admin", "credentials": [{"accessKey": "A", "secretKey": "S"}], "actions": ["Admin"]}])
    creds = ids.issue(JobGrant("b", "nlp", "run-7"), ttl_s=60)
    names = [i["name"] for i in ids.read()]
    assert names == ["admin", "job-nlp-run-7"] and oct(path.stat().st_mode & 0o777) == "0o600"
    ids.revoke(creds)
    entry = ids.read()[1]
    assert entry["actions"] == [] and entry["credentials"][0]["accessKey"] == creds.access_key_id
    assert entry["credentials"][0]["secretKey"] != creds.secret_access_key
    assert ids.read()[0]["actions"] == ["Admin"]


@dataclass
class RecordingIssuer:
    kind: str = "seaweedfs"
    issued: list[JobGrant] = field(default_factory=list)
    revoked: list[str] = field(default_factory=list)

    def issue(self, grant: JobGrant, ttl_s: float) -> JobCredentials:
        self.issued.append(grant)
        return JobCredentials(f"job-{grant.team}-{grant.job}", f"AK{len(self.issued)}", f"secret-{len(self.issued)}")

    def revoke(self, credentials: JobCredentials) -> None:
        self.revoked.append(credentials.access_key_id)


def _config(storage_url: str, resolved: Path):
    """A job whose dataset version streams from s3://data/web/v3 (its resolved folder's source.json says so)."""
    from trainforge.contract.config import SegmentConfig

    resolved.mkdir(exist_ok=True)
    (resolved / "source.json").write_text(json.dumps({"store_url": "s3://data", "prefix": "web/v3"}))
    return SegmentConfig.model_construct(job_id="run-7", team="nlp", storage_url=storage_url,
                                         dataset=type("D", (), {"path": str(resolved), "in_place": False})(),
                                         code_dir="/code",
                                         init_weights=None, inputs=None)


def test_flow_holder_hands_keys_to_workers_only_and_revokes_once(tmp_path):
    from trainforge.registry.secrets import redact
    from trainforge.tasks import job_credentials

    issuer = RecordingIssuer()
    entry = job_credentials.issue(_config("s3://ckpts/platform", tmp_path), 3600, issuer)
    assert entry["isolation"] == "seaweedfs" and entry["identity"] == "job-nlp-run-7"
    assert "AK1" not in json.dumps(entry) and "secret-1" not in json.dumps(entry)  # what the record keeps
    assert issuer.issued[0].reads == ("data/web/v3",)
    assert job_credentials.worker_env("run-7") == {"TRAINFORGE_JOB_S3_ACCESS_KEY_ID": "AK1",
                                                   "TRAINFORGE_JOB_S3_SECRET_ACCESS_KEY": "secret-1"}
    assert "secret-1" not in redact("leaked secret-1")
    job_credentials.issue(_config("s3://ckpts/platform", tmp_path), 3600, issuer)  # a resume: the old identity goes first
    assert issuer.revoked == ["AK1"] and job_credentials.worker_env("run-7")["TRAINFORGE_JOB_S3_ACCESS_KEY_ID"] == "AK2"
    assert job_credentials.revoke("run-7") and not job_credentials.revoke("run-7")
    assert issuer.revoked == ["AK1", "AK2"] and job_credentials.worker_env("run-7") == {}
    local = job_credentials.issue(_config("file:///var/store", tmp_path), 3600, issuer)
    assert local["isolation"] == "scoped-handle" and len(issuer.issued) == 2


def test_a_refusal_is_routed_to_the_job_record():
    event = AccessDenied(operation="PutObject", bucket="ckpts", key="teams/vision/jobs/x/checkpoints/m.json")
    actions = EventRouter().route(event)
    assert isinstance(actions[0], Log) and actions[0].level == "warning" and "PutObject" in actions[0].message
    assert isinstance(actions[1], RecordSecurity)
    assert actions[1].entry["key"] == "teams/vision/jobs/x/checkpoints/m.json"


def test_worker_hook_reports_every_refusal_and_changes_nothing_for_the_caller():
    import boto3
    from botocore.exceptions import ClientError
    from botocore.stub import Stubber

    from trainforge.trainer import store_audit

    seen: list[AccessDenied] = []
    store_audit._done = False
    from botocore.client import BaseClient

    original = BaseClient._make_api_call
    try:
        assert store_audit.install(seen.append) and not store_audit.install(seen.append)
        s3 = boto3.client("s3", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="y")
        with Stubber(s3) as stub:
            stub.add_client_error("get_object", "AccessDenied", http_status_code=403)
            stub.add_client_error("get_object", "NoSuchKey", http_status_code=404)
            stub.add_response("list_buckets", {"Buckets": []})
            with pytest.raises(ClientError, match="AccessDenied"):
                s3.get_object(Bucket="ckpts", Key="teams/vision/x")
            with pytest.raises(ClientError, match="NoSuchKey"):
                s3.get_object(Bucket="ckpts", Key="mine")
            assert s3.list_buckets()["Buckets"] == []
    finally:
        BaseClient._make_api_call = original  # type: ignore[method-assign]
        store_audit._done = False
    assert [(e.operation, e.bucket, e.key, e.code) for e in seen] == [("GetObject", "ckpts", "teams/vision/x",
                                                                       "AccessDenied")]


def test_the_grant_reads_the_dataset_where_its_shards_stream_from(tmp_path):
    """The grant's dataset read is the version's prefix in its store (source.json, or the shipped inputs), never
    the resolved folder's local path (which granted nothing: a remote catalog's shards were refused)."""
    from tests.segment_configs import segment_config
    from trainforge.contract.config import ShippedInputs
    from trainforge.tasks.job_credentials import sources

    folder = tmp_path / "resolved"
    folder.mkdir()
    (folder / "source.json").write_text(json.dumps({"store_url": "s3://data/catalog", "prefix": "web/versions/v3"}))
    remote = segment_config(storage_url="s3://ckpts", dataset={"path": str(folder)})
    assert sources(remote) == ["s3://data/catalog/web/versions/v3"]
    grant = grant_from_uris(remote.storage_url, "t", "j", sources(remote))
    assert grant is not None and grant.reads == ("data/catalog/web/versions/v3",)
    assert sources(segment_config(storage_url="s3://ckpts", dataset={"path": str(tmp_path)})) == [None]  # local shards
    shipped = remote.model_copy(update={"inputs": ShippedInputs(
        code="inputs/code/a.tar", code_sha256="a", dataset_store="s3://ckpts",
        dataset_prefix="teams/t/jobs/j/inputs/datasets/web/versions/v3")})
    assert sources(shipped) == ["s3://ckpts/teams/t/jobs/j/inputs/datasets/web/versions/v3"]
