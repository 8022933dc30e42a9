"""Per-job access policies, rendered as data (pure: no I/O, no boto3).

A `JobGrant` is the enumerated allow-list of one job's workers: write only where a worker writes (its
checkpoints and their chunks, the up-going half of its channel, its profiles and logs), read its own prefix
(which holds the control plane's commands, `channel/*/down/`, that the workers read but cannot forge) and the
sources it was given read access to (its pinned dataset version, code snapshot, `init_from` checkpoint and
tokenizer, when they live in the object store), nothing else. It renders three ways:

- `sts_session_policy`: the AWS session policy `sts:AssumeRole(Policy=...)` intersects the jobs role with,
  so the credentials handed to the workers can do this and no more (credentials.StsIssuer);
- `seaweedfs_actions`: the same grant in SeaweedFS's `-s3.config` identity format, which the embedded stack
  and the test server enforce for real (credentials.SeaweedFSIdentities);
- `render_job_iam_policy`: the job's own prefix only (no sources), kept in the job record as documentation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainforge.infra.storage.layout import job_prefix

WRITABLE = ("checkpoints", "chunks", "channel/*/up", "channel/*/nodes", "profiles", "logs")
"""What a job's workers write, relative to the job prefix (`*`: one segment attempt's folder). Everything else
under the prefix, the channel's `down/` commands included, is read-only to them."""


@dataclass(frozen=True, slots=True)
class JobGrant:
    """One job's allow-list in one bucket: `root` is the store's key prefix inside the bucket; `reads` are extra
    read-only prefixes (`bucket/key-prefix`, any bucket) of the sources the job was handed."""

    bucket: str
    team: str
    job: str
    root: str = ""
    reads: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.bucket or "/" in self.bucket:
            raise ValueError(f"invalid bucket name {self.bucket!r}")
        for r in self.reads:
            if "/" not in r.strip("/") or ".." in r.split("/"):
                raise ValueError(f"read grant {r!r} must be 'bucket/prefix' (no '..')")

    @property
    def prefix(self) -> str:
        """`root/teams/{team}/jobs/{job}` inside the bucket."""
        return _job_root(self.team, self.job, self.root)

    def write_patterns(self) -> list[str]:
        """`bucket/key*` patterns the job may create, overwrite and delete."""
        return [f"{self.bucket}/{self.prefix}/{w}/*" for w in WRITABLE]

    def read_patterns(self) -> list[str]:
        """`bucket/key*` patterns it may read: its own prefix, and each source's (a source that is a pattern
        already, ending in `*`, as it is: a glob's literal start)."""
        return [f"{self.bucket}/{self.prefix}/*",
                *(r if r.endswith("*") else f"{r.strip('/')}/*" for r in self.reads)]


def grant_from_uris(storage_url: str, team: str, job: str, sources: list[str | None]) -> JobGrant | None:
    """The grant of a job whose store is `storage_url` (None unless it is `s3://`); every source that is an
    `s3://bucket/key` URI (dataset version, code snapshot, init_from, tokenizer) becomes a read of that prefix."""
    if not storage_url.startswith("s3://"):
        return None
    bucket, _, root = storage_url.removeprefix("s3://").partition("/")
    reads = sorted({s.removeprefix("s3://").rstrip("/") for s in sources if s and s.startswith("s3://")})
    return JobGrant(bucket, team, job, root.strip("/"), tuple(reads))


def seaweedfs_actions(grant: JobGrant) -> list[str]:
    """SeaweedFS `-s3.config` actions (`Action:bucket/path` with `*` wildcards, checked by the server)."""
    reads = grant.read_patterns()
    return [*(f"Read:{p}" for p in reads), *(f"List:{p}" for p in reads),
            *(f"Write:{p}" for p in grant.write_patterns())]


def _arn(pattern: str) -> str:
    return f"arn:aws:s3:::{pattern}"


def sts_session_policy(grant: JobGrant) -> dict[str, Any]:
    """The session policy for `sts:AssumeRole(Policy=json.dumps(...))`: the effective permissions of the
    credentials are the intersection of the jobs role's policy and this one (AWS STS), so however wide the
    role, the job's workers get exactly this allow-list."""
    reads = grant.read_patterns()
    listing: dict[str, list[str]] = {}
    for pattern in reads:
        bucket, _, key = pattern.partition("/")
        listing.setdefault(bucket, []).extend([key.removesuffix("*"), key])
    return {
        "Version": "2012-10-17",
        "Statement": [
            # GetObjectVersion: a dataset read in place from a versioned bucket reads by the pinned version id
            {"Sid": "JobRead", "Effect": "Allow", "Action": ["s3:GetObject", "s3:GetObjectVersion"],
             "Resource": [_arn(p) for p in reads]},
            *({"Sid": f"JobListing{i}", "Effect": "Allow", "Action": ["s3:ListBucket"],
               "Resource": [_arn(bucket)], "Condition": {"StringLike": {"s3:prefix": prefixes}}}
              for i, (bucket, prefixes) in enumerate(sorted(listing.items()))),
            {"Sid": "JobWrite", "Effect": "Allow",
             "Action": ["s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
             "Resource": [_arn(p) for p in grant.write_patterns()]},
        ],
    }


def _job_root(team: str, job: str, root: str) -> str:
    root = root.strip("/")
    return f"{root}/{job_prefix(team, job)}" if root else job_prefix(team, job)


def render_job_iam_policy(
    bucket: str, team: str, job: str, *, root: str = "", allow_abort_multipart: bool = True
) -> dict[str, Any]:
    """The IAM policy document for one job's credentials.

    root: the key prefix of the platform's store inside the bucket (the path of `s3://bucket/root`).
    allow_abort_multipart: S3 authorises AbortMultipartUpload separately from PutObject; the store aborts the
    multipart uploads it fails to complete, so the grant is on by default (same prefix, nothing wider).
    """
    if not bucket or "/" in bucket:
        raise ValueError(f"invalid bucket name {bucket!r}")
    prefix = _job_root(team, job, root)
    object_actions = ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"]
    if allow_abort_multipart:
        object_actions.append("s3:AbortMultipartUpload")
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Sid": "JobObjects",
                "Effect": "Allow",
                "Action": object_actions,
                "Resource": [f"arn:aws:s3:::{bucket}/{prefix}/*"],
            },
            {
                "Sid": "JobListing",
                "Effect": "Allow",
                "Action": ["s3:ListBucket"],
                "Resource": [f"arn:aws:s3:::{bucket}"],
                "Condition": {"StringLike": {"s3:prefix": [f"{prefix}/", f"{prefix}/*"]}},
            },
        ],
    }
