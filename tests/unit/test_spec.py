"""The JobSpec loader (`trainforge.spec`): schema-stage broken specs raise SpecError naming the field, value and
fix; secrets are refused and never echoed; YAML/JSON reading is strict (duplicate keys, alias bombs, recursion);
and a hypothesis property test shows that random documents produce only SpecError with a readable message.

Run: .venv/bin/python -m pytest tests/unit/test_spec.py -q
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.specs.cases import EXAMPLES, BrokenCase, broken_cases
from trainforge.spec import (
    JobSpec,
    Priority,
    Problem,
    SpecError,
    is_weights_folder,
    json_schema,
    load_spec,
    looks_like_secret,
    parse_spec,
    parse_text,
    read_document,
    secretish_key,
    weights_folder_location,
)
from trainforge.validate import validate_document

EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))
TINY = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())


def _problems(doc) -> list[Problem]:
    with pytest.raises(SpecError) as info:
        parse_spec(doc, "test.yaml")
    return info.value.problems


# ------------------------------------------------------------------------------------------- table


@pytest.mark.parametrize("case", broken_cases("spec"), ids=lambda c: c.id)
def test_loader_rejects_broken_spec(case: BrokenCase):
    with pytest.raises(SpecError) as info:
        load_spec(case.file)
    err = info.value
    assert err.source == str(case.file) and not err.unreadable
    matches = [p for p in err.problems if p.path == case.path and case.message in p.message]
    assert matches, f"{case.id}: expected {case.path}: {case.message!r} in\n{err}"
    assert case.fix in matches[0].fix and matches[0].fix
    assert str(case.file) in str(err) and case.path in str(err)


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_examples_parse(path):
    spec = load_spec(path)
    assert spec.name == path.stem
    assert spec.training.total_steps >= 1


def test_defaults_and_properties():
    spec = parse_spec(TINY)
    assert spec.priority is Priority.NORMAL and Priority.CRITICAL.rank > Priority.PREEMPTIBLE.rank
    assert spec.resources.world_size == 2 and not spec.resources.elastic
    assert spec.max_runtime_s == 30 * 60
    doc = copy.deepcopy(TINY)
    doc["training"].pop("max_steps")
    doc["training"]["max_tokens"] = 16 * 128 * 10 + 1
    assert parse_spec(doc).training.total_steps == 11


def test_config_hash_is_stable_and_sensitive():
    a, b = parse_spec(TINY), parse_spec(copy.deepcopy(TINY))
    assert a.config_hash() == b.config_hash() and len(a.config_hash()) == 64
    doc = copy.deepcopy(TINY)
    doc["training"]["seed"] = 1
    assert parse_spec(doc).config_hash() != a.config_hash()


def test_spec_is_frozen():
    spec = parse_spec(TINY)
    with pytest.raises(ValueError):
        spec.name = "other"  # type: ignore[misc]


def test_yaml_and_json_give_the_same_spec(tmp_path):
    (tmp_path / "job.json").write_text(json.dumps(TINY, indent="\t"))  # tabs: not valid YAML indentation
    assert load_spec(tmp_path / "job.json") == parse_spec(TINY)


def test_all_problems_at_once():
    doc = copy.deepcopy(TINY)
    doc["name"] = "BAD NAME"
    doc["resources"]["gpu_type"] = "tpu"
    doc["training"]["seq_len"] = 1
    doc["priority"] = "asap"
    paths = {p.path for p in _problems(doc)}
    assert paths == {"name", "resources.gpu_type", "training.seq_len", "priority"}


def test_empty_and_scalar_documents():
    assert _problems(None)[0].message == "the document is empty"
    assert "not a str" in _problems("just text")[0].message


def test_non_text_keys_are_named():
    doc = copy.deepcopy(TINY)
    doc["labels"] = {2026: "year"}
    problem = next(p for p in _problems(doc) if p.path == "labels.2026")
    assert "must be text" in problem.message and "quote the key" in problem.fix


def test_union_errors_are_merged():
    doc = copy.deepcopy(TINY)
    doc["resources"]["max_gpus"] = "many"
    problems = [p for p in _problems(doc) if p.path == "resources.max_gpus"]
    assert len(problems) == 1 and "None" not in problems[0].message


# ------------------------------------------------------------------------------------------ secrets


@pytest.mark.parametrize("key", ["HF_TOKEN", "db_password", "apiKey", "AWS_SECRET_ACCESS_KEY", "github-token",
                                 "private_key", "MLFLOW_TRACKING_PASSWORD", "credentials"])
def test_secretish_keys(key):
    assert secretish_key(key)


@pytest.mark.parametrize("key", ["TOKENIZERS_PARALLELISM", "max_tokens", "keyboard", "monkey", "secretary_name",
                                 "OMP_NUM_THREADS", "tokenizer"])
def test_ordinary_keys_are_not_secrets(key):
    assert not secretish_key(key)


def test_ordinary_env_passes():
    doc = copy.deepcopy(TINY)
    doc["env"] = {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    assert parse_spec(doc).env["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize("value", ["AKIAIOSFODNN7EXAMPLE", "hf_" + "a" * 34, "sk-" + "b" * 40, "ghp_" + "c" * 36,
                                   "xoxb-1234567890-abc", "-----BEGIN RSA PRIVATE KEY-----",
                                   "https://user:pa55word@host/x"])
def test_credential_values(value):
    assert looks_like_secret(value)


def test_secret_values_never_appear_in_errors():
    secret = "hf_" + "Z9y8X7w6V5u4T3s2R1q0" * 2
    doc = copy.deepcopy(TINY)
    doc["env"] = {"HF_TOKEN": secret, "BAD-NAME": secret}
    doc["code"]["args"] = [secret]
    doc["dataset"]["ref"] = f"https://me:{secret}@example.com/data"  # also a bad scheme
    doc["extra_section"] = {"password": secret}  # unknown field holding a secret
    doc["secrets"] = [{"name": "hf", "env": "HF_TOKEN", "value": secret}]
    with pytest.raises(SpecError) as info:
        parse_spec(doc)
    text = str(info.value) + json.dumps([p.to_dict() for p in info.value.problems])
    assert secret not in text and "Z9y8X7" not in text
    paths = {p.path for p in info.value.problems}
    assert {"env.HF_TOKEN", "code.args[0]", "dataset.ref", "extra_section.password", "secrets[0].value"} <= paths


def test_secret_reference_is_accepted():
    doc = copy.deepcopy(TINY)
    doc["secrets"] = [{"name": "nlp/hf-token", "env": "HF_TOKEN"}]
    assert parse_spec(doc).secrets[0].env == "HF_TOKEN"


def test_secret_env_may_not_shadow_plain_env():
    doc = copy.deepcopy(TINY)
    doc["secrets"] = [{"name": "nlp/hf-token", "env": "HF_HOME"}]
    doc["env"] = {"HF_HOME": "/cache"}
    problem = next(p for p in _problems(doc) if p.path == "secrets[0].env")
    assert "both a secret and a plain env variable" in problem.message


# ------------------------------------------------------------------------------------------ reading


def _unreadable(text: str, **kw) -> Problem:
    with pytest.raises(SpecError) as info:
        parse_text(text, "x.yaml", **kw)
    assert info.value.unreadable
    return info.value.problems[0]


def test_yaml_syntax_error_has_line_and_column():
    problem = _unreadable("name: tiny\n  team: [demo\n")
    assert problem.path == "<file>" and "line " in problem.message and "column " in problem.message


def test_duplicate_keys_are_refused():
    problem = _unreadable("name: a\nteam: b\nname: c\n")
    assert "'name' appears twice" in problem.message and "line 3" in problem.message
    assert "appears twice" in _unreadable('{"name": "a", "name": "b"}', kind="json").message


def test_yaml_merge_keys_still_work():
    doc = parse_text("base: &b {a: 1, b: 2}\nother:\n  <<: *b\n  b: 3\n")
    assert doc["other"] == {"a": 1, "b": 3}


def test_alias_bomb_is_refused():
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    problem = _unreadable("\n".join(lines) + "\n")
    assert "YAML aliases" in problem.message


def test_recursive_alias_is_refused():
    with pytest.raises(SpecError) as info:
        parse_spec(parse_text("name: &n [*n]\n"))
    assert info.value.unreadable and "refers to itself" in info.value.problems[0].message


def test_deep_nesting_is_refused():
    assert "nested too deeply" in _unreadable("[" * 5000 + "]" * 5000).message
    assert "nested too deeply" in _unreadable("[" * 5000 + "]" * 5000, kind="json").message
    assert "nested too deeply" in _unreadable("a: " + "[" * 5000 + "]" * 5000, kind="yaml").message


def test_python_tags_are_refused():
    problem = _unreadable("name: !!python/object/apply:os.system ['true']\n")
    assert "not valid YAML" in problem.message


def test_json_constants_are_refused():
    assert "NaN" in _unreadable('{"a": NaN}', kind="json").message


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"\x00\x01\x02binary", "binary file"), (b"\xff\xfe\xfd", "not UTF-8"), (b"", None)],
)
def test_read_document_bad_bytes(tmp_path, content, message):
    path = tmp_path / "job.yaml"
    path.write_bytes(content)
    if message is None:
        assert read_document(path) is None  # empty: parse_spec then says "the document is empty"
        return
    with pytest.raises(SpecError) as info:
        read_document(path)
    assert info.value.unreadable and message in info.value.problems[0].message


def test_read_document_directory_and_missing(tmp_path):
    for path, message in [(tmp_path, "is a directory"), (tmp_path / "nope.yaml", "file not found")]:
        with pytest.raises(SpecError) as info:
            read_document(path)
        assert info.value.unreadable and info.value.problems[0].message.startswith(message)
        assert str(path) in str(info.value)


def test_bom_is_ignored(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("\ufeff" + yaml.safe_dump(TINY), encoding="utf-8")
    assert load_spec(path).name == "tiny-cpu"


# ------------------------------------------------------------------------------------------- schema


def _properties(schema: dict) -> list[tuple[str, dict]]:
    out = [(name, prop) for name, prop in schema.get("properties", {}).items()]
    for name, sub in schema.get("$defs", {}).items():
        out += [(f"{name}.{k}", v) for k, v in sub.get("properties", {}).items()]
    return out


def test_schema_describes_every_field():
    schema = json_schema()
    props = _properties(schema)
    assert len(props) > 60
    missing = [name for name, prop in props if not prop.get("description")]
    assert missing == []
    assert schema.get("description") and all(d.get("description") for d in schema["$defs"].values())
    assert schema["additionalProperties"] is False


# --------------------------------------------------------------------------------- property tests

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
    st.sampled_from(["auto", "h100", "cpu", "fp16", "script", "jax", "catalog://x@main", "interleaved-1f1b",
                     "hf_" + "a" * 25, "AKIAIOSFODNN7EXAMPLE", "[/x]", "", "24h", "0s"]),
)
keys = st.one_of(st.text(max_size=12), st.sampled_from(sorted(JobSpec.model_fields)), st.integers(0, 3))
documents = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(keys, inner, max_size=5)),
                         max_leaves=25)


def _paths(doc, prefix=()):
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield (*prefix, k)
            yield from _paths(v, (*prefix, k))


@st.composite
def mutated_examples(draw):
    doc = copy.deepcopy(TINY)
    for _ in range(draw(st.integers(1, 4))):
        paths = list(_paths(doc))
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        action = draw(st.sampled_from(["drop", "replace", "rename", "wrap"]))
        if action == "drop":
            del parent[path[-1]]
        elif action == "replace":
            parent[path[-1]] = draw(documents)
        elif action == "rename":
            parent[draw(st.text(max_size=10))] = parent.pop(path[-1])
        else:
            parent[path[-1]] = [parent[path[-1]]]
    return doc


def _assert_readable(err: SpecError) -> None:
    assert err.problems
    for p in err.problems:
        assert p.path and p.message.strip()
        text = p.render()
        assert "Traceback" not in text and "pydantic" not in text.lower() and "\n" not in p.message
    json.dumps([p.to_dict() for p in err.problems], allow_nan=False)


PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(st.one_of(documents, mutated_examples()))
def test_parse_spec_raises_only_spec_error(doc):
    try:
        spec = parse_spec(doc)
    except SpecError as err:
        _assert_readable(err)
    else:
        assert isinstance(spec, JobSpec)


@PROPERTY
@given(st.one_of(documents, mutated_examples()), st.booleans())
def test_text_round_trip_raises_only_spec_error(doc, as_json):
    text = json.dumps(doc, default=str) if as_json else yaml.safe_dump(doc, default_flow_style=None)
    try:
        parse_spec(parse_text(text))
    except SpecError as err:
        _assert_readable(err)


@PROPERTY
@given(st.text(alphabet=st.sampled_from(list(":-[]{}\"'#&*!|>%@` \n\tabc1.,?")), max_size=60))
def test_random_text_raises_only_spec_error(text):
    try:
        parse_spec(parse_text(text))
    except SpecError as err:
        _assert_readable(err)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_examples())
def test_validate_document_never_raises(doc):
    report = validate_document(doc)
    for p in report.problems:
        assert p.path and p.message.strip() and not (isinstance(p.value, float) and math.isnan(p.value))
    json.dumps(report.to_dict(), allow_nan=False, default=str)


def test_init_from_folders_are_read_one_way(tmp_path):
    """A Hugging Face folder vs a checkpoint or model version, and where the folder is (validate and submit share it)."""
    assert all(is_weights_folder(v) for v in ("s3://b/m", "./m", "../m", "/abs/m", "~/m", "file:///m", "models/base/"))
    assert not any(is_weights_folder(v) for v in ("job-1@8", "models:/nlp.m/3", "nlp.m/3", "checkpoint:j@2"))
    assert weights_folder_location("s3://b/p", tmp_path) == "s3://b/p/"
    assert weights_folder_location("./m/", tmp_path) == str((tmp_path / "m").resolve())
    assert weights_folder_location("file:///abs/m", tmp_path) == "/abs/m"
    for scheme in ("gs", "hf", "https"):
        [problem] = _problems({**TINY, "init_from": f"{scheme}://bucket/model/"})
        assert problem.path == "init_from" and f"{scheme}:// folders are not read" in problem.message
        assert "s3://" in problem.fix
