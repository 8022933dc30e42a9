"""Code from git (issue 21.1): code.repo fetched at submit, the pinned commit checked out, the commit recorded.

A local bare repository whose HEAD differs from the pinned commit: HEAD's model raises on import, so a job that
ran HEAD instead of its pin fails. A private repository is served over git's dumb HTTP protocol by a local
server that demands basic auth, as a forge does for a token."""

from __future__ import annotations

import base64
import copy
import http.server
import subprocess
import threading
from functools import partial
from pathlib import Path

import pytest
import yaml

from trainforge.spec import parse_spec
from trainforge.tasks.code_source import CodeRejected, fetch_code

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

PINNED_MODEL = '''
from trainforge.trainer.models.llama import build_model as _build

MARK = "pinned"


def build_model(config):
    return _build(config)
'''
HEAD_MODEL = 'raise RuntimeError("HEAD ran: the job pinned an earlier commit")\n'


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args], cwd=cwd,
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> dict[str, object]:
    """A working repository (HEAD = the raising model) and its bare clone; returns both and the two commits."""
    work = tmp_path / "work"
    (work / "tinymodel").mkdir(parents=True)
    _git(work, "init", "-q", "-b", "main")
    (work / "tinymodel" / "__init__.py").write_text("")
    (work / "tinymodel" / "model.py").write_text(PINNED_MODEL)
    _git(work, "add", "-A")
    _git(work, "commit", "-q", "-m", "a model that trains")
    pinned = _git(work, "rev-parse", "HEAD")
    (work / "tinymodel" / "model.py").write_text(HEAD_MODEL)
    _git(work, "commit", "-q", "-am", "a model that does not")
    head = _git(work, "rev-parse", "HEAD")
    bare = tmp_path / "models.git"
    _git(tmp_path, "clone", "-q", "--bare", str(work), str(bare))
    return {"work": work, "bare": bare, "pinned": pinned, "head": head}


def _spec(repo_url: str, commit: str | None = None, entrypoint: str = "tinymodel.model:build_model", **code):
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["code"] = {"repo": repo_url, "entrypoint": entrypoint, "mode": "managed", **code}
    if commit:
        doc["code"]["commit"] = commit
    return doc


def test_the_pinned_commit_is_checked_out_not_head(repo, tmp_path) -> None:
    url = f"file://{repo['bare']}"
    short = str(repo["pinned"])[:10]
    got = fetch_code(parse_spec(_spec(url, short)), tmp_path)
    assert got.commit == repo["pinned"] and got.repo == url
    assert 'MARK = "pinned"' in (Path(got.path) / "tinymodel" / "model.py").read_text()
    assert Path(got.path).name == repo["pinned"]  # content-addressed: trees/<full commit id>
    again = fetch_code(parse_spec(_spec(url, short)), tmp_path)
    assert again.path == got.path and Path(got.path).stat().st_ino == Path(again.path).stat().st_ino

    # A full commit id whose tree is already exported runs it without fetching (the repository may be gone).
    moved = Path(str(repo["bare"])).rename(tmp_path / "moved.git")
    cached = fetch_code(parse_spec(_spec(url, str(repo["pinned"]))), tmp_path)
    assert cached.path == got.path and cached.commit == repo["pinned"]
    moved.rename(Path(str(repo["bare"])))

    unpinned = fetch_code(parse_spec(_spec(url)), tmp_path)
    assert unpinned.commit == repo["head"], "no commit pinned: HEAD at submit is pinned and recorded"
    assert "HEAD ran" in (Path(unpinned.path) / "tinymodel" / "model.py").read_text()

    # A local path with a pinned commit is fetched too: the working tree (at HEAD) is not what runs.
    local = fetch_code(parse_spec(_spec("work", short)), tmp_path)
    assert local.commit == repo["pinned"] and local.path == got.path
    # ... and without a pin it runs in place, HEAD recorded.
    in_place = fetch_code(parse_spec(_spec("work")), tmp_path)
    assert in_place.path == str(repo["work"]) and in_place.commit == repo["head"]


def test_unknown_commit_unreachable_repo_and_missing_entrypoint_are_clear_errors(repo, tmp_path) -> None:
    url = f"file://{repo['bare']}"
    with pytest.raises(CodeRejected) as unknown:
        fetch_code(parse_spec(_spec(url, "deadbeef12")), tmp_path)
    assert "code.commit" in str(unknown.value) and "deadbeef12 is not in" in str(unknown.value)
    with pytest.raises(CodeRejected) as unreachable:
        fetch_code(parse_spec(_spec(f"file://{tmp_path}/nowhere.git")), tmp_path)
    assert "code.repo" in str(unreachable.value) and "cannot fetch" in str(unreachable.value)
    with pytest.raises(CodeRejected) as missing:
        fetch_code(parse_spec(_spec(url, str(repo["pinned"]), entrypoint="tinymodel.absent:build")), tmp_path)
    assert "code.entrypoint" in str(missing.value) and "tinymodel.absent" in str(missing.value)
    assert "Traceback" not in str(missing.value)
    trees = tmp_path.parent.glob("**/code/trees/.*")  # no half-exported tree left beside the real ones
    assert not list(trees)


class _AuthHandler(http.server.SimpleHTTPRequestHandler):
    expected = ""
    seen: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        got = self.headers.get("Authorization", "")
        self.seen.append(got)
        if got != self.expected:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="forge"')
            self.end_headers()
            return
        super().do_GET()

    def log_message(self, *args) -> None:
        pass


def test_a_private_repository_over_https_needs_its_named_secret(repo, tmp_path, monkeypatch) -> None:
    token = "tok-" + "s3cr3t" * 4
    _git(Path(str(repo["bare"])), "update-server-info")  # the dumb HTTP protocol serves the bare repo's files
    handler = partial(type("H", (_AuthHandler,), {"seen": [], "expected": "Basic " + base64.b64encode(
        f"x-access-token:{token}".encode()).decode()}), directory=str(Path(str(repo["bare"])).parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/models.git"
    try:
        with pytest.raises(CodeRejected) as refused:
            fetch_code(parse_spec(_spec(url, str(repo["pinned"]))), tmp_path)
        assert "cannot fetch" in str(refused.value) and "code.auth" in str(refused.value)
        with pytest.raises(CodeRejected, match="secret 'ml/git-token' is not set"):
            fetch_code(parse_spec(_spec(url, str(repo["pinned"]), auth="ml/git-token")), tmp_path)

        monkeypatch.setenv("TRAINFORGE_SECRET_ML_GIT_TOKEN", token)
        got = fetch_code(parse_spec(_spec(url, str(repo["pinned"]), auth="ml/git-token")), tmp_path)
        assert got.commit == repo["pinned"]
        assert 'MARK = "pinned"' in (Path(got.path) / "tinymodel" / "model.py").read_text()
    finally:
        server.shutdown()
    # The token went as a header only: not into the mirror's config, not into any file of the code cache.
    cache = next(tmp_path.parent.glob("**/code/repos"))
    for path in cache.rglob("*"):
        if path.is_file():
            assert token.encode() not in path.read_bytes(), path


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_job_runs_the_pinned_commit_of_a_bare_repository(repo, prefect_api, tmp_path) -> None:
    from trainforge.datasets.demo import ensure_demo_dataset
    from trainforge.flows.train_job import train_job
    from trainforge.registry.jobs import JobStore
    from trainforge.registry.lineage import LineageStore, job_id_node

    ensure_demo_dataset()
    doc = _spec(f"file://{repo['bare']}", str(repo["pinned"])[:12])
    doc["training"].update({"max_steps": 8, "global_batch_size": 8, "seq_len": 64})
    doc["parallelism"]["micro_batch_size"] = 4
    doc["checkpoint"]["interval_steps"] = 4
    doc["evaluation"]["batches"] = 1
    result = train_job(copy.deepcopy(doc), "git-job.yaml", str(tmp_path))
    record = JobStore().get(result["job_id"])
    assert record.data["state"] == "completed"
    assert record.data["code_commit"] == repo["pinned"] and record.data["code_repo"] == f"file://{repo['bare']}"
    attrs = LineageStore().node(job_id_node(result["job_id"])).attrs
    assert attrs["code_commit"] == repo["pinned"] and attrs["code_repo"] == f"file://{repo['bare']}"
