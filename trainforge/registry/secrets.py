"""Secrets: resolved by name from a pluggable store at launch, injected into the workers' environment only, and
redacted from every log record of this process.

Stores (`SecretStore`: one method, `get(name) -> str`):
  FileSecretStore   a folder with one file per secret (`nlp/hf-token` -> DIR/nlp/hf-token): the layout of a
                    mounted Kubernetes Secret or a Vault agent sink. Default DIR: $TRAINFORGE_SECRETS_DIR, else
                    $TRAINFORGE_HOME/secrets.
  EnvSecretStore    $TRAINFORGE_SECRET_<NAME> with the name upper-cased and every other character '_'
                    (`nlp/hf-token` -> TRAINFORGE_SECRET_NLP_HF_TOKEN), for CI and local runs.
  ChainSecretStore  the first store that has it (default: file, then env).
$TRAINFORGE_SECRET_STORE=`module:factory` plugs in another store (e.g. a cloud secret manager).

Where values may go: the worker process environment (`resolve_secrets` -> `run_segment(extra_env=...)`), nowhere
else. They never enter the spec, the job record, Prefect parameters, MLflow, checkpoints or manifests. Every value
resolved here is registered with `redact`, and `install_redaction` makes every LogRecord of the process carry the
redacted text (a log-record factory, so loggers created later are covered too, Prefect's API handler included).
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from trainforge.contract.masking import MIN_SECRET_LEN as MIN_SECRET_LEN
from trainforge.contract.masking import StreamMasker as _StreamMasker
from trainforge.contract.masking import mask_stream as _mask_stream
from trainforge.contract.masking import secret_forms as secret_forms
from trainforge.home import home


class SecretNotFound(LookupError):
    pass


class SecretStore(Protocol):
    def get(self, name: str) -> str:
        """The value of secret `name`; SecretNotFound if absent."""


def _check_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-/]{0,127}", name) or ".." in name:
        raise ValueError(f"invalid secret name {name!r}")
    return name


class FileSecretStore:
    def __init__(self, root: str | Path | None = None):
        self.root = Path(root or os.environ.get("TRAINFORGE_SECRETS_DIR") or home() / "secrets")

    def get(self, name: str) -> str:
        path = self.root / _check_name(name)
        try:
            return path.read_text().rstrip("\r\n")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise SecretNotFound(f"secret {name!r} is not in {self.root}") from None

    def put(self, name: str, value: str) -> None:
        """Store a secret (owner-only permissions)."""
        path = self.root / _check_name(name)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(value)


def env_name(name: str) -> str:
    return "TRAINFORGE_SECRET_" + re.sub(r"[^A-Z0-9]", "_", _check_name(name).upper())


class EnvSecretStore:
    def __init__(self, environ: Mapping[str, str] | None = None):
        self.environ = os.environ if environ is None else environ

    def get(self, name: str) -> str:
        value = self.environ.get(env_name(name))
        if value is None:
            raise SecretNotFound(f"secret {name!r} is not set (${env_name(name)})")
        return value


class ChainSecretStore:
    def __init__(self, *stores: SecretStore):
        self.stores = stores

    def get(self, name: str) -> str:
        misses = []
        for store in self.stores:
            try:
                return store.get(name)
            except SecretNotFound as exc:
                misses.append(str(exc))
        raise SecretNotFound("; ".join(misses))


def default_store() -> SecretStore:
    plug = os.environ.get("TRAINFORGE_SECRET_STORE")
    if plug:
        module, _, factory = plug.partition(":")
        return getattr(importlib.import_module(module), factory or "store")()
    return ChainSecretStore(FileSecretStore(), EnvSecretStore())


def resolve_secrets(refs: Iterable[Mapping[str, str] | Any], store: SecretStore | None = None) -> dict[str, str]:
    """{env var: value} for the spec's `secrets` (dicts or SecretRef), each value registered for redaction.
    A missing secret is an error naming every missing one (never a value)."""
    store = store or default_store()
    out: dict[str, str] = {}
    missing = []
    for ref in refs:
        name, env = (ref["name"], ref["env"]) if isinstance(ref, Mapping) else (ref.name, ref.env)
        try:
            value = store.get(name)
        except SecretNotFound as exc:
            missing.append(str(exc))
            continue
        if len(value) < MIN_SECRET_LEN:
            raise ValueError(f"secret {name!r} is shorter than {MIN_SECRET_LEN} characters: too short to redact "
                             "reliably from logs; store the real value")
        register_secret(name, value)
        out[env] = value
    if missing:
        raise SecretNotFound("cannot start the job: " + "; ".join(missing))
    return out


# ------------------------------------------------------------------------------------------ redaction

_VALUES: dict[str, str] = {}  # value -> name
_LOCK = threading.Lock()
_INSTALLED = False


def register_secret(name: str, value: str) -> None:
    if len(value) >= MIN_SECRET_LEN:
        with _LOCK:
            for form in secret_forms(value):
                _VALUES.setdefault(form, name)
            _VALUES[value] = name
        install_redaction()


def mask(text: str, values: Mapping[str, str]) -> str:
    """`text` with every key of `values` (a secret spelling -> its name) replaced by `***<name>***`, longest
    first (so a value is masked whole before any shorter secret inside it)."""
    for value, name in sorted(values.items(), key=lambda kv: -len(kv[0])):
        if value in text:
            text = text.replace(value, f"***{name}***")
    return text


def redact(text: str) -> str:
    """`text` with every registered secret value, and its base64 and URL-encoded forms, replaced by
    `***<name>***` (longest values first)."""
    if not _VALUES or not isinstance(text, str):
        return text
    with _LOCK:
        values = dict(_VALUES)
    return mask(text, values)


class StreamMasker(_StreamMasker):
    __doc__ = _StreamMasker.__doc__

    def __init__(self, values: Mapping[str, str] | None = None):
        """`values`: spelling -> name (default: every registered secret, all its forms)."""
        with _LOCK:
            super().__init__(dict(_VALUES if values is None else values))


def mask_stream(source: Any, sink: Any, values: Mapping[str, str] | None = None, chunk: int = 65536) -> int:
    """contract.masking.mask_stream, by default with every registered secret."""
    if values is None:
        with _LOCK:
            values = dict(_VALUES)
    return _mask_stream(source, sink, values, chunk)


def redact_obj(obj: Any) -> Any:
    """Redact every string in a JSON-like value (params, tags, reports)."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, Mapping):
        return {redact_obj(k): redact_obj(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(redact_obj(v) for v in obj)
    return obj


def _redact_record(record: logging.LogRecord) -> logging.LogRecord:
    if not _VALUES:
        return record
    try:
        message = record.getMessage()
    except Exception:  # a malformed record: leave it to the handler's own error path
        return record
    clean = redact(message)
    if clean != message:
        record.msg, record.args = clean, None
    if record.exc_info and not record.exc_text:
        record.exc_text = logging.Formatter().formatException(record.exc_info)
    if record.exc_text:
        record.exc_text = redact(record.exc_text)
    if record.stack_info:
        record.stack_info = redact(record.stack_info)
    return record


class RedactionFilter(logging.Filter):
    """For handlers outside this process's record factory (e.g. added by a library with its own records)."""

    def filter(self, record: logging.LogRecord) -> bool:
        _redact_record(record)
        return True


def install_redaction() -> None:
    """Redact every LogRecord this process creates (all loggers, present and future), and add the filter to
    every handler that exists now (records made by other factories). Idempotent."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        _INSTALLED = True
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        return _redact_record(previous(*args, **kwargs))

    logging.setLogRecordFactory(factory)
    loggers = [logging.getLogger(), *[lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]]
    for lg in loggers:
        for handler in lg.handlers:
            if not any(isinstance(f, RedactionFilter) for f in handler.filters):
                handler.addFilter(RedactionFilter())


def redact_bytes(data: bytes) -> bytes:
    """`data` with every registered secret (all its forms, see secret_forms) masked."""
    masker = StreamMasker()
    return masker.feed(data) + masker.flush()


def redact_file(src: Path, dst: Path) -> bool:
    """Copy a file with secrets redacted (artifacts uploaded from a job's logs). True if anything changed."""
    data = src.read_bytes()
    clean = redact_bytes(data)
    dst.write_bytes(clean)
    return clean != data


def job_access_policy(storage_url: str, team: str, job_id: str) -> dict[str, Any]:
    """The per-job IAM policy production attaches to the job's short-lived credentials (S3 prefix of the job
    only), rendered for the job record. For a local store, the policy the same layout would get in a bucket."""
    from trainforge.infra.storage.iam import render_job_iam_policy

    if storage_url.startswith("s3://"):
        bucket, _, root = storage_url.removeprefix("s3://").partition("/")
    else:
        bucket, root = "BUCKET", ""
    return {"storage_url": storage_url, "policy": render_job_iam_policy(bucket, team, job_id, root=root)}
