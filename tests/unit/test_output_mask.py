"""A worker's own stdout/stderr masked at the source (trainer/output_mask.py): a real child process that prints
its secret every way it leaks (print, os.write, logging, a subprocess it starts, an exception), read back whole."""

from __future__ import annotations

import base64
import subprocess
import sys
import textwrap
from urllib.parse import quote

import pytest

from trainforge.contract.masking import StreamMasker, spellings
from trainforge.trainer.output_mask import MASKED_ENV, masked_values

pytestmark = pytest.mark.slow  # starts worker processes under the masking wrapper: `make test`, not `make test-fast`

SECRET = "tf-s3cr3t/value+with=chars"

CHILD = textwrap.dedent("""
    import base64, logging, os, subprocess, sys
    from urllib.parse import quote
    from trainforge.trainer import output_mask

    mask = output_mask.start_from_env()
    secret = os.environ["DEMO_TOKEN"]
    print("print:", secret)
    print("b64:", base64.b64encode(secret.encode()).decode(), "url:", quote(secret, safe=""), flush=True)
    os.write(1, ("raw fd write " + secret[:5]).encode())
    os.write(1, (secret[5:] + " done\\n").encode())  # split across two writes
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("user").info("token=%s", secret)
    subprocess.run([sys.executable, "-c", "import os; print('child', os.environ['DEMO_TOKEN'])"], check=True)
    print("s3", os.environ["AWS_SECRET_ACCESS_KEY"], file=sys.stderr)
    print("plain text survives: " + "x" * 70000)
    mask.close()
    print("after close", flush=True)
""")


def test_everything_the_worker_prints_is_masked():
    env = {"PATH": "/usr/bin:/bin", "DEMO_TOKEN": SECRET, MASKED_ENV: "DEMO_TOKEN",
           "AWS_SECRET_ACCESS_KEY": "platform-or-job-secret-key"}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    text = out.stdout + out.stderr
    for form in (SECRET, base64.b64encode(SECRET.encode()).decode(), quote(SECRET, safe=""),
                 "platform-or-job-secret-key"):
        assert form.encode() not in text, form
    stdout = out.stdout.decode()
    assert "print: ***DEMO_TOKEN***" in stdout and "b64: ***DEMO_TOKEN*** url: ***DEMO_TOKEN***" in stdout
    assert "raw fd write ***DEMO_TOKEN*** done" in stdout and "child ***DEMO_TOKEN***" in stdout
    assert "token=***DEMO_TOKEN***" in out.stderr.decode()
    assert "s3 ***AWS_SECRET_ACCESS_KEY***" in out.stderr.decode()
    assert "x" * 70000 in stdout and stdout.rstrip().endswith("after close")  # nothing lost, order kept


def test_masked_values_come_from_the_named_variables_and_the_store_secrets():
    env = {MASKED_ENV: "HF_TOKEN, WANDB_KEY", "HF_TOKEN": "hf_abcdef", "WANDB_KEY": "abc",
           "TRAINFORGE_JOB_S3_SECRET_ACCESS_KEY": "job-secret-123", "OTHER": "not-a-secret"}
    assert masked_values(env) == {"hf_abcdef": "HF_TOKEN", "job-secret-123": "TRAINFORGE_JOB_S3_SECRET_ACCESS_KEY"}


def test_the_masker_holds_back_only_what_could_begin_a_secret():
    masker = StreamMasker(spellings({"secretvalue": "S"}))
    assert masker.feed(b"step 10 loss 2.5\n") == b"step 10 loss 2.5\n"  # a live log line is not kept behind
    assert masker.feed(b"token secr") == b"token "  # could be the start of the secret: held
    assert masker.feed(b"etvalue!\n") == b"***S***!\n"
    assert masker.feed(b"sec") == b"" and masker.flush() == b"sec"


def test_a_worker_killed_mid_line_loses_nothing_and_leaks_nothing():
    child = textwrap.dedent("""
        import os, signal, sys
        from trainforge.trainer import output_mask

        output_mask.start_from_env()
        sys.stdout.write("last words before the crash, token " + os.environ["DEMO_TOKEN"][:9])
        sys.stdout.flush()
        os.write(2, (os.environ["DEMO_TOKEN"][9:] + " end").encode())  # the rest of it, on the other stream
        os.write(1, (os.environ["DEMO_TOKEN"][9:] + " end").encode())
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = {"PATH": "/usr/bin:/bin", "DEMO_TOKEN": SECRET, MASKED_ENV: "DEMO_TOKEN"}
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, timeout=60)
    assert out.returncode == -9
    assert out.stdout.decode() == "last words before the crash, token ***DEMO_TOKEN*** end"
    assert SECRET[9:].encode() in out.stderr  # a fragment alone is not the secret: streams are masked apart
