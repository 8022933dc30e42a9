"""Code from git: the job's `code.repo` fetched at submit, its pinned commit checked out, the commit recorded.

- A remote repository (https://, ssh://, git@host:path, git://, file://) or a local path with a pinned
  `code.commit` is fetched into a mirror under `$TRAINFORGE_HOME/code/repos/` (one bare repository per URL: a
  second job of the same repository fetches only what is new), and the commit's tree is exported once to
  `$TRAINFORGE_HOME/code/trees/<full commit id>/`: content-addressed, so every job of that commit runs the same
  files and a tree is never half-written (exported beside, then renamed into place).
- Unpinned, the repository's HEAD at submit is pinned and recorded (a resume reuses the recorded commit, not a
  HEAD that moved since).
- A local path with no pinned commit runs in place, as before (the edit-and-run loop); its HEAD is recorded,
  `-dirty` when the working tree has changes.
- A private repository names a secret in `code.auth`: for https its value is a token (HTTP basic auth, user
  `x-access-token` unless the value is `user:token`), handed to git through the environment
  (`GIT_CONFIG_*`: never in a command line, a URL in the mirror's config, a log or an error); for ssh it is a
  private key, written 0600 to a temporary file for the fetch only.
- An unreachable repository, an unknown commit or an entrypoint missing from the commit is a `JobRejected`
  naming the field, before anything is allocated or recorded.

The tree reaches the workers as `SegmentConfig.code_dir`: a local path on the flow's host (the local backend's
workers share it). Workers on other machines get it through the object store (tasks/inputs.py publishes it,
trainer/inputs.py fetches it into the node's folder).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from trainforge.home import home
from trainforge.registry.secrets import default_store, register_secret
from trainforge.spec import JobSpec, Problem, SpecError, is_remote_repo
from trainforge.tasks.prepare import JobRejected, code_commit

FULL_SHA = re.compile(r"[0-9a-f]{40}")
FETCH_TIMEOUT_S = 600
GIT_TIMEOUT_S = 120


class CodeRejected(JobRejected):
    """The code cannot be fetched or checked out: the message names the field, the problem and the fix."""


@dataclass(frozen=True)
class CodeCheckout:
    path: str  # the tree the workers run (code_dir)
    commit: str  # the full commit id; for a local working tree run in place: HEAD[-dirty] or "unversioned"
    repo: str  # the repository as the spec names it (credentials stripped)


def public_url(text: str) -> str:
    """A URL (or a git message quoting one) with any user:password@ removed (never recorded or printed)."""
    return re.sub(r"(\w+://)[^/@\s]+@", r"\1", text)


def fetch_code(spec: JobSpec, base_dir: Path, pinned: str | None = None) -> CodeCheckout:
    """The tree and commit a job runs (see the module docstring). `pinned` overrides an unpinned spec (a resume
    passes the commit the job first ran)."""
    code = spec.code
    pin = code.commit or pinned
    if not is_remote_repo(code.repo) and not pin:
        local = (base_dir / code.repo).resolve()
        return CodeCheckout(path=str(local), commit=code_commit(local, None), repo=code.repo)
    source = code.repo if is_remote_repo(code.repo) else str((base_dir / code.repo).resolve())
    cached = _cache() / "trees" / pin if FULL_SHA.fullmatch(pin or "") else None
    if cached is not None and cached.is_dir():  # a full commit id names its files: no fetch needed
        _check_entrypoint(spec, cached)
        return CodeCheckout(path=str(cached), commit=str(pin), repo=public_url(code.repo))
    env = _git_env()
    with _credentials(spec, source, env):
        mirror = _mirror_path(source)
        with _locked(mirror):
            head = _fetch(mirror, source, env, spec.name)
            commit = _resolve(mirror, pin, source, spec.name) if pin else head
            tree = _export(mirror, commit)
    _check_entrypoint(spec, tree)
    return CodeCheckout(path=str(tree), commit=commit, repo=public_url(code.repo))


def _reject(field: str, message: str, value: str | None, fix: str, name: str) -> CodeRejected:
    return CodeRejected(str(SpecError([Problem(field, message, value, fix)], name)))


def _cache() -> Path:
    return home() / "code"


def _mirror_path(source: str) -> Path:
    return _cache() / "repos" / (hashlib.sha256(public_url(source).encode()).hexdigest()[:24] + ".git")


@contextlib.contextmanager
def _locked(mirror: Path) -> Iterator[None]:
    """One fetch per mirror at a time (two submits of one repository share it)."""
    mirror.parent.mkdir(parents=True, exist_ok=True)
    with open(mirror.with_suffix(".lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _git_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    # Never wait for a password prompt or an unknown host key question: fail with a message instead.
    env.update(GIT_TERMINAL_PROMPT="0", GIT_ASKPASS="true", SSH_ASKPASS="true",
               GIT_SSH_COMMAND="ssh -o BatchMode=yes -o StrictHostKeyChecking=accept-new")
    return env


def _add_config(env: dict[str, str], key: str, value: str) -> None:
    n = int(env.get("GIT_CONFIG_COUNT", "0"))
    env.update({f"GIT_CONFIG_KEY_{n}": key, f"GIT_CONFIG_VALUE_{n}": value, "GIT_CONFIG_COUNT": str(n + 1)})


@contextlib.contextmanager
def _credentials(spec: JobSpec, source: str, env: dict[str, str]) -> Iterator[None]:
    name = spec.code.auth
    if not name:
        yield
        return
    try:
        value = default_store().get(name)
    except LookupError as exc:
        raise _reject("code.auth", f"secret {name!r} is not set ({exc})", name,
                      "store it (a token for https, a private key for ssh) under that name, or remove "
                      "code.auth for a public repository", spec.name) from None
    register_secret(name, value)
    if source.startswith(("http://", "https://")):
        token = value.strip()
        user, token = token.split(":", 1) if ":" in token else ("x-access-token", token)
        header = base64.b64encode(f"{user}:{token}".encode()).decode()
        register_secret(f"{name} (basic auth)", header)
        _add_config(env, "http.extraHeader", f"Authorization: Basic {header}")
        yield
        return
    with tempfile.TemporaryDirectory(prefix="tf-git-key-") as tmp:
        key = Path(tmp) / "id"
        key.touch(mode=0o600)
        key.write_text(value if value.endswith("\n") else value + "\n")
        env["GIT_SSH_COMMAND"] += f" -o IdentitiesOnly=yes -i {key}"
        yield


def _git(args: list[str], env: dict[str, str], timeout: float = GIT_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], capture_output=True, text=True, env=env, timeout=timeout)


def _fetch(mirror: Path, source: str, env: dict[str, str], name: str) -> str:
    """Fetch every branch and tag and HEAD into the mirror; returns HEAD's commit."""
    if not (mirror / "HEAD").exists():
        init = _git(["init", "--bare", "--quiet", str(mirror)], env)
        if init.returncode != 0:
            raise OSError(f"cannot create the code cache at {mirror}: {init.stderr.strip()}")
    try:
        done = _git(["--git-dir", str(mirror), "fetch", "--quiet", "--prune", "--force", source, "HEAD",
                     "+refs/heads/*:refs/heads/*", "+refs/tags/*:refs/tags/*"], env, FETCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise _reject("code.repo", f"fetching {public_url(source)} took longer than {FETCH_TIMEOUT_S} s",
                      public_url(source), "check that the repository is reachable from here", name) from None
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["git fetch failed"])[-1]
        raise _reject("code.repo", f"cannot fetch {public_url(source)}: {public_url(why)}", public_url(source),
                      "check the URL and that this machine can reach it; a private repository needs code.auth "
                      "naming a token (https) or a private key (ssh)", name)
    fetch_head = (mirror / "FETCH_HEAD").read_text().split()
    return fetch_head[0]


def _resolve(mirror: Path, pin: str, source: str, name: str) -> str:
    """The full commit id of `pin` (7-40 hex digits) among what was fetched."""
    out = _git(["--git-dir", str(mirror), "rev-parse", "--verify", "--quiet", f"{pin}^{{commit}}"], _git_env())
    commit = out.stdout.strip()
    if out.returncode != 0 or not FULL_SHA.fullmatch(commit):
        raise _reject("code.commit", f"commit {pin} is not in {public_url(source)} (every branch and tag was "
                      "fetched)", pin, "push the commit to a branch or tag of the repository, or pin one that is "
                      "there (`git ls-remote REPO`), or omit code.commit to pin HEAD", name)
    return commit


def _export(mirror: Path, commit: str) -> Path:
    """The commit's files under trees/<commit>, exported once (beside, then renamed: never half there)."""
    final = _cache() / "trees" / commit
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{commit[:12]}-", dir=final.parent))
    try:
        with subprocess.Popen(["git", "--git-dir", str(mirror), "archive", "--format=tar", commit],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_git_env()) as proc:
            assert proc.stdout is not None
            with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
                tar.extractall(tmp, filter="data")  # no absolute paths, no links out of the tree
            err = proc.stderr.read().decode() if proc.stderr else ""
        if proc.returncode != 0:
            raise OSError(f"git archive {commit} failed: {err.strip()}")
        try:
            tmp.rename(final)
        except OSError:  # another submit exported the same commit first: same content
            if not final.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _check_entrypoint(spec: JobSpec, tree: Path) -> None:
    from trainforge.validate import local_code_problems

    problems = local_code_problems(spec.code.entrypoint, spec.code.mode, tree)
    if problems:
        raise CodeRejected(str(SpecError(problems, spec.name)))
