"""Secret stores and redaction: file (Kubernetes Secret layout) / env / chained / plugged-in stores, missing secrets
named without values, and redaction of every log record (message, args, exception text, loggers created later,
handlers with their own formatting), MLflow-bound params and copied log files.

Run: .venv/bin/python -m pytest tests/unit/registry/test_secrets.py
"""

from __future__ import annotations

import io
import logging
import secrets as pysecrets

import pytest

from trainforge.registry.secrets import (
    ChainSecretStore,
    EnvSecretStore,
    FileSecretStore,
    SecretNotFound,
    default_store,
    env_name,
    redact,
    redact_file,
    redact_obj,
    resolve_secrets,
)


def value() -> str:
    return "val-" + pysecrets.token_hex(8)


def test_file_and_env_stores(tmp_path, monkeypatch):
    files = FileSecretStore(tmp_path / "s")
    files.put("nlp/hf-token", "abc-123\n")
    assert files.get("nlp/hf-token") == "abc-123"
    assert (tmp_path / "s" / "nlp" / "hf-token").stat().st_mode & 0o777 == 0o600
    with pytest.raises(SecretNotFound, match="nlp/other"):
        files.get("nlp/other")
    with pytest.raises(ValueError):
        files.get("../etc/passwd")
    assert env_name("nlp/hf-token") == "TRAINFORGE_SECRET_NLP_HF_TOKEN"
    env = EnvSecretStore({"TRAINFORGE_SECRET_NLP_HF_TOKEN": "from-env"})
    assert env.get("nlp/hf-token") == "from-env"
    assert ChainSecretStore(files, env).get("nlp/hf-token") == "abc-123"
    with pytest.raises(SecretNotFound, match="TRAINFORGE_SECRET_X"):
        ChainSecretStore(files, env).get("x")


def test_default_store_chain_and_plugin(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINFORGE_SECRETS_DIR", str(tmp_path))
    monkeypatch.setenv("TRAINFORGE_SECRET_ONLY_ENV", "env-value")
    assert default_store().get("only-env") == "env-value"
    monkeypatch.setenv("TRAINFORGE_SECRET_STORE", "tests.unit.registry.test_secrets:FakeStore")
    assert default_store().get("anything") == "fake-anything"


class FakeStore:
    def get(self, name: str) -> str:
        return f"fake-{name}"


def test_resolve_names_every_missing_secret_and_never_a_value():
    store = EnvSecretStore({"TRAINFORGE_SECRET_A": "aaaa-value"})
    with pytest.raises(SecretNotFound) as err:
        resolve_secrets([{"name": "a", "env": "A"}, {"name": "b", "env": "B"}, {"name": "c", "env": "C"}], store)
    assert "'b'" in str(err.value) and "'c'" in str(err.value) and "aaaa-value" not in str(err.value)
    assert resolve_secrets([{"name": "a", "env": "A_VAR"}], store) == {"A_VAR": "aaaa-value"}
    with pytest.raises(ValueError, match="too short"):
        resolve_secrets([{"name": "a", "env": "A"}], EnvSecretStore({"TRAINFORGE_SECRET_A": "ab"}))


def test_every_log_record_is_redacted():
    v = value()
    resolve_secrets([{"name": "team/token", "env": "TOKEN"}], EnvSecretStore({"TRAINFORGE_SECRET_TEAM_TOKEN": v}))
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    late = logging.getLogger(f"created.after.install.{pysecrets.token_hex(3)}")  # a logger made afterwards
    late.addHandler(handler)
    late.setLevel(logging.DEBUG)
    late.propagate = False
    late.info("token is %s", v)
    late.warning(f"inline {v} in an f-string")
    late.debug({"env": {"TOKEN": v}})
    try:
        raise RuntimeError(f"request failed with header Bearer {v}")
    except RuntimeError:
        late.exception("call failed")
    out = stream.getvalue()
    assert v not in out
    assert out.count("***team/token***") == 4, out  # message, f-string, dict arg, exception text


def test_redact_objects_and_files(tmp_path):
    v = value()
    resolve_secrets([{"name": "k", "env": "K"}], EnvSecretStore({"TRAINFORGE_SECRET_K": v}))
    assert redact(f"x{v}y") == "x***k***y"
    assert redact_obj({"a": [f"p{v}"], v: 1}) == {"a": ["p***k***"], "***k***": 1}
    src = tmp_path / "rank0.log"
    src.write_bytes(b"\xff\xfe binary then " + v.encode() + b"\n")
    assert redact_file(src, tmp_path / "out.log")
    assert v.encode() not in (tmp_path / "out.log").read_bytes()
