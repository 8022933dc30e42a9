"""The broken-spec table and helpers shared by the spec, validation and CLI tests.

Each `broken/*.yaml` opens with `# key: value` header lines; a `broken/*.json` spec has them in the sidecar
`*.expect` file (JSON has no comments). Keys:
  path      the exact field path of the expected problem
  message   a substring of its message
  fix       (optional) a substring of its fix text
  severity  (optional) error (default) or not-checked
  cluster   (optional) a cluster in examples/clusters/ (default: this machine)
  strict    (optional) true: the spec is only invalid under --strict
  stage     spec: the loader (parse_spec) rejects it; validate: only dry-run validation does
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
BROKEN = Path(__file__).resolve().parent / "broken"
EXAMPLES = REPO / "examples"
CLUSTERS = EXAMPLES / "clusters"


@dataclass(frozen=True)
class BrokenCase:
    file: Path
    path: str
    message: str
    fix: str = ""
    severity: str = "error"
    cluster: str | None = None
    strict: bool = False
    stage: str = "spec"

    @property
    def id(self) -> str:
        return self.file.name

    @property
    def cluster_file(self) -> Path | None:
        return CLUSTERS / f"{self.cluster}.yaml" if self.cluster else None


def _header(file: Path) -> dict[str, str]:
    lines = (file.with_suffix(".expect").read_text() if file.suffix == ".json" else file.read_text()).splitlines()
    out = {}
    for line in lines:
        text = line.removeprefix("# ") if file.suffix != ".json" else line
        if file.suffix != ".json" and not line.startswith("# "):
            break
        key, _, value = text.partition(": ")
        out[key.strip()] = value.strip()
    return out


def broken_cases(stage: str | None = None) -> list[BrokenCase]:
    cases = []
    for file in sorted([*BROKEN.glob("*.yaml"), *BROKEN.glob("*.json")]):
        h = _header(file)
        case = BrokenCase(file, h["path"], h["message"], h.get("fix", ""), h.get("severity", "error"),
                          h.get("cluster"), h.get("strict") == "true", h.get("stage", "spec"))
        if stage is None or case.stage == stage:
            cases.append(case)
    return cases


def build_demo_dataset(samples: int = 64, sample_len: int = 129) -> None:
    """A tiny `catalog://demo-text@main` in the embedded catalog ($TRAINFORGE_HOME is a per-test tmp dir)."""
    from trainforge.datasets.catalog import EmbeddedCatalog
    from trainforge.datasets.shards import write_shard

    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(samples, sample_len), dtype=np.uint16)
    catalog = EmbeddedCatalog()
    ds = catalog.commit("demo-text", lambda d: [write_shard(d / "shard-00000.arrow", data)],
                        sample_len=sample_len, token_dtype="uint16", vocab_size=260, tokenizer="bytes",
                        license="PSF-2.0")
    # A job resolves only a version whose quality report passed. The real gate where great-expectations is
    # installed; the pure test venvs (make test-pure) have none, and there the report says it is a stand-in.
    try:
        from trainforge.datasets.gate import run_and_store

        run_and_store(ds, catalog=catalog)
    except ImportError:
        catalog.put_quality(ds.name, ds.version, {"passed": True, "failures": [], "stand_in": "tests/specs/cases.py: "
                                                  "no great-expectations in this venv"})
