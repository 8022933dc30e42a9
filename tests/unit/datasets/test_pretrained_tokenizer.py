"""A pretrained Hugging Face tokenizer.json as a dataset's tokenizer (`datasets build --tokenizer PATH`): the file is
used as it is (documents encoded [BOS] ids EOS by the tokenizers library, in the parallel workers), saved with the
version, its content digest part of the version id, carried by a remote catalog, recorded in lineage; a job that
names a tokenizer (`dataset.tokenizer`), or starts from a Hugging Face folder shipping one, is refused before
anything is allocated when its data was tokenized otherwise. The tokenizers here are made by the tokenizers library
in the test (no download): a Llama-2-like one (<unk> <s> </s>, a template that adds <s>) and a GPT-2-like one
(<|endoftext|> only).

Run: .venv/bin/python -m pytest tests/unit/datasets/test_pretrained_tokenizer.py -q
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.made_tokenizers import DOCS, make_tokenizer
from trainforge.datasets import tokenizer
from trainforge.datasets.build import BuildConfig, BuildError, build_dataset, build_version_dir
from trainforge.datasets.catalog import EmbeddedCatalog
from trainforge.datasets.quality import run_gate
from trainforge.datasets.shards import ShardReader
from trainforge.registry.lineage import LineageStore, dataset_files_of
from trainforge.spec import parse_spec
from trainforge.tasks.prepare import JobRejected, resolve_dataset
from trainforge.validate import validate_document

tokenizers = pytest.importorskip("tokenizers")

MODEL = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=96, vocab=512)


def _jsonl(path: Path) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    return path


def _cfg(tok: Path | str, **kw) -> BuildConfig:
    return BuildConfig(**{"license": "MIT", "seq_len": 31, "tokenizer": str(tok), "docs_per_task": 16,
                          "num_workers": 1, **kw})


@pytest.mark.parametrize("workers", [1, 2])
def test_a_pretrained_tokenizer_json_tokenizes_the_version_as_it_is(tmp_path, workers):
    folder = tmp_path / "llama-folder"  # the folder is named, as with `--tokenizer ./llama-folder/`
    text = make_tokenizer(folder / "tokenizer.json")
    ds = build_dataset(_jsonl(tmp_path / "a.jsonl"), "chat", _cfg(folder, num_workers=workers))
    m = ds.manifest
    assert m.tokenizer == tokenizer.pretrained_id(text) and tokenizer.is_pretrained(m.tokenizer)
    assert (ds.path / tokenizer.TOKENIZER_FILE).read_text() == text  # byte for byte: the digest is of this file
    hf = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    bos, eos = hf.token_to_id("<s>"), hf.token_to_id("</s>")
    want = tokenizer.pack([np.array([bos, *hf.encode(d, add_special_tokens=False).ids, eos], np.uint16)
                           for d in DOCS], 32)
    got = ShardReader(ds.path, m).get(range(m.num_samples))
    np.testing.assert_array_equal(got, want)  # one <s> per document: the file's template was not applied on top
    enc = tokenizer.load_tokenizer(ds.path)
    assert (enc.bos, enc.eos, m.vocab_size, m.token_dtype) == (bos, eos, hf.get_vocab_size(), "uint16")
    assert enc.decode(enc.encode(DOCS[7])).strip() == DOCS[7]
    assert run_gate(ds)["passed"]


def test_a_tokenizer_without_begin_of_text_pads_with_its_end_of_text(tmp_path):
    make_tokenizer(tmp_path / "gpt2" / "tokenizer.json", specials=("<|endoftext|>",))
    ds = build_version_dir(_jsonl(tmp_path / "a.jsonl"), tmp_path / "v", "v", _cfg(tmp_path / "gpt2" / "tokenizer.json",
                                                                              pack=False, seq_len=63))
    enc = tokenizer.load_tokenizer(ds.path)
    assert enc.bos is None and enc.pad == enc.eos == 0
    rows = ShardReader(ds.path, ds.manifest).get([0, 1])
    first = enc.encode(DOCS[0])
    assert first[0] != enc.eos and first[-1] == enc.eos  # ids then end-of-text, nothing before
    np.testing.assert_array_equal(rows[0][: len(first)], first)
    assert (rows[0][len(first):] == enc.eos).all()  # --no-pack pads with the end-of-text id
    assert tokenizer.pad_id(ds.manifest.tokenizer, ds.path) == enc.eos
    assert run_gate(ds)["passed"]


def test_the_file_is_kept_byte_for_byte_and_its_digest_is_of_those_bytes(tmp_path):
    import hashlib

    make_tokenizer(tmp_path / "lf" / "tokenizer.json")
    crlf = (tmp_path / "lf" / "tokenizer.json").read_bytes().replace(b"\n", b"\r\n")  # written on Windows
    (tmp_path / "crlf").mkdir()
    (tmp_path / "crlf" / "tokenizer.json").write_bytes(crlf)
    ds = build_version_dir(_jsonl(tmp_path / "a.jsonl"), tmp_path / "v", "v", _cfg(tmp_path / "crlf"))
    assert ds.manifest.tokenizer == "hf:sha256:" + hashlib.sha256(crlf).hexdigest()
    assert (ds.path / tokenizer.TOKENIZER_FILE).read_bytes() == crlf
    assert tokenizer.load_tokenizer(ds.path).vocab_size == ds.manifest.vocab_size  # still matches its id


def test_special_ids_and_the_vocabulary_size_are_the_library_s(tmp_path):
    # An added token whose id in the JSON is not the one the library gives it: the library's id is the one that
    # ends documents, and the vocabulary size counts the ids the library really has
    make_tokenizer(tmp_path / "t" / "tokenizer.json")
    doc = json.loads((tmp_path / "t" / "tokenizer.json").read_text())
    eos = next(t for t in doc["added_tokens"] if t["content"] == "</s>")
    eos["id"] = 500
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "tokenizer.json").write_text(json.dumps(doc))
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "odd" / "tokenizer.json"))
    ds = build_version_dir(_jsonl(tmp_path / "a.jsonl"), tmp_path / "v", "v", _cfg(tmp_path / "odd"))
    enc = tokenizer.load_tokenizer(ds.path)
    assert enc.eos == hf.token_to_id("</s>")
    assert ds.manifest.vocab_size == max(hf.get_vocab(with_added_tokens=True).values()) + 1
    rows = ShardReader(ds.path, ds.manifest).get(range(ds.manifest.num_samples))
    assert rows.max() < ds.manifest.vocab_size and (rows == enc.eos).any()


def test_the_tokenizer_content_is_part_of_the_version_id(tmp_path):
    src = _jsonl(tmp_path / "a.jsonl")
    make_tokenizer(tmp_path / "a" / "tokenizer.json")
    shutil.copytree(tmp_path / "a", tmp_path / "elsewhere")
    make_tokenizer(tmp_path / "b" / "tokenizer.json", vocab=300)
    a = build_dataset(src, "ids", _cfg(tmp_path / "a"))
    assert build_dataset(src, "ids", _cfg(tmp_path / "elsewhere", num_workers=2, docs_per_task=5)).version == a.version
    assert build_dataset(src, "ids", _cfg(tmp_path / "b")).version != a.version  # another vocabulary
    assert build_dataset(src, "ids", _cfg("byte")).version != a.version


def test_a_remote_catalog_carries_the_tokenizer_and_lineage_records_it(tmp_path):
    from trainforge.infra.storage import LocalObjectStore

    text = make_tokenizer(tmp_path / "tok" / "tokenizer.json")
    store = LocalObjectStore(tmp_path / "bucket").scoped("teams/nlp/datasets")
    remote = EmbeddedCatalog(store=store, prefix="teams/nlp/datasets")
    ds = build_dataset(_jsonl(tmp_path / "a.jsonl"), "chat", _cfg(tmp_path / "tok"), catalog=remote)
    assert store.exists(f"teams/nlp/datasets/chat/versions/{ds.version}/{tokenizer.TOKENIZER_FILE}")
    again = EmbeddedCatalog(store=store, prefix="teams/nlp/datasets").resolve("chat", ds.version)
    assert tokenizer.load_tokenizer(again.path).vocab_size == ds.manifest.vocab_size  # materialized, checked

    manifest = json.loads((again.path / "manifest.json").read_text())
    digest = tokenizer.pretrained_id(text).rsplit(":", 1)[1]
    assert (f"{again.path}/tokenizer.json", digest) in dataset_files_of(manifest, str(again.path))
    lineage = LineageStore()
    lineage.record_job("ft-1", team="nlp", dataset={"name": "chat", "version": ds.version, "license": "MIT",
                                                    "ref": "catalog://chat", "path": str(again.path)})
    node = lineage.node(f"dataset:chat@{ds.version}")
    assert node.attrs["tokenizer"] == ds.manifest.tokenizer


@pytest.mark.parametrize(("content", "reason"), [
    (None, "no such file"),
    ("{not json", "not a readable tokenizer.json"),
    ('{"version": "1.0"}', "no 'model' section"),
])
def test_an_unusable_tokenizer_file_is_a_build_error_naming_it(tmp_path, content, reason):
    path = tmp_path / "tokenizer.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(BuildError, match=reason):
        build_dataset(_jsonl(tmp_path / "a.jsonl"), "bad", _cfg(path))


def test_a_tokenizer_with_no_end_of_text_token_is_refused(tmp_path):
    make_tokenizer(tmp_path / "t" / "tokenizer.json", specials=("<unk>", "<mask>"))
    with pytest.raises(BuildError, match="no end-of-text special token"):
        build_dataset(_jsonl(tmp_path / "a.jsonl"), "bad", _cfg(tmp_path / "t"))
    assert EmbeddedCatalog().names() == []  # nothing was committed


def test_the_cli_builds_with_a_tokenizer_path_and_names_a_missing_one(tmp_path, _isolated_home):
    make_tokenizer(tmp_path / "folder" / "tokenizer.json")
    src = _jsonl(tmp_path / "a.jsonl")
    cli = [sys.executable, "-m", "trainforge", "datasets", "build", str(src), "--license", "MIT", "--seq-len", "31",
           "--workers", "1", "--json"]
    ok = subprocess.run([*cli, "--out", "catalog://chat", "--tokenizer", str(tmp_path / "folder")],
                        capture_output=True, text=True, timeout=180)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert json.loads(ok.stdout)["tokenizer"].startswith("hf:sha256:")
    bad = subprocess.run([*cli, "--out", "catalog://other", "--tokenizer", str(tmp_path / "nope.json")],
                         capture_output=True, text=True, timeout=180)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert bad.returncode == 2 and "nope.json' is not byte, bpe or the path of a" in json.loads(bad.stdout)["error"]
    assert EmbeddedCatalog().names() == ["chat"]


# ------------------------------------------------------------------------------------ the job's side

def _doc(**dataset) -> dict:
    return {
        "name": "tok-check", "team": "t",
        "code": {"entrypoint": "trainforge.trainer.models.llama:build_model", "mode": "managed"},
        "dataset": {"ref": "catalog://chat@main", **dataset},
        "resources": {"gpu_type": "cpu", "min_gpus": 1, "gpus_per_node": 1},
        "model": MODEL,
        "training": {"max_steps": 2, "global_batch_size": 2, "seq_len": 16, "precision": "fp32"},
    }


def _hf_folder(folder: Path, with_tokenizer: Path | None) -> Path:
    """config.json as transformers writes it for the spec's model (validate reads only that), and a tokenizer."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": MODEL["vocab"],
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False}))
    if with_tokenizer is not None:
        shutil.copy(with_tokenizer, folder / "tokenizer.json")
    return folder


def _gated(ds) -> None:
    """Store the version's quality report, as `trainforge datasets build` does (a job resolves only a version
    whose report passed). DOCS repeat a few sentences (~79% distinct samples): the gate here allows that."""
    from trainforge.datasets.quality import GateConfig

    report = run_gate(ds, cfg=GateConfig(max_duplicate_rate=0.5))
    assert report["passed"], report["failures"]
    EmbeddedCatalog().put_quality(ds.name, ds.version, report)


def _errors(doc: dict, base: Path, field: str) -> list[str]:
    report = validate_document(doc, "job.yaml", base_dir=base)
    return [p.render() for p in report.errors() if p.path == field]


def test_a_job_checks_its_data_was_tokenized_with_the_tokenizer_it_names(tmp_path):
    make_tokenizer(tmp_path / "spec" / "tok" / "tokenizer.json")
    make_tokenizer(tmp_path / "spec" / "other" / "tokenizer.json", vocab=300)
    _gated(build_dataset(_jsonl(tmp_path / "a.jsonl"), "chat", _cfg(tmp_path / "spec" / "tok"), ref="main"))
    base = tmp_path / "spec"
    assert _errors(_doc(tokenizer="tok"), base, "dataset.tokenizer") == []  # relative to the spec's folder
    assert _errors(_doc(tokenizer="tok/tokenizer.json"), base, "dataset.tokenizer") == []
    (wrong,) = _errors(_doc(tokenizer="other"), base, "dataset.tokenizer")
    assert "was tokenized with a pretrained tokenizer.json" in wrong
    assert f"--tokenizer {base / 'other' / 'tokenizer.json'}" in wrong  # resolved: the CLI reads it from any folder
    (byte,) = _errors(_doc(tokenizer="byte-level"), base, "dataset.tokenizer")
    assert "not the byte-level one" in byte
    (missing,) = _errors(_doc(tokenizer="gone.json"), base, "dataset.tokenizer")
    assert "gone.json: no such file" in missing

    spec = parse_spec(_doc(tokenizer="other"))
    with pytest.raises(JobRejected, match="dataset.tokenizer"):
        resolve_dataset(spec, base)  # submit checks too (every scheme), before the gang is provisioned
    assert resolve_dataset(parse_spec(_doc(tokenizer="tok")), base)["name"] == "chat"


def test_a_hugging_face_folder_s_tokenizer_must_be_the_data_s(tmp_path, _isolated_home):
    tok = tmp_path / "tok" / "tokenizer.json"
    make_tokenizer(tok)
    _gated(build_dataset(_jsonl(tmp_path / "a.jsonl"), "chat", _cfg(tok), ref="main"))
    _gated(build_dataset(_jsonl(tmp_path / "a.jsonl"), "bytes", _cfg("byte"), ref="main"))
    base = tmp_path / "spec"
    _hf_folder(base / "llama", with_tokenizer=tok)
    _hf_folder(base / "bare", with_tokenizer=None)
    assert _errors({**_doc(), "init_from": "llama/"}, base, "init_from") == []  # same tokenizer
    assert _errors({**_doc(), "init_from": "bare/"}, base, "init_from") == []  # the folder ships none
    byte_doc = {**_doc(), "init_from": "llama/"}
    byte_doc["dataset"] = {"ref": "catalog://bytes@main"}
    (clash,) = _errors(byte_doc, base, "init_from")
    assert "the built-in byte-level tokenizer" in clash and "another vocabulary" in clash
    assert "--tokenizer" in clash and "dataset.tokenizer" in clash
    byte_doc["dataset"]["tokenizer"] = "byte-level"  # said explicitly: the user's choice wins
    assert _errors(byte_doc, base, "init_from") == [] and _errors(byte_doc, base, "dataset.tokenizer") == []


def test_the_field_is_omitted_from_the_config_hash_when_unset():
    from trainforge.spec import SpecError, load_spec

    # the demo's hash before dataset.tokenizer existed: jobs submitted then still resume
    examples = Path(__file__).resolve().parents[3] / "examples"
    assert load_spec(examples / "tiny-cpu.yaml").config_hash() == (
        "9d61036ce320bf548267943c9aa97a4ffb357cd55465801e22a8df8d43ceb981")
    assert "tokenizer" not in parse_spec(_doc()).model_dump()["dataset"]
    assert parse_spec(_doc(tokenizer="tok")).config_hash() != parse_spec(_doc()).config_hash()
    for bad, reason in (("s3://bucket/tokenizer.json", "not a local file"), ("tok\0.json", "NUL byte"),
                        ("  ", "is empty")):
        with pytest.raises(SpecError, match=reason):
            parse_spec(_doc(tokenizer=bad))


def test_an_over_long_tokenizer_path_is_a_problem_not_a_crash(tmp_path):
    (problem,) = _errors(_doc(tokenizer="x" * 5000 + ".json"), tmp_path, "dataset.tokenizer")
    assert "is not a readable tokenizer.json" in problem or "no such file" in problem
