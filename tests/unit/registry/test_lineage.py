"""The lineage store on SQLite: nodes, edges, ancestry queries (direct, resume, fine-tuning), file/prefix and
license queries, the withdrawal + quarantine workflow, idempotent writes. The same suite runs on PostgreSQL in
tests/integration/test_lineage_postgres.py.

Run: .venv/bin/python -m pytest tests/unit/registry/test_lineage.py
"""

from __future__ import annotations

import pytest

from trainforge.registry.lineage import (
    LineageStore,
    QuarantinedError,
    dataset_files_of,
    license_class,
    parse_target,
)


def ds(name: str, version: str, license: str, files: list[str], source: str = "/corpus/src") -> dict:
    manifest = {"shards": [{"file": f, "sha256": f"sha-{name}-{f}"} for f in files],
                "provenance": {"source": source, "source_files": [f"{source}/a.txt", f"{source}/sub/b.txt"]}}
    return {"name": name, "version": version, "license": license, "ref": f"catalog://{name}", "path": f"/d/{name}/{version}",
            "manifest": manifest}


def build_graph(store: LineageStore) -> None:
    """web@v1 (CC-BY-NC) -> job A -> ckpt A@10, A@20 -> model m/1 (from A@20)
    code@v1 (MIT) -> job B fine-tuned from m/1 -> B@5 -> model m2/1; B resumed from B@5
    web@v2 (CC-BY-NC) -> job C -> C@10 (unrelated to A, B)"""
    store.record_job("A", team="nlp", dataset=ds("web", "v1aaaa", "CC-BY-NC-4.0", ["shard-0.arrow"]),
                     code_commit="abc", config_hash="h1")
    store.record_checkpoint("A", 10, team="nlp")
    store.record_checkpoint("A", 20, team="nlp")
    store.record_promotion("A", 20, "nlp.m", 1, team="nlp")
    store.record_job("B", team="nlp", dataset=ds("code", "v1cccc", "MIT", ["shard-0.arrow"], "/corpus/code"),
                     fine_tuned_from=parse_target("models:/nlp.m/1"))
    store.record_checkpoint("B", 5, team="nlp")
    store.record_resume("B", 5)
    store.record_checkpoint("B", 8, team="nlp")
    store.record_promotion("B", 8, "nlp.m2", 1, team="nlp")
    store.record_job("C", team="vision", dataset=ds("web", "v2bbbb", "CC-BY-NC-4.0", ["shard-9.arrow"], "/other"))
    store.record_checkpoint("C", 10, team="vision")


@pytest.fixture
def store(tmp_path) -> LineageStore:
    return LineageStore(f"sqlite:///{tmp_path / 'lineage.db'}")


def ids(nodes) -> set[str]:
    return {n.id for n in nodes}


def check_queries(store: LineageStore) -> None:
    build_graph(store)
    build_graph(store)  # idempotent: a retried task records the same things again

    # which datasets a model depends on: direct, and through its fine-tuning ancestry
    assert ids(store.datasets_of("models:/nlp.m/1")) == {"dataset:web@v1aaaa"}
    deps = store.datasets_of("models:/nlp.m2/1")
    assert ids(deps) == {"dataset:web@v1aaaa", "dataset:code@v1cccc"}
    assert {d.license_class for d in deps} == {"non-commercial", "permissive"}
    assert ids(store.datasets_of("B@8")) == ids(deps)

    # what was trained on web@v1, directly or through fine-tuning; nothing from web@v2
    result = store.trained_on("web", "v1aaaa")
    assert ids(result["affected"]) == {"checkpoint:A@10", "checkpoint:A@20", "checkpoint:B@5", "checkpoint:B@8",
                                       "model:nlp.m/1", "model:nlp.m2/1"}
    # any version of web: adds C
    assert "checkpoint:C@10" in ids(store.trained_on("web")["affected"])
    # by a version prefix
    assert ids(store.trained_on("web", "v2")["datasets"]) == {"dataset:web@v2bbbb"}
    # by contained file: exact source file, folder prefix, glob, shard sha256
    assert ids(store.find_datasets(file="/corpus/src/sub/b.txt")) == {"dataset:web@v1aaaa"}
    assert ids(store.find_datasets(file="/corpus/")) == {"dataset:web@v1aaaa", "dataset:code@v1cccc"}
    assert ids(store.find_datasets(file="/corpus/src")) == {"dataset:web@v1aaaa"}
    assert ids(store.find_datasets(file="*/shard-9.arrow")) == {"dataset:web@v2bbbb"}
    assert ids(store.find_datasets(file="sha-code-shard-0.arrow")) == {"dataset:code@v1cccc"}
    assert ids(store.trained_on(file="/corpus/code/a.txt")["affected"]) == {"checkpoint:B@5", "checkpoint:B@8",
                                                                            "model:nlp.m2/1"}
    assert store.find_datasets(file="/nowhere/") == []

    # runs by license class, id or glob
    assert ids(store.runs_by_license("non-commercial")["jobs"]) == {"job:A", "job:B", "job:C"}
    assert ids(store.runs_by_license("MIT")["jobs"]) == {"job:B"}
    assert ids(store.runs_by_license("CC-BY-NC*")["jobs"]) == {"job:A", "job:B", "job:C"}
    assert store.runs_by_license("copyleft")["jobs"] == []

    # removal: withdraw web@v1 and quarantine what was trained on it
    with pytest.raises(ValueError, match="why"):
        store.withdraw_dataset("web", "v1aaaa", why=" ")
    store.check_usable("models:/nlp.m2/1")  # fine before
    result = store.withdraw_dataset("web", "v1aaaa", who="legal-bot", why="takedown #12", quarantine=True)
    assert {n.status for n in result["affected"]} == {"quarantined"}
    assert store.node("dataset:web@v1aaaa").status == "withdrawn"
    with pytest.raises(QuarantinedError, match="takedown #12"):
        store.check_usable("models:/nlp.m2/1")
    with pytest.raises(QuarantinedError):
        store.check_usable("A@10")
    store.check_usable("C@10")  # web@v2 is not withdrawn
    history = store.history("model:nlp.m2/1")
    assert history[-1]["who"] == "legal-bot" and "takedown #12" in history[-1]["why"]
    with pytest.raises(LookupError):
        store.withdraw_dataset("web", "zzz", why="x")


def test_queries_sqlite(store):
    check_queries(store)


def test_unknown_parent_and_edge_kinds(store):
    with pytest.raises(LookupError, match="record it first"):
        store.record_job("X", team="t", dataset=ds("d", "v", "MIT", []), fine_tuned_from="model:nope/1")
    with pytest.raises(LookupError, match="record it first"):
        store.record_checkpoint("never-recorded", 1)
    with pytest.raises(LookupError):
        store.datasets_of("models:/nope/3")


@pytest.mark.parametrize(("lic", "cls"), [("MIT", "permissive"), ("Apache-2.0", "permissive"),
                                          ("PSF-2.0", "permissive"), ("CC0-1.0", "public-domain"),
                                          ("CC-BY-4.0", "permissive"), ("CC-BY-NC-SA-4.0", "non-commercial"),
                                          ("CC-BY-SA-4.0", "copyleft"), ("GPL-3.0-only", "copyleft"),
                                          ("proprietary", "proprietary"), ("WTFPL-ish", "unknown")])
def test_license_class(lic, cls):
    assert license_class(lic) == cls


@pytest.mark.parametrize(("text", "node"), [("models:/nlp.m/3", "model:nlp.m/3"), ("nlp.m/3", "model:nlp.m/3"),
                                            ("job-1@40", "checkpoint:job-1@40"), ("job-1", "job:job-1"),
                                            ("dataset:web@v1", "dataset:web@v1")])
def test_parse_target(text, node):
    assert parse_target(text) == node


def test_dataset_files_of():
    out = dataset_files_of({"shards": [{"file": "s0.arrow", "sha256": "x"}],
                            "provenance": {"source": "/data/raw", "files": 3, "source_files": ["/data/raw/a"]}},
                           "/root/ds/v1")
    assert out == [("/data/raw", ""), ("/data/raw/a", ""), ("/root/ds/v1/s0.arrow", "x")]


def test_default_url_in_home(monkeypatch, tmp_path):
    monkeypatch.delenv("TRAINFORGE_LINEAGE_URL", raising=False)
    store = LineageStore()
    assert store.url.startswith("sqlite:///") and store.url.endswith("lineage.db")


def test_withdrawal_record_and_trained_on_report(store):
    """Who withdrew a version, when and why; trained-on rows give each model's checkpoint, marked withdrawn."""
    build_graph(store)
    store.record_checkpoint("A", 20, team="nlp", attrs={"prefix": "jobs/A/ckpt/step-20"})
    assert store.withdrawal("web", "v1aaaa") is None
    before = store.trained_on_report("web", "v1aaaa")
    assert {r["withdrawn"] for r in before["affected"]} == {""}
    store.withdraw_dataset("web", "v1aaaa", who="legal-bot", why="takedown #12")
    w = store.withdrawal("web", "v1aaaa")
    assert w is not None and (w.who, w.why, w.dataset) == ("legal-bot", "takedown #12", "dataset:web@v1aaaa")
    assert w.when().endswith("UTC") and w.at > 0
    assert store.withdrawal("web", "v2bbbb") is None and store.withdrawal("web", "nope") is None

    report = store.trained_on_report("web", "v1aaaa")
    assert [(d["id"], d["withdrawn_by"], d["withdrawn_why"]) for d in report["datasets"]] == [
        ("dataset:web@v1aaaa", "legal-bot", "takedown #12")]
    rows = {r["id"]: r for r in report["affected"]}
    assert rows["model:nlp.m/1"]["checkpoint"] == "A@20"
    assert rows["model:nlp.m/1"]["prefix"] == "jobs/A/ckpt/step-20"
    assert rows["model:nlp.m2/1"]["checkpoint"] == "B@8"  # fine-tuned from m/1: trained on web@v1 too
    assert rows["checkpoint:A@10"]["checkpoint"] == "A@10"
    assert {r["withdrawn"] for r in rows.values()} == {"web@v1aaaa"}
    # not quarantined, yet refused for promotion: check_usable follows the ancestry to the withdrawn version
    assert {r["status"] for r in rows.values()} == {"active"}
    with pytest.raises(QuarantinedError, match="takedown #12"):
        store.check_usable("models:/nlp.m2/1")
    # web@v2 was not withdrawn: its rows carry no mark
    assert {r["withdrawn"] for r in store.trained_on_report("web", "v2")["affected"]} == {""}


def test_withdrawn_tags():
    from trainforge.registry.lineage import Withdrawal
    from trainforge.registry.lineage_withdrawal import WITHDRAWN_TAG, withdrawn_tags

    assert withdrawn_tags([]) == {}
    old = Withdrawal("dataset:web@v1", "web", "v1", "a", "old reason", 100.0)
    new = Withdrawal("dataset:code@v3", "code", "v3", "b", "x" * 900, 200.0)
    tags = withdrawn_tags([old, new])
    assert tags[WITHDRAWN_TAG] == "code@v3,web@v1"
    assert tags[f"{WITHDRAWN_TAG}_by"] == "b" and len(tags[f"{WITHDRAWN_TAG}_why"]) == 500
    assert tags[f"{WITHDRAWN_TAG}_at"] == "1970-01-01 00:03:20 UTC"


def test_outside_weights_are_a_node_with_their_license_and_files(store: LineageStore) -> None:
    """init_from a Hugging Face folder: the weights node carries the card's license and the files read, and what is
    fine-tuned from it finds it upstream (a legal query) while it finds them downstream."""
    files = [("s3://b/llama/config.json", "c" * 64), ("s3://b/llama/model.safetensors", "w" * 64)]
    node = store.record_weights("s3://b/llama/", "f" * 64, license="llama2", file_list=files)
    assert store.record_weights("s3://b/llama/", "f" * 64, license="llama2", file_list=files) == node  # retried
    assert node != store.record_weights("s3://b/llama/", "e" * 64)  # other content at the same place: another node
    store.record_job("FT", team="nlp", dataset=ds("code", "v1cccc", "MIT", ["shard-0.arrow"]), fine_tuned_from=node)
    store.record_checkpoint("FT", 4, team="nlp")
    store.record_promotion("FT", 4, "nlp.ft", 1, team="nlp")
    [weights] = [n for n in store.upstream("model:nlp.ft/1") if n.kind == "weights"]
    assert weights.id == node and weights.license == "llama2"
    assert {"job:FT", "checkpoint:FT@4", "model:nlp.ft/1"} <= ids(store.downstream([node]))
