"""Layers one way (issue #16, ARCHITECTURE.md "Invariants"): an AST check over every module of trainforge/.

The import graph counts every import that runs: module-level ones and those inside functions (a function-level
import is still a dependency, it only runs later), relative imports and `from pkg import submodule`. Imports under
`if TYPE_CHECKING:` count too: they never run, but a type from another module is a dependency on it, and a cycle
kept alive by one is still two modules that each need the other.

Rules:
  (a) no import cycle anywhere in trainforge/;
  (b) nothing below tasks/, flows/, sdk.py, commands/, cli.py and __main__.py imports them;
  (c) the trainer (trainer/, runtime.py) reaches no control-plane module, directly or through another module;
      storage and the checkpoint format (infra.storage, registry.manifest / dedup) sit below both;
  (d) contract/ imports only spec, plan, infra.storage and itself (no torch, no trainer, nothing of the
      control plane), directly or through another module;
  (e) the pure layers (spec.py, plan/) import only each other.

Each failure names the importing module, the line and the imported module. Run: pytest tests/unit/test_layers.py
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "trainforge"

# The top: only these may import each other's modules (the CLI calls the SDK and flows, the SDK runs the flow, flows
# call tasks, ...).
TOP = ("trainforge.tasks", "trainforge.flows", "trainforge.sdk", "trainforge.commands", "trainforge.cli",
       "trainforge.__main__")

# The control plane the trainer must never load (it runs on every rank, next to the user's code): all of infra/
# and registry/ (scheduler, backends, launch, k8s, servers, simulator, cost; job records, tracking, promotion,
# lineage, reports, alerts, retention) but storage and the checkpoint format (manifests, chunks, and the job's fence
# that every commit is conditional on), which sit below both sides.
CONTROL_PLANE = ("trainforge.infra", "trainforge.registry", *TOP)
BELOW_BOTH = ("trainforge.infra.storage", "trainforge.registry.manifest", "trainforge.registry.dedup",
              "trainforge.registry.fence")
TRAINER = ("trainforge.trainer", "trainforge.runtime")

# What the contract may import of trainforge (it is imported by both sides, so it sits below both).
CONTRACT = ("trainforge.contract",)
CONTRACT_MAY_IMPORT = ("trainforge.contract", "trainforge.spec", "trainforge.plan", "trainforge.infra.storage")
# Third-party frameworks the contract must not load (torch would make the control plane import it).
CONTRACT_NO_THIRD_PARTY = ("torch", "deepspeed", "safetensors", "prefect", "mlflow")

PURE = ("trainforge.spec", "trainforge.plan")


@dataclass(frozen=True, slots=True)
class Import:
    """One import statement's dependency: `importer` (a module) imports `target` at `line`."""

    importer: str
    line: int
    target: str  # a trainforge module, or the dotted name of a third-party / stdlib module
    function_level: bool  # inside a def: runs when the function is called
    typing_only: bool  # under `if TYPE_CHECKING:`: never runs

    def __str__(self) -> str:
        if self.line == 0:
            return f"{self.importer} runs its package {self.target}"
        return f"{self.importer}:{self.line} imports {self.target}"


def module_names(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the package (a package is its __init__)."""
    root = package_dir.parent
    names: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _innermost_module(name: str, modules: Mapping[str, object]) -> str | None:
    """The longest prefix of `name` that is a module of ours (`pkg.mod.Class` -> `pkg.mod`), or None."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def parse_imports(module: str, source: str, *, is_package: bool, modules: Mapping[str, object],
                  package: str = "trainforge") -> list[Import]:
    """Every import in one module's source, resolved to modules of `package` where they are ours."""
    found: list[Import] = []

    def add(target: str, node: ast.stmt, function_level: bool, typing_only: bool) -> None:
        if target == package or target.startswith(package + "."):
            ours = _innermost_module(target, modules)
            if ours is None or ours == module:
                return
            target = ours
        found.append(Import(module, node.lineno, target, function_level, typing_only))

    def visit(node: ast.AST, function_level: bool, typing_only: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node, function_level, typing_only)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the current package, one level up per extra dot
                here = module.split(".") if is_package else module.split(".")[:-1]
                here = here[:len(here) - (node.level - 1)]
                base = ".".join([*here, base] if base else here)
            for alias in node.names:
                # `from pkg import submodule` depends on the submodule; `from mod import name` on mod.
                child = f"{base}.{alias.name}"
                add(child if child in modules else base, node, function_level, typing_only)
        inner_function = function_level or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, inner_function, True)
            for child in node.orelse:
                visit(child, inner_function, typing_only)
            return
        # Imports are statements: only statement blocks can hold one (bodies, else/finally, except, match cases).
        for value in vars(node).values():
            if isinstance(value, list):
                for child in value:
                    if isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)):
                        visit(child, inner_function, typing_only)

    visit(ast.parse(source), False, False)
    return list(dict.fromkeys(found))  # `from m import a, b` is one dependency of that line


def scan(package_dir: Path = PACKAGE_DIR) -> dict[str, list[Import]]:
    """Module -> its imports, for every module of the package."""
    modules = module_names(package_dir)
    return {name: parse_imports(name, path.read_text(), is_package=path.name == "__init__.py", modules=modules,
                                package=package_dir.name)
            for name, path in modules.items()}


def _within(module: str, prefixes: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def find_cycles(graph: Mapping[str, list[Import]]) -> list[list[Import]]:
    """One concrete cycle (as its chain of imports) per strongly connected component of the import graph."""
    edges: dict[str, dict[str, Import]] = {m: {} for m in graph}
    for module, imports in graph.items():
        for imp in imports:
            if imp.target in edges:
                edges[module].setdefault(imp.target, imp)
    # Tarjan's algorithm, iterative (no recursion limit on a deep package).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    cycles = []
    for component in components:
        # Shortest way from the component's first module back to itself, staying inside the component.
        members, first = set(component), component[0]
        came_from: dict[str, Import] = {}
        frontier, seen = [first], {first}
        while frontier and first not in came_from:
            following = []
            for node in frontier:
                for target, imp in sorted(edges[node].items()):
                    if target == first and first not in came_from:
                        came_from[first] = imp
                    elif target in members and target not in seen:
                        seen.add(target)
                        came_from[target] = imp
                        following.append(target)
            frontier = following
        chain, node = [], first
        while True:
            imp = came_from[node]
            chain.append(imp)
            node = imp.importer
            if node == first:
                break
        cycles.append(chain[::-1])
    return cycles


def upward_imports(graph: Mapping[str, list[Import]]) -> list[Import]:
    """Rule (b): an import of tasks/flows/commands/cli from below them."""
    return [imp for module, imports in graph.items() if not _within(module, TOP)
            for imp in imports if _within(imp.target, TOP)]


def _packages_of(module: str, graph: Mapping[str, object]) -> list[str]:
    """The packages whose __init__ runs before `module` does (`a.b.c` -> `a`, `a.b`)."""
    parts = module.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in graph]


def reachable_violations(graph: Mapping[str, list[Import]], sources: Iterable[str], forbidden: Iterable[str],
                         allowed: Iterable[str] = ()) -> list[list[Import]]:
    """For each module under `forbidden` (and not under `allowed`) that a module under `sources` loads, directly or
    through others, module- or function-level, the shortest chain of imports that loads it. Loading a module runs
    its packages' __init__ first: those are walked too (never flagged themselves: `trainforge.infra` must run for
    `trainforge.infra.storage`). Third-party modules are leaves (their own imports are not scanned)."""
    forbidden, allowed = tuple(forbidden), tuple(allowed)
    starts = sorted(m for m in graph if _within(m, sources))
    came_from: dict[str, Import] = {}
    frontier, seen = list(starts), set(starts)
    hits: list[str] = []
    while frontier:
        following = []
        for module in frontier:
            implicit = [Import(module, 0, package, False, False) for package in _packages_of(module, graph)]
            for imp in [*graph.get(module, []), *implicit]:
                if imp.target in seen:
                    continue
                seen.add(imp.target)
                came_from[imp.target] = imp
                if imp.line and _within(imp.target, forbidden) and not _within(imp.target, allowed):
                    hits.append(imp.target)  # report it; don't walk on through it (its own deps are its rules)
                elif imp.target in graph:
                    following.append(imp.target)
        frontier = following
    chains = []
    for hit in sorted(hits):
        chain, node = [], hit
        while node in came_from:
            chain.append(came_from[node])
            node = came_from[node].importer
        chains.append(chain[::-1])
    return chains


def disallowed_imports(graph: Mapping[str, list[Import]], sources: Iterable[str],
                       allowed: Iterable[str]) -> list[Import]:
    """Direct imports of trainforge modules outside `allowed` by modules under `sources`."""
    allowed = tuple(allowed)
    return [imp for module, imports in graph.items() if _within(module, sources)
            for imp in imports if imp.target in graph and not _within(imp.target, allowed)]


def _chains(chains: list[list[Import]]) -> str:
    return "\n".join("  " + " -> ".join(str(imp) for imp in chain) for chain in chains)


def _lines(imports: list[Import]) -> str:
    return "\n".join(f"  {imp}" for imp in imports)


@pytest.fixture(scope="module")
def graph() -> dict[str, list[Import]]:
    return scan()


def test_the_scan_sees_the_whole_package(graph):
    """Guards against a scan that silently reads nothing (a moved package dir would make every rule pass)."""
    assert len(graph) > 100, sorted(graph)
    assert "trainforge.trainer.loop" in graph and "trainforge.cli" in graph
    assert sum(len(imports) for imports in graph.values()) > 500


def test_no_import_cycle(graph):
    cycles = find_cycles(graph)
    assert not cycles, ("import cycles in trainforge/ (module:line imports module, round the cycle); move the "
                        "piece both need into a module below them:\n" + _chains(cycles))


def test_nothing_below_tasks_flows_commands_imports_them(graph):
    bad = upward_imports(graph)
    assert not bad, ("modules below tasks/flows/commands/cli import them; move the helper they need down:\n"
                     + _lines(bad))


def test_trainer_reaches_no_control_plane_module(graph):
    chains = reachable_violations(graph, TRAINER, CONTROL_PLANE, BELOW_BOTH)
    assert not chains, ("the trainer (trainer/, runtime.py) loads control-plane modules (of infra/ and registry/ it "
                        f"may load only {', '.join(BELOW_BOTH)}); the chains of imports that do it:\n"
                        + _chains(chains))


def test_contract_imports_only_spec_plan_and_storage(graph):
    direct = disallowed_imports(graph, CONTRACT, CONTRACT_MAY_IMPORT)
    assert not direct, ("contract/ may import only trainforge.spec, trainforge.plan, trainforge.infra.storage "
                        "(and pydantic / stdlib):\n" + _lines(direct))
    chains = reachable_violations(graph, CONTRACT, (*CONTROL_PLANE, *TRAINER, *CONTRACT_NO_THIRD_PARTY), BELOW_BOTH)
    assert not chains, "contract/ reaches the trainer, torch or the control plane:\n" + _chains(chains)


def test_pure_layers_import_only_each_other(graph):
    bad = disallowed_imports(graph, PURE, PURE)
    assert not bad, "spec.py and plan/ are the pure bottom layer; they import only each other:\n" + _lines(bad)


# ------------------------------------------------------------------ the checker itself can fail


def _synthetic(sources: dict[str, str], package: str = "pkg") -> dict[str, list[Import]]:
    """A graph from in-memory sources: {"pkg.mod": source}; a name that has children is a package."""
    modules = dict.fromkeys(sources)
    return {name: parse_imports(name, source, modules=modules, package=package,
                                is_package=any(other.startswith(name + ".") for other in sources))
            for name, source in sources.items()}


def test_checker_finds_a_cycle_through_a_function_level_relative_import():
    graph = _synthetic({
        "pkg": "",
        "pkg.a": "from pkg import b\n",
        "pkg.b": "import pkg.c as c\n",
        "pkg.c": "def later():\n    from . import a\n",
    })
    cycles = find_cycles(graph)
    assert len(cycles) == 1
    assert [(imp.importer, imp.target) for imp in cycles[0]] == [
        ("pkg.a", "pkg.b"), ("pkg.b", "pkg.c"), ("pkg.c", "pkg.a")]
    assert cycles[0][2].line == 2 and cycles[0][2].function_level
    assert "pkg.c:2 imports pkg.a" in _chains(cycles)


def test_checker_counts_typing_only_imports():
    graph = _synthetic({
        "pkg": "",
        "pkg.engine": "def run():\n    from pkg.report import summarize\n",
        "pkg.report": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.engine import Sim\n",
    })
    (cycle,) = find_cycles(graph)
    assert [(imp.importer, imp.line, imp.typing_only) for imp in cycle] == [
        ("pkg.engine", 2, False), ("pkg.report", 3, True)]


def test_checker_flags_upward_and_transitive_control_plane_imports():
    graph = _synthetic({
        "trainforge": "",
        "trainforge.tasks": "",
        "trainforge.tasks.prepare": "def make_plan(): ...\n",
        "trainforge.infra": "",
        "trainforge.infra.k8s": "",
        "trainforge.infra.k8s.job": "def render():\n    from trainforge.tasks.prepare import make_plan\n",
        "trainforge.trainer": "",
        "trainforge.trainer.loop": "from trainforge import helpers\n",
        "trainforge.helpers": "from .registry.tracking import Tracker\n",
        "trainforge.registry": "",
        "trainforge.registry.tracking": "",
        "trainforge.registry.manifest": "",
        "trainforge.infra.storage": "from trainforge.registry import manifest\n",
        "trainforge.trainer.checkpoint": "from trainforge.infra.storage import open_store\n",
        "trainforge.contract": "",
        "trainforge.contract.config": "import torch\nfrom trainforge.trainer import loop\n",
        "trainforge.plan": "from trainforge.infra.k8s import job\n",
    }, package="trainforge")
    assert [str(imp) for imp in upward_imports(graph)] == [
        "trainforge.infra.k8s.job:2 imports trainforge.tasks.prepare"]
    chains = reachable_violations(graph, TRAINER, CONTROL_PLANE, BELOW_BOTH)  # storage and manifest are fine
    assert [[str(imp) for imp in chain] for chain in chains] == [[
        "trainforge.trainer.loop:1 imports trainforge.helpers",
        "trainforge.helpers:1 imports trainforge.registry.tracking"]]
    # A package's __init__ runs before its modules: what it imports is loaded too.
    graph["trainforge.infra"] = parse_imports("trainforge.infra", "from .k8s import job\n", is_package=True,
                                              modules=graph, package="trainforge")
    chains = reachable_violations(graph, ["trainforge.trainer.checkpoint"], CONTROL_PLANE, BELOW_BOTH)
    assert [[str(imp) for imp in chain] for chain in chains] == [[
        "trainforge.trainer.checkpoint:1 imports trainforge.infra.storage",
        "trainforge.infra.storage runs its package trainforge.infra",
        "trainforge.infra:1 imports trainforge.infra.k8s.job"]]
    assert [str(imp) for imp in disallowed_imports(graph, CONTRACT, CONTRACT_MAY_IMPORT)] == [
        "trainforge.contract.config:2 imports trainforge.trainer.loop"]
    torch_chains = reachable_violations(graph, CONTRACT, (*TRAINER, *CONTRACT_NO_THIRD_PARTY))
    assert {chain[-1].target for chain in torch_chains} == {"torch", "trainforge.trainer.loop"}
    assert [str(imp) for imp in disallowed_imports(graph, PURE, PURE)] == [
        "trainforge.plan:1 imports trainforge.infra.k8s.job"]
