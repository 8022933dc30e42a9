"""Every command quoted in docs/ prints the numbers the text quotes.

Convention (docs/design.md, "How numbers are checked"): a fenced block whose info string is `console` and whose
first line is `$ COMMAND` (continued with a trailing backslash) is followed by expected output lines, usually an
excerpt. The test runs the command from the repository root and checks that every number in the expected lines
appears among the numbers of the real output. A number written `~N` is approximate (a timing) and not checked;
a line `...` only marks elided output. Only cheap, deterministic commands are allowed: `trainforge plan`,
`trainforge validate`, `trainforge render` (manifests, offline), `trainforge simulate` on the shared traces, and `python -c`.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BIN = Path(sys.executable).parent
ALLOWED = (("trainforge", "plan"), ("trainforge", "validate"), ("trainforge", "render"), ("trainforge", "simulate"),
           ("python", "-c"))
NUMBER = re.compile(r"(?<![\w.~])-?\d[\d,]*(?:\.\d+)?")
FENCE = re.compile(r"^```console\n(.*?)^```", re.S | re.M)


def _numbers(text: str) -> list[str]:
    return [m.group(0).replace(",", "") for m in NUMBER.finditer(text)]


def _blocks() -> list[tuple[str, str, list[str]]]:
    found = []
    for page in sorted(DOCS.glob("*.md")):
        for m in FENCE.finditer(page.read_text()):
            lines = m.group(1).splitlines()
            if not lines or not lines[0].startswith("$ "):
                continue
            cmd = lines[0][2:]
            i = 1
            while cmd.endswith("\\") and i < len(lines):
                cmd = cmd[:-1].rstrip() + " " + lines[i].strip()
                i += 1
            found.append((f"{page.name}:{cmd[:60]}", cmd, [ln for ln in lines[i:] if ln.strip() != "..."]))
    return found


BLOCKS = _blocks()


def test_docs_quote_commands():
    pages = {b[0].split(":")[0] for b in BLOCKS}
    assert {"design.md", "capacity.md", "network.md", "scheduler.md", "walkthroughs.md"} <= pages
    assert all(expected for _, _, expected in BLOCKS), "every quoted command shows its output"


def _run(cmd: str, home: Path) -> tuple[int, str]:
    argv = shlex.split(cmd)
    argv[0] = str(BIN / "trainforge") if argv[0] == "trainforge" else sys.executable
    env = {**os.environ, "COLUMNS": "200", "TRAINFORGE_HOME": str(home), "NO_COLOR": "1"}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, tuple[int, str]]:
    """Every quoted command, run once and concurrently (they are independent; ~1 s of CPU each)."""
    cmds = sorted({cmd for _, cmd, _ in BLOCKS if _runnable(cmd)})
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {cmd: pool.submit(_run, cmd, tmp_path_factory.mktemp("home")) for cmd in cmds}
        return {cmd: f.result() for cmd, f in futures.items()}


def _runnable(cmd: str) -> bool:
    argv = shlex.split(cmd)
    return tuple(argv[:2]) in ALLOWED and all((ROOT / a).exists() for a in argv[2:] if a.startswith("../shared/"))


@pytest.mark.parametrize(("cmd", "expected"), [b[1:] for b in BLOCKS], ids=[b[0] for b in BLOCKS])
def test_quoted_command_prints_quoted_numbers(cmd: str, expected: list[str], outputs):
    argv = shlex.split(cmd)
    assert tuple(argv[:2]) in ALLOWED, f"not a cheap deterministic command: {cmd}"
    if not _runnable(cmd):
        pytest.skip("a trace under ../shared/ is not on this machine")
    rc, out = outputs[cmd]
    assert rc == 0, f"{cmd} exited {rc}:\n{out[-2000:]}"
    have = set(_numbers(out))
    missing = [(line, n) for line in expected for n in _numbers(line) if n not in have]
    assert not missing, f"{cmd}: numbers quoted in docs but not printed: {missing}\n--- output ---\n{out[-3000:]}"


LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"^```.*?^```", re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", CODE.sub("", page.read_text()), re.M)}


def test_relative_links_in_docs_resolve():
    """A link between docs pages (or to a repository file) names a file that exists and, with #anchor, a heading of
    that page: the design page is read by following its links, and a renamed heading breaks them silently."""
    broken = []
    for page in sorted(DOCS.glob("*.md")):
        for m in LINK.finditer(CODE.sub("", page.read_text())):
            target, _, anchor = m.group(1).partition("#")
            if "://" in target or target.startswith("mailto:"):
                continue
            path = (page.parent / target) if target else page
            if not path.exists():
                broken.append(f"{page.name}: {m.group(1)} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{page.name}: {m.group(1)} (no heading with that anchor in {path.name})")
    assert not broken, "broken links in docs/:\n" + "\n".join(broken)


def test_design_page_covers_every_required_deliverable():
    """Issue #13's list of deliverables, each present in docs/design.md (as a section or a row of its table)."""
    text = (DOCS / "design.md").read_text().lower()
    required = ["requirements clarified and assumptions", "## architecture", "control plane vs data plane",
                "7b fine-tune", "200b pre-train", "trade-offs: tp vs pp vs fsdp", "consistency vs throughput",
                "scheduler.md", "fault-tolerance.md", "walkthroughs.md", "data.md", "observability.md",
                "network.md", "capacity.md", "young/daly at 4,096 gpus", "## cost model", "security.md",
                "## evolution path"]
    missing = [r for r in required if r not in text]
    assert not missing, f"docs/design.md lacks: {missing}"


# ---- README.md: what a new user pastes --------------------------------------------------------------------------

README = ROOT / "README.md"
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _readme_blocks(lang: str) -> list[str]:
    return [m.group(2) for m in BLOCK.finditer(README.read_text()) if m.group(1) == lang]


def _readme_commands() -> list[str]:
    """Every `trainforge ...` line of README's bash blocks, its comment and any redirection cut off."""
    out = []
    for block in _readme_blocks("bash"):
        for line in block.splitlines():
            command = line.split("  #")[0].split(" # ")[0].strip()
            if command.startswith("trainforge"):
                out.append(command)
    return out


def test_readme_command_blocks_are_one_command_per_line():
    """`a | b` alternatives in a block are real pipes when pasted; `../shared` exists only on the authors' machines."""
    text = README.read_text()
    assert "../shared" not in text
    for block in _readme_blocks("bash"):
        for line in block.splitlines():
            command = line.split("#")[0]
            assert " | " not in command and "\\" not in command, f"README: more than one command on {line!r}"
    assert len(_readme_commands()) >= 30


@pytest.mark.parametrize("command", _readme_commands())
def test_readme_commands_parse_against_the_cli(command):
    """Each README command names a real command, real options and valid choices (parsed by the CLI itself,
    nothing run): an option renamed or a choice dropped breaks the README visibly."""
    import typer

    from trainforge.cli import app

    argv = shlex.split(command.split(" > ")[0])[1:]
    cmd = typer.main.get_command(app)
    ctx = cmd.make_context("trainforge", argv)
    while hasattr(cmd, "commands"):
        name, cmd, rest = cmd.resolve_command(ctx, ctx._protected_args + ctx.args)
        ctx = cmd.make_context(name, rest, parent=ctx)
    assert not ctx.args, f"{command}: unused arguments {ctx.args}"


def test_readme_paths_exist():
    """Files named in README's commands are in the repository (my-job.yaml is the one the reader writes)."""
    missing = [a for c in _readme_commands() for a in shlex.split(c)
               if re.match(r"(examples|docs)/", a) and not (ROOT / a).exists()]
    assert not missing, f"README names files that do not exist: {missing}"


def test_readme_first_job_spec_is_a_valid_spec():
    import yaml

    from trainforge.spec import parse_spec

    spec = parse_spec(yaml.safe_load(_readme_blocks("yaml")[0]))
    assert spec.name == "my-first-job" and spec.dataset.ref.startswith("catalog://")
    text = README.read_text()
    assert text.index("## Your first job spec") < text.index("## Using it") < text.index("### Where things land")


def test_readme_sdk_is_three_lines():
    (sdk,) = _readme_blocks("python")
    lines = [ln for ln in sdk.splitlines() if ln.strip()]
    assert len(lines) == 3 and lines[0] == "from trainforge import submit"
