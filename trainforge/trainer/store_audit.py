"""Every object-store refusal a worker process meets is reported to the control plane (`AccessDenied` event).

With a per-job identity (tasks/job_credentials.py) the S3 server refuses what the job may not do; this hook makes
the attempt visible too: the worker installs it before the user's code is imported, so a refusal met by any
botocore client of the process (the platform's or one the model code builds itself with boto3) is published on
the job's channel and kept in the job record's `security` list, whether or not the caller catches the error.
What it cannot see: a request made without botocore (raw HTTP) is still refused by the server, but not reported.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any

DENIED = frozenset({"AccessDenied", "Forbidden", "403", "AllAccessDisabled", "InvalidAccessKeyId",
                    "SignatureDoesNotMatch"})

_installed = threading.Lock()
_done = False


def install(publish: Any) -> bool:
    """Wrap botocore's one API-call path; `publish(AccessDenied)` is called for each refusal. Idempotent."""
    global _done
    with _installed:
        if _done:
            return False
        try:
            from botocore.client import BaseClient
            from botocore.exceptions import ClientError
        except ImportError:  # no botocore in this worker: nothing can reach S3 through it
            return False
        from trainforge.contract.events import AccessDenied

        original = BaseClient._make_api_call

        @functools.wraps(original)
        def audited(self: Any, operation_name: str, api_params: dict[str, Any]) -> Any:
            try:
                return original(self, operation_name, api_params)
            except ClientError as exc:
                code = str(exc.response.get("Error", {}).get("Code", ""))
                if code in DENIED:
                    key = api_params.get("Key", api_params.get("Prefix"))
                    with contextlib.suppress(Exception):  # reporting must never change what the caller sees
                        publish(AccessDenied(operation=operation_name, bucket=api_params.get("Bucket"),
                                             key=None if key is None else str(key), code=code))
                raise

        BaseClient._make_api_call = audited  # type: ignore[method-assign]
        _done = True
        return True
