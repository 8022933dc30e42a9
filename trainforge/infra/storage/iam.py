"""Per-job access policies, rendered as data (pure: no I/O, no boto3).

`render_job_iam_policy` is the AWS IAM policy production attaches to a job's role: object read / write /
delete on the job prefix and listing restricted to that prefix, nothing else. `render_seaweedfs_identity`
is the same grant in SeaweedFS's `-s3.config` identity format, which the test server enforces for real.
"""

from __future__ import annotations

from typing import Any

from trainforge.infra.storage.layout import job_prefix


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


def render_seaweedfs_identity(
    name: str, access_key: str, secret_key: str, bucket: str, team: str, job: str, *, root: str = ""
) -> dict[str, Any]:
    """One identity of SeaweedFS's `-s3.config` JSON with Read/Write/List limited to the job prefix.

    SeaweedFS matches `Action:bucket/path*` against `bucket/objectkey` (and the ListObjects prefix), so a
    write, read, delete or listing outside the prefix is refused by the server with 403 AccessDenied."""
    prefix = _job_root(team, job, root)
    scope = f"{bucket}/{prefix}/*"
    return {
        "name": name,
        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
        "actions": [f"Read:{scope}", f"Write:{scope}", f"List:{scope}"],
    }
