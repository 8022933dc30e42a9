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


def test_secret_forms_and_mask():
    """The value, its base64 (both alphabets, padded or not) and URL encoding are all masked, longest first."""
    import base64
    from urllib.parse import quote, quote_plus

    from trainforge.registry.secrets import mask, secret_forms

    secret = "p@ss w/rd?" + pysecrets.token_hex(3)
    forms = secret_forms(secret)
    expected = {secret, quote(secret, safe=""), quote_plus(secret), base64.b64encode(secret.encode()).decode(),
                base64.urlsafe_b64encode(secret.encode()).decode()}
    assert expected <= set(forms) and [len(f) for f in forms] == sorted((len(f) for f in forms), reverse=True)
    values = dict.fromkeys(forms, "nlp/token")
    text = " | ".join(["Authorization: Basic " + forms[0], *sorted(expected)])
    masked = mask(text, values)
    assert not any(f in masked for f in forms) and masked.count("***nlp/token***") >= len(expected)
    assert secret_forms("abc") == []  # too short to mask (the store refuses such values)


def test_stream_masker_masks_a_secret_split_across_chunks():
    from trainforge.registry.secrets import StreamMasker, secret_forms

    secret = value()
    values = dict.fromkeys(secret_forms(secret), "nlp/token")
    text = f"step 1 loss 2.0\ntoken={secret}\nb64={secret_forms(secret)[0]}\nend\n".encode()
    for cut in range(1, len(text)):  # every split point, including inside the secret
        masker = StreamMasker(values)
        out = masker.feed(text[:cut]) + masker.feed(text[cut:]) + masker.flush()
        assert secret.encode() not in out and b"***nlp/token***" in out and out.endswith(b"end\n"), cut
    masker = StreamMasker(values)  # byte by byte: nothing is lost or reordered but the masked spans
    out = b"".join(masker.feed(text[i:i + 1]) for i in range(len(text))) + masker.flush()
    whole = StreamMasker(values)
    assert out == whole.feed(text) + whole.flush()
    assert StreamMasker({}).feed(b"plain") == b"plain"


@pytest.mark.slow
def test_captured_output_of_a_process_that_prints_its_secret_is_masked(tmp_path):
    """What the platform captures from user code (a pipe pumped into its log file) carries no secret form."""
    import base64
    import subprocess
    import sys
    from urllib.parse import quote

    from trainforge.registry.secrets import mask_stream, register_secret

    secret = value() + "/+="
    register_secret("nlp/hf-token", secret)
    code = ("import base64, sys, urllib.parse; s = sys.argv[1]; print('token', s); "
            "print('b64', base64.b64encode(s.encode()).decode()); print('url', urllib.parse.quote(s, safe=''), "
            "file=sys.stderr)")
    proc = subprocess.Popen([sys.executable, "-c", code, secret], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    log = tmp_path / "stdout.log"
    with log.open("wb") as sink:
        mask_stream(proc.stdout, sink)
    assert proc.wait(timeout=60) == 0
    captured = log.read_text()
    for form in (secret, base64.b64encode(secret.encode()).decode(), quote(secret, safe="")):
        assert form not in captured
    assert captured.count("***nlp/hf-token***") == 3, captured
