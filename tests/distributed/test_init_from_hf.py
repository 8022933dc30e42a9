"""`init_from` a Hugging Face Llama folder (tasks/init_folder.py): a folder that transformers itself wrote, local or
under an S3 prefix, becomes the one safetensors file the workers load, and trainforge's model computes the logits
transformers computes; a folder of another model is refused naming the spec's fields and the folder's numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.made_tokenizers import make_tokenizer
from trainforge.datasets.tokenizer import pretrained_id
from trainforge.spec import parse_spec
from trainforge.tasks.init_folder import FolderError, materialise
from trainforge.trainer.loop import load_init_weights
from trainforge.trainer.models.llama import build_model
from trainforge.validate import validate_document

pytestmark = pytest.mark.slow  # starts torchrun, workers or servers: `make test`, not `make test-fast`

transformers = pytest.importorskip("transformers")

MODEL = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=96, vocab=256)
CARD = "---\nlicense: apache-2.0\nlanguage: en\n---\n# a tiny Llama\n"


def _doc(init_from: str, **model: int) -> dict:
    return {
        "name": "tiny-hf-ft", "team": "t", "init_from": init_from,
        "code": {"entrypoint": "trainforge.trainer.models.llama:build_model", "mode": "managed"},
        "dataset": {"ref": "catalog://demo-text@main", "license": "PSF-2.0"},
        "resources": {"gpu_type": "cpu", "min_gpus": 1, "gpus_per_node": 1},
        "model": {**MODEL, **model},
        "training": {"max_steps": 2, "global_batch_size": 2, "seq_len": 32, "precision": "fp32"},
    }


def _spec(init_from: str, **model: int):
    return parse_spec(_doc(init_from, **model))


def _hf_folder(path: Path) -> torch.nn.Module:
    """A folder written by transformers' own save_pretrained (not by trainforge's exporter)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
    )
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(path, safe_serialization=True)
    (path / "README.md").write_text(CARD)
    return hf


def _assert_same_logits(hf: torch.nn.Module, weights: Path) -> None:
    ours = build_model({**MODEL, "experts": 0, "top_k": 0, "max_seq_len": 64}).eval()
    load_init_weights(ours, str(weights))
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=0, atol=1e-5)


def test_a_local_transformers_folder_loads_with_the_same_logits(tmp_path: Path) -> None:
    hf = _hf_folder(tmp_path / "tiny-llama")
    spec = _spec("./tiny-llama/")
    weights, got = materialise(spec, tmp_path, tmp_path / "run")
    assert weights == tmp_path / "run" / "model.safetensors" and not (tmp_path / "run" / "hf").exists()
    assert got.source == str((tmp_path / "tiny-llama").resolve()) and got.license == "apache-2.0"
    assert {name for name, _ in got.files} == {"config.json", "model.safetensors"} and len(got.sha256) == 64
    _assert_same_logits(hf, weights)
    _, again = materialise(spec, tmp_path, tmp_path / "run2")
    assert again.sha256 == got.sha256  # the content hash lineage records is a function of the files only


def test_an_s3_prefix_is_fetched_without_its_pickles(tmp_path: Path, s3_server, s3_env) -> None:
    hf = _hf_folder(tmp_path / "src")
    (tmp_path / "src" / "pytorch_model.bin").write_bytes(b"not to be read")
    bucket = s3_server.make_bucket()
    try:
        store = s3_server.store(bucket)
        for f in (tmp_path / "src").iterdir():
            store.put_file(f"models/tiny/{f.name}", f)
        spec = _spec(f"s3://{bucket}/models/tiny/")
        weights, got = materialise(spec, tmp_path, tmp_path / "run")
        assert got.source == f"s3://{bucket}/models/tiny/" and got.license == "apache-2.0"
        assert "pytorch_model.bin" not in {name for name, _ in got.files}
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["model.safetensors"]  # the copy is gone
        _assert_same_logits(hf, weights)
        with pytest.raises(FolderError, match="has no config.json"):
            materialise(_spec(f"s3://{bucket}/models/absent/"), tmp_path, tmp_path / "run3")
        # A folder shipping a tokenizer.json is fetched with it and checked against the data's tokenizer here,
        # at submit, since validate could not read the prefix
        text = make_tokenizer(tmp_path / "tok" / "tokenizer.json")
        store.put_file("models/tiny/tokenizer.json", tmp_path / "tok" / "tokenizer.json")
        with pytest.raises(FolderError, match="another vocabulary") as clash:
            materialise(spec, tmp_path, tmp_path / "run4", ("byte-level-v1", "dataset demo-text@0123"))
        assert "byte-level" in str(clash.value) and f"download s3://{bucket}/models/tiny/tokenizer.json" in str(clash.value)
        assert not (tmp_path / "run4" / "model.safetensors").exists()
        _, same = materialise(spec, tmp_path, tmp_path / "run5", (pretrained_id(text), "dataset chat@0123"))
        assert "tokenizer.json" in {name for name, _ in same.files}  # listed in lineage with the files read
        assert same.sha256 == got.sha256  # the weights' id is of config and weights: a tokenizer does not change it
    finally:
        s3_server.delete_bucket(bucket)


def test_a_folder_of_another_model_is_refused_by_field(tmp_path: Path) -> None:
    _hf_folder(tmp_path / "tiny-llama")
    with pytest.raises(FolderError) as exc:
        materialise(_spec(str(tmp_path / "tiny-llama"), hidden=128, layers=4), tmp_path, tmp_path / "run")
    message = str(exc.value)
    assert "hidden 128 here, 64 in the folder" in message and "layers 4 here, 2 in the folder" in message
    assert "set model: {" in message and not (tmp_path / "run" / "model.safetensors").exists()
    with pytest.raises(FolderError, match="has no config.json"):
        materialise(_spec(str(tmp_path)), tmp_path, tmp_path / "run")
    config = tmp_path / "tiny-llama" / "config.json"
    config.write_text(config.read_text().replace('"rope_theta": 10000.0', '"rope_theta": 500000.0'))
    with pytest.raises(FolderError, match="rope_theta"):
        materialise(_spec(str(tmp_path / "tiny-llama")), tmp_path, tmp_path / "run")


def test_validate_reads_a_local_folder_before_anything_runs(tmp_path: Path) -> None:
    _hf_folder(tmp_path / "tiny-llama")
    ok = validate_document(_doc("./tiny-llama/"), base_dir=tmp_path, dataset_checker=lambda *_: None)
    assert not [p for p in ok.problems if p.path == "init_from"], ok.problems
    bad = validate_document(_doc("./tiny-llama/", vocab=512), base_dir=tmp_path, dataset_checker=lambda *_: None)
    [problem] = [p for p in bad.problems if p.path == "init_from"]
    assert problem.severity == "error" and "vocab 512 here, 256 in the folder" in problem.message
    gone = validate_document(_doc("./elsewhere/"), base_dir=tmp_path, dataset_checker=lambda *_: None)
    assert [p.message for p in gone.problems if p.path == "init_from"][0].endswith("not a Hugging Face model folder")
    remote = validate_document(_doc("s3://b/m/"), base_dir=tmp_path, dataset_checker=lambda *_: None)
    assert [p.severity for p in remote.problems if p.path == "init_from"] == ["not-checked"]
