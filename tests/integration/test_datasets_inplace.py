"""Datasets where they live: an s3:// prefix on a real S3 server (SeaweedFS), pinned and read in place."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainforge.datasets import tokenizer
from trainforge.datasets.catalog import CatalogError, EmbeddedCatalog
from trainforge.datasets.chunk_order import split_sample_id
from trainforge.datasets.inplace import DatasetChangedError, jsonl_documents
from trainforge.datasets.pin_prefix import pin_prefix
from trainforge.datasets.training_data import open_training_data
from trainforge.spec import DatasetSpec

pytestmark = pytest.mark.slow  # a real S3 server (SeaweedFS): `make test`, not test-fast

WORDS = ["the", "of", "and", "to", "in", "model", "data", "train", "token", "chunk", "object", "bucket", "prefix", "gradient", "step", "loss"]


def documents(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 120))) for _ in range(n)]


def put_jsonl(client, bucket: str, prefix: str, objects: int, docs: int = 40) -> dict[str, list[str]]:
    out = {}
    for i in range(objects):
        texts = documents(i, docs)
        body = "".join(json.dumps({"text": t, "id": f"{i}-{j}"}) + "\n" for j, t in enumerate(texts))
        key = f"{prefix}/part-{i:03d}.jsonl"
        client.put_object(Bucket=bucket, Key=key, Body=body.encode())
        out[key] = texts
    client.put_object(Bucket=bucket, Key=f"{prefix}/_SUCCESS", Body=b"")
    return out


def put_parquet(client, bucket: str, prefix: str, objects: int, docs: int = 60) -> dict[str, list[str]]:
    out = {}
    for i in range(objects):
        texts = documents(100 + i, docs)
        buf = io.BytesIO()
        pq.write_table(pa.table({"id": list(range(docs)), "body": texts}), buf, row_group_size=7)
        key = f"{prefix}/part-{i:03d}.parquet"
        client.put_object(Bucket=bucket, Key=key, Body=buf.getvalue())
        out[key] = texts
    return out


def spec(ref: str, fmt: str = "jsonl", **kw) -> DatasetSpec:
    return DatasetSpec(ref=ref, format=fmt, license="CC-BY-4.0", chunk_mb=kw.pop("chunk_mb", 4 / 1024), **kw)


@pytest.fixture
def bucket(s3_server, s3_env, tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINFORGE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TRAINFORGE_DATA_CACHE", str(tmp_path / "cache" / "shards"))
    name = s3_server.make_bucket()
    yield name
    s3_server.delete_bucket(name)


def _packed(texts: list[str], sample_len: int) -> list[np.ndarray]:
    return list(tokenizer.pack([tokenizer.encode(t) for t in texts], sample_len))


def test_jsonl_prefix_pins_objects_not_bytes_and_reads_every_document(s3_server, bucket, tmp_path):
    client = s3_server.client()
    put = put_jsonl(client, bucket, "corpus/en", objects=5)
    ds = pin_prefix(f"s3://{bucket}/corpus/en", spec(f"s3://{bucket}/corpus/en"))
    m = ds.manifest
    assert ds.in_place and [o.key for o in m.objects] == sorted(put)  # _SUCCESS is not data
    assert all(o.etag and o.version_id is None for o in m.objects) and not m.versioned
    files = sorted(p.name for p in ds.path.iterdir())
    assert files == ["manifest.json", "source.json"]  # the catalog holds the manifest, not the bytes
    assert pin_prefix(f"s3://{bucket}/corpus/en", spec(f"s3://{bucket}/corpus/en")).version == ds.version
    assert EmbeddedCatalog().resolve(m.name, "main").version == ds.version

    data = open_training_data(ds.path, ds.ref, eval_fraction=0.0, seed=3, seq_len=31)
    try:
        reader = data.reader
        assert reader.num_chunks > len(m.objects)  # 4 KiB chunks: several per object
        # Every chunk's samples are its own lines' documents, packed: together, each object's documents once.
        for key, texts in put.items():
            obj = [o.key for o in m.objects].index(key)
            mine = [c for c, ch in enumerate(reader.chunks) if ch.obj == obj]
            docs = [d for c in mine for d in reader.documents(c)]
            assert docs == texts
            for c in mine:
                want = np.array(_packed(reader.documents(c), 32)).reshape(-1, 32)
                assert np.array_equal(reader.chunk_windows(c), want)
        ids = data.order.global_indices(0, 50)
        rows = reader.get(ids)
        for sid, row in zip(ids, rows, strict=True):
            c, w = split_sample_id(sid)
            assert np.array_equal(row, _packed(reader.documents(c), 32)[w])
    finally:
        data.close()


def test_nothing_is_read_before_it_is_needed(s3_server, bucket):
    client = s3_server.client()
    put_jsonl(client, bucket, "big", objects=12, docs=80)
    ds = pin_prefix(f"s3://{bucket}/big", spec(f"s3://{bucket}/big", chunk_mb=2 / 1024))
    data = open_training_data(ds.path, ds.ref, eval_fraction=0.0, seed=1, seq_len=15)
    try:
        data.reader.get(data.order.rank_slice(0, 8, 0, 1))
        read = data.reader.objects.bytes_read
        # one group of 8 chunks of 2 KiB, with the tails of their last lines: not the 340 KB prefix
        assert 0 < read <= 8 * (2048 + 2048)
        assert data.reader.objects.requests <= 8 * 3
    finally:
        data.close()


def test_parquet_prefix_reads_row_groups_in_place(s3_server, bucket):
    client = s3_server.client()
    put = put_parquet(client, bucket, "pq", objects=3)
    ds = pin_prefix(f"s3://{bucket}/pq", spec(f"s3://{bucket}/pq", "parquet", text_field="body",
                                                chunk_mb=1 / 1024))
    data = open_training_data(ds.path, ds.ref, eval_fraction=0.0, seed=3, seq_len=63)
    try:
        reader = data.reader
        for key, texts in put.items():
            obj = [o.key for o in ds.manifest.objects].index(key)
            mine = [c for c, ch in enumerate(reader.chunks) if ch.obj == obj]
            assert len(mine) > 1 and [d for c in mine for d in reader.documents(c)] == texts
        assert reader.get(data.order.global_indices(0, 5)).shape == (5, 64)
    finally:
        data.close()
    with pytest.raises(CatalogError, match="no objects"):
        pin_prefix(f"s3://{bucket}/pq", spec(f"s3://{bucket}/pq", "jsonl"))


def test_changed_object_in_an_unversioned_bucket_fails_the_read_naming_it(s3_server, bucket):
    client = s3_server.client()
    put_jsonl(client, bucket, "c", objects=2)
    ds = pin_prefix(f"s3://{bucket}/c", spec(f"s3://{bucket}/c"))
    client.put_object(Bucket=bucket, Key="c/part-001.jsonl", Body=b'{"text": "something else"}\n')
    data = open_training_data(ds.path, ds.ref, eval_fraction=0.0, seed=3, seq_len=31)
    try:
        changed = [c for c, ch in enumerate(data.reader.chunks) if ch.obj == 1]
        with pytest.raises(DatasetChangedError) as err:
            data.reader.chunk_windows(changed[0])
        assert f"s3://{bucket}/c/part-001.jsonl" in str(err.value) and ds.manifest.objects[1].etag in str(err.value)
        assert ds.version[:12] in str(err.value)
        data.reader.chunk_windows(0)  # the untouched object still reads
    finally:
        data.close()


def test_versioned_bucket_reads_the_pinned_version_after_an_overwrite(s3_server, bucket):
    client = s3_server.client()
    client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    put = put_jsonl(client, bucket, "v", objects=1)
    ds = pin_prefix(f"s3://{bucket}/v", spec(f"s3://{bucket}/v"))
    assert ds.manifest.versioned and ds.manifest.objects[0].version_id
    client.put_object(Bucket=bucket, Key="v/part-000.jsonl", Body=b'{"text": "overwritten"}\n')
    data = open_training_data(ds.path, ds.ref, eval_fraction=0.0, seed=3, seq_len=31)
    try:
        docs = [d for c in range(data.reader.num_chunks) for d in data.reader.documents(c)]
        assert docs == put["v/part-000.jsonl"]
    finally:
        data.close()
    assert pin_prefix(f"s3://{bucket}/v", spec(f"s3://{bucket}/v")).version != ds.version  # a new pin sees it


def test_bad_records_fail_with_the_object_and_offset():
    with pytest.raises(ValueError, match=r"obj \(the line at byte 114\): not a JSON line"):
        jsonl_documents(b'{"text": "a"}\n{oops\n', "text", "obj", 100)
    with pytest.raises(ValueError, match="no 'body' field"):
        jsonl_documents(b'{"text": "a"}\n', "body", "obj")
    assert jsonl_documents(b'\n{"text": "a"}\n\n{"text": "  "}\n', "text", "obj") == ["a"]


RECORDER = '''
import json
import os
from pathlib import Path

from trainforge.trainer.models.llama import build_model  # noqa: F401  (the job's entrypoint)


def record(sample, index):
    """Write down which sample each rank trained on, in order (a transform that changes nothing)."""
    out = Path(os.environ["RECORD_DIR"])
    probes = out.parent / "probes"
    if not (probes / f"{os.getpid()}.json").exists():
        probes.mkdir(exist_ok=True)
        (probes / f"{os.getpid()}.json").write_text(json.dumps(probe()))
    with open(out / f"{os.getpid()}.txt", "a") as f:
        f.write(f"{index}\\n")
    return sample


def probe():
    """What this job's own identity may do, tried from its model code."""
    from botocore.exceptions import ClientError

    from trainforge.infra.storage.s3 import S3ObjectStore

    bucket = os.environ["DATA_BUCKET"]
    client = S3ObjectStore.from_url(f"s3://{bucket}")._client
    seen = {"key": os.environ.get("AWS_ACCESS_KEY_ID", "")}
    for name, call in (
            ("own_prefix", lambda: client.get_object(Bucket=bucket, Key="web/2026/part-000.jsonl")["Body"].read()),
            ("outside", lambda: client.get_object(Bucket=bucket, Key="private/secret.jsonl")["Body"].read()),
            ("list_outside", lambda: client.list_objects_v2(Bucket=bucket, Prefix="private/")),
            ("write_prefix", lambda: client.put_object(Bucket=bucket, Key="web/2026/x.jsonl", Body=b"{}")),
            ("buckets", lambda: [b["Name"] for b in client.list_buckets()["Buckets"]])):
        try:
            got = call()
            seen[name] = got if name == "buckets" else "allowed"
        except ClientError as e:
            seen[name] = e.response["Error"]["Code"]
    return seen
'''


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_on_a_jsonl_prefix_through_the_flow_and_resume_after_a_kill(prefect_api, s3_server, s3_env, tmp_path,
                                                                          monkeypatch):
    """The tiny job trains on objects in a bucket with no copy: the catalog holds the manifest; the job's own
    identity reads the prefix; a worker killed mid-run resumes and replays exactly the samples the order gives."""
    from tests.integration.test_train_job import EXAMPLES, small_spec
    from trainforge.datasets.chunk_order import ChunkOrder
    from trainforge.flows.train_job import train_job
    from trainforge.registry.jobs import JobStore

    data_bucket, job_bucket = s3_server.make_bucket(), s3_server.make_bucket()
    client = s3_server.client()
    put_jsonl(client, data_bucket, "web/2026", objects=6, docs=60)
    client.put_object(Bucket=data_bucket, Key="private/secret.jsonl", Body=b'{"text": "not for this job"}\n')
    monkeypatch.setenv("TRAINFORGE_STORAGE_URL", f"s3://{job_bucket}/platform")
    monkeypatch.setenv("TRAINFORGE_JOB_CREDENTIALS", f"seaweedfs:{s3_server.config_path}")
    monkeypatch.setenv("TRAINFORGE_DATA_CACHE", str(tmp_path / "cache" / "shards"))
    record_dir = tmp_path / "record"
    record_dir.mkdir()
    monkeypatch.setenv("RECORD_DIR", str(record_dir))
    monkeypatch.setenv("DATA_BUCKET", data_bucket)
    monkeypatch.setenv("TRAINFORGE_FAULT", "kill:rank=1:step=13:durable=1")
    code = tmp_path / "code"
    code.mkdir()
    (code / "recorder.py").write_text(RECORDER)
    doc = small_spec(max_steps=16)
    doc["checkpoint"]["interval_steps"] = 8
    doc["code"] = {"entrypoint": "recorder:build_model", "repo": str(code)}
    doc["dataset"] = {"ref": f"s3://{data_bucket}/web/2026", "format": "jsonl", "license": "CC-BY-4.0",
                      "chunk_mb": 8 / 1024, "eval_fraction": 0.1, "transforms": ["recorder:record"]}
    job_id = "inplace-" + str(abs(hash(str(tmp_path))) % 10**8)
    try:
        result = train_job(doc, "inplace.yaml", str(EXAMPLES), job_id, False)
        assert result["state"] == "completed", result
        record = JobStore().get(job_id)
        assert [s["state"] for s in record.data["segments"]] == ["failed", "completed"]
        ds = record.data["dataset"]
        assert ds["ref"] == f"s3://{data_bucket}/web/2026" and ds["tokenizer"] == tokenizer.NAME
        assert sorted(p.name for p in Path(ds["path"]).iterdir()) == ["manifest.json", "source.json"]
        manifest = json.loads((Path(ds["path"]) / "manifest.json").read_text())
        assert [o["key"] for o in manifest["objects"]] == [f"web/2026/part-{i:03d}.jsonl" for i in range(6)]

        # What each rank trained on, segment by segment, is the order's rank slice for each step it ran.
        from trainforge.datasets.training_data import open_training_data

        data = open_training_data(ds["path"], ds["ref"], eval_fraction=0.1, seed=doc["training"]["seed"],
                                  seq_len=doc["training"]["seq_len"], tokenizer_name=ds["tokenizer"])
        order: ChunkOrder = data.order
        per_rank = doc["training"]["global_batch_size"] // 2
        from trainforge.events import read_events

        events, _ = read_events(record.events_path)
        starts = [e for e in events if e["type"] == "segment_start"]
        resumed_from = starts[1]["resumed_from"]
        assert [s["resumed_from"] for s in starts] == [None, 8]
        runs = [list(map(int, p.read_text().split())) for p in sorted(record_dir.iterdir())]
        assert len(runs) == 4  # two ranks, two segments
        seen_starts = set()
        for ids in runs:
            assert len(ids) % per_rank == 0
            steps = len(ids) // per_rank
            match = [(start, r) for start in (0, resumed_from) for r in (0, 1)
                     if ids == [i for s in range(start, start + steps) for i in order.rank_slice(s, 2 * per_rank, r, 2)]]
            assert match, f"a rank trained on samples the order does not give: {ids[:8]}..."
            seen_starts.add(match[0])
        assert {s for s, _ in seen_starts} == {0, resumed_from}
        data.close()

        # Each checkpoint records where its position's group of chunks starts: a resume counts from there.
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=job_bucket)["Contents"]
                if o["Key"].endswith("step-0000000008/manifest.json")]
        sampler = json.loads(client.get_object(Bucket=job_bucket, Key=keys[0])["Body"].read())["sampler"]
        anchor = sampler["anchor"]
        assert sampler["position"] == 8 * 8 and anchor["position"] <= 64 and anchor["epoch"] == 0
        assert order.anchor(64).to_dict() == anchor

        # Lineage: the prefix, the manifest digest and every object's key and ETag; the legal questions by prefix
        # and by one object key both find the job.
        from typer.testing import CliRunner

        from trainforge.cli import app

        def trained_on(what: str) -> dict:
            out = CliRunner().invoke(app, ["lineage", "trained-on", what, "--json"])
            assert out.exit_code == 0, out.output
            return json.loads(out.output)

        by_prefix = trained_on(f"s3://{data_bucket}/web/2026")
        assert [d["version"] for d in by_prefix["datasets"]] == [ds["version"]]
        assert [j["name"] for j in by_prefix["jobs"]] == [job_id]
        assert {a["kind"] for a in by_prefix["affected"]} == {"checkpoint", "model"}  # its checkpoints, its model
        assert {a["name"] for a in by_prefix["affected"] if a["kind"] == "checkpoint"} == {job_id}
        by_key = trained_on(f"s3://{data_bucket}/web/2026/part-004.jsonl")
        assert [j["name"] for j in by_key["jobs"]] == [job_id]
        assert trained_on(f"s3://{data_bucket}/private/secret.jsonl")["jobs"] == []
        from trainforge.registry.lineage import LineageStore, dataset_id

        node = LineageStore().node(dataset_id(ds["name"], ds["version"]))
        assert node.attrs["provenance"]["source"] == f"s3://{data_bucket}/web/2026"
        assert node.attrs["provenance"]["objects"] == 6 and node.license == "CC-BY-4.0"
        etag = next(o["etag"] for o in manifest["objects"] if o["key"] == "web/2026/part-004.jsonl").strip('"')
        assert [d.id for d in LineageStore().find_datasets(file=etag)] == [node.id]  # recorded with its ETag

        # From the workers' side: the job's own identity reads its prefix and nothing else, writes nothing there,
        # and sees no bucket names.
        for p in sorted((tmp_path / "probes").iterdir()):
            seen = json.loads(p.read_text())
            assert seen.pop("key").startswith("TFJOB")
            assert seen == {"own_prefix": "allowed", "outside": "AccessDenied", "list_outside": "AccessDenied",
                            "write_prefix": "AccessDenied", "buckets": []}, seen
    finally:
        s3_server.delete_bucket(data_bucket)
        s3_server.delete_bucket(job_bucket)


def test_the_gate_runs_on_a_bounded_sample_and_a_team_expectation_refuses_the_version(s3_server, bucket, tmp_path):
    from trainforge.datasets.gate import GateFailed, gate_for_submit, load_suite
    from trainforge.datasets.quality import SAMPLE_CHUNKS, sample_chunks

    client = s3_server.client()
    for i in range(4):
        lines = [json.dumps({"text": t, "lang": "de" if i == 3 and j % 5 == 0 else "en"})
                 for j, t in enumerate(documents(50 + i, 40))]
        client.put_object(Bucket=bucket, Key=f"t/part-{i}.jsonl", Body=("\n".join(lines) + "\n").encode())
    ds = pin_prefix(f"s3://{bucket}/t", spec(f"s3://{bucket}/t"))
    report = gate_for_submit(ds)
    assert report["passed"] and report["documents_checked"] == 160 and report["bytes_read"] >= ds.manifest.total_bytes
    assert EmbeddedCatalog().get_quality(ds.name, ds.version)["passed"]  # stored: a resubmit does not run it again

    suite = tmp_path / "team.json"
    suite.write_text(json.dumps({"name": "nlp-team", "expectations": [
        {"type": "expect_column_values_to_be_in_set", "kwargs": {"column": "lang", "value_set": ["en"]}},
        {"type": "expect_column_values_to_be_between", "kwargs": {"column": "_chars", "min_value": 10}}]}))
    with pytest.raises(GateFailed, match=r"team:documents: expect_column_values_to_be_in_set\(lang\).*'de'") as err:
        gate_for_submit(ds, load_suite(str(suite), tmp_path))
    assert "team.json" in str(err.value)
    stored = [k for k in EmbeddedCatalog().store.list(f"{ds.name}/quality/")]
    assert len(stored) == 2  # the built-in report and the team suite's, under the suite's digest

    # a large prefix is sampled: evenly spread chunks, bounded in number and bytes
    picked = sample_chunks(100_000, 4 << 20)
    assert len(picked) == 8 and picked[0] == 0 and picked[-1] == 99_999  # 32 MiB of 4 MiB chunks
    assert len(sample_chunks(100_000, 1 << 10)) == SAMPLE_CHUNKS


def test_the_built_in_gate_bites_on_duplicates_and_bad_lines(s3_server, bucket):
    from trainforge.datasets.gate import GateFailed, gate_for_submit

    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="dup/a.jsonl", Body=b'{"text": "same words again"}\n' * 50)
    ds = pin_prefix(f"s3://{bucket}/dup", spec(f"s3://{bucket}/dup"))
    with pytest.raises(GateFailed, match=r"expect_column_proportion_of_unique_values_to_be_between\(_hash\)"):
        gate_for_submit(ds)
    client.put_object(Bucket=bucket, Key="bad/a.jsonl",
                      Body=b"".join(b'{"text": "doc %d"}\n' % i for i in range(30)) + b"not json\n")
    ds = pin_prefix(f"s3://{bucket}/bad", spec(f"s3://{bucket}/bad"))
    with pytest.raises(GateFailed, match=r"expect_column_values_to_be_in_set\(_parsed\)"):
        gate_for_submit(ds)
    # what training would refuse, the gate refuses: a line without the text field, a text that is not a string
    for name, line in (("nofield", b'{"body": "x"}\n'), ("number", b'{"text": 7}\n')):
        client.put_object(Bucket=bucket, Key=f"{name}/a.jsonl",
                          Body=b"".join(b'{"text": "doc %d"}\n' % i for i in range(30)) + line)
        ds = pin_prefix(f"s3://{bucket}/{name}", spec(f"s3://{bucket}/{name}"))
        with pytest.raises(GateFailed, match=r"\(_parsed\)"):
            gate_for_submit(ds)


def test_submit_refuses_before_allocating_and_validate_lists_the_prefix(s3_server, bucket, tmp_path):
    import yaml

    from tests.integration.test_train_job import EXAMPLES
    from trainforge.datasets.refs import check_and_resolve
    from trainforge.tasks.prepare import JobRejected, resolve_dataset, validate_spec

    client = s3_server.client()
    put_jsonl(client, bucket, "ok", objects=2)
    suite = tmp_path / "team.json"
    suite.write_text(json.dumps({"name": "t", "expectations": [
        {"type": "expect_column_values_to_match_regex", "kwargs": {"column": "id", "regex": "^0-"}}]}))
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["dataset"] = {"ref": f"s3://{bucket}/ok", "format": "jsonl", "license": "MIT", "expectations": str(suite)}
    spec_ = validate_spec(doc, "x.yaml", tmp_path)
    with pytest.raises(JobRejected, match=r"dataset.expectations: .*failed its quality gate.*\(id\)"):
        resolve_dataset(spec_, tmp_path)
    doc["dataset"].pop("expectations")
    record = resolve_dataset(validate_spec(doc, "x.yaml", tmp_path), tmp_path)
    assert record["tokenizer"] == tokenizer.NAME and record["sample_len"] == doc["training"]["seq_len"] + 1

    # data the reader cannot read refuses the job at submit, with the reason (not a traceback, not a retry)
    buf = io.BytesIO()
    pq.write_table(pa.table({"body": list(range(20))}), buf)
    client.put_object(Bucket=bucket, Key="ints/a.parquet", Body=buf.getvalue())
    doc["dataset"] = {"ref": f"s3://{bucket}/ints", "format": "parquet", "text_field": "body", "license": "MIT"}
    with pytest.raises(JobRejected, match="column 'body' is int64, not a string column"):
        resolve_dataset(validate_spec(doc, "x.yaml", tmp_path), tmp_path)

    assert check_and_resolve(f"s3://{bucket}/ok", tmp_path, spec(f"s3://{bucket}/ok")) == (None, None)
    problem, _ = check_and_resolve(f"s3://{bucket}/nothing", tmp_path, spec(f"s3://{bucket}/nothing"))
    assert problem is not None and problem.severity == "error" and "holds no objects" in problem.message
    problem, _ = check_and_resolve(f"s3://{bucket}-missing/x", tmp_path, spec(f"s3://{bucket}-missing/x"))
    assert problem is not None and "does not exist" in problem.message


def test_datasets_check_and_show_an_in_place_version(s3_server, bucket):
    from typer.testing import CliRunner

    from trainforge.cli import app

    put_jsonl(s3_server.client(), bucket, "cli", objects=2)
    out = CliRunner().invoke(app, ["datasets", "check", f"s3://{bucket}/cli", "--license", "MIT", "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert report["passed"] and report["name"] == f"s3.{bucket}.cli"
    shown = CliRunner().invoke(app, ["datasets", "show", f"s3.{bucket}.cli", "--json"])
    assert shown.exit_code == 0, shown.output
    summary = json.loads(shown.output)
    assert summary["objects"] == 2 and summary["quality"]["passed"] and summary["pinned_by"] == "etag"
    missing = CliRunner().invoke(app, ["datasets", "check", f"s3://{bucket}/cli"])
    assert missing.exit_code == 2 and "--license" in missing.output


def test_a_shared_tier_serves_tokenized_chunks_to_another_node(s3_server, bucket, tmp_path):
    from trainforge.datasets.inplace import InPlaceReader, TokenizerSpec, open_data_store
    from trainforge.datasets.stream import CacheConfig

    put_jsonl(s3_server.client(), bucket, "sh", objects=2)
    ds = pin_prefix(f"s3://{bucket}/sh", spec(f"s3://{bucket}/sh"))

    def node(name: str) -> InPlaceReader:
        cache = CacheConfig(local_dir=tmp_path / name / "shards", local_max_bytes=None, shared_dir=tmp_path / "nfs")
        return InPlaceReader(ds.manifest, open_data_store(ds.manifest), sample_len=32,
                             tokenizer_spec=TokenizerSpec(), cache=cache)

    a, b = node("a"), node("b")
    try:
        first = [a.chunk_windows(c) for c in range(a.num_chunks)]
        assert a.objects.bytes_read >= ds.manifest.total_bytes and a.stats.store_fetches == a.num_chunks
        second = [b.chunk_windows(c) for c in range(b.num_chunks)]
        assert b.objects.bytes_read == 0 and b.stats.shared_hits == b.num_chunks  # no read of the bucket
        assert all(np.array_equal(x, y) for x, y in zip(first, second, strict=True))
    finally:
        a.close()
        b.close()


def _flow_env(s3_server, monkeypatch, tmp_path) -> str:
    job_bucket = s3_server.make_bucket()
    monkeypatch.setenv("TRAINFORGE_STORAGE_URL", f"s3://{job_bucket}/platform")
    monkeypatch.setenv("TRAINFORGE_JOB_CREDENTIALS", f"seaweedfs:{s3_server.config_path}")
    monkeypatch.setenv("TRAINFORGE_DATA_CACHE", str(tmp_path / "cache" / "shards"))
    monkeypatch.delenv("TRAINFORGE_FAULT", raising=False)
    return job_bucket


@pytest.mark.timeout(600)
def test_train_on_a_parquet_prefix_through_the_flow(prefect_api, s3_server, s3_env, tmp_path, monkeypatch):
    from tests.integration.test_train_job import EXAMPLES, small_spec
    from trainforge.flows.train_job import train_job
    from trainforge.registry.jobs import JobStore

    data_bucket, job_bucket = s3_server.make_bucket(), _flow_env(s3_server, monkeypatch, tmp_path)
    put_parquet(s3_server.client(), data_bucket, "pq/v1", objects=4, docs=80)
    doc = small_spec(max_steps=8)
    doc["dataset"] = {"ref": f"s3://{data_bucket}/pq/v1/*.parquet", "format": "parquet", "text_field": "body",
                      "license": "CC0-1.0", "chunk_mb": 4 / 1024, "eval_fraction": 0.2}
    job_id = "inplace-pq-" + str(abs(hash(str(tmp_path))) % 10**6)
    try:
        result = train_job(doc, "pq.yaml", str(EXAMPLES), job_id, False)
        assert result["state"] == "completed", result
        record = JobStore().get(job_id)
        ds = record.data["dataset"]
        assert sorted(p.name for p in Path(ds["path"]).iterdir()) == ["manifest.json", "source.json"]
        assert all("eval_loss" in c for c in record.data["checkpoints"].values())  # held-out chunks, read in place
    finally:
        s3_server.delete_bucket(data_bucket)
        s3_server.delete_bucket(job_bucket)


@pytest.mark.timeout(600)
def test_an_object_changed_after_the_pin_fails_the_job_naming_it(prefect_api, s3_server, s3_env, tmp_path,
                                                                 monkeypatch):
    """Pinned at submit, overwritten before the first step (an unversioned bucket): the job fails with the named
    error and does not train on the changed data (no retry reads it either: the error is the data's, not the
    machine's)."""
    from tests.integration.test_train_job import EXAMPLES, small_spec
    from trainforge.flows.train_job import train_job
    from trainforge.registry.jobs import JobStore
    from trainforge.tasks import prepare

    data_bucket, job_bucket = s3_server.make_bucket(), _flow_env(s3_server, monkeypatch, tmp_path)
    client = s3_server.client()
    put_jsonl(client, data_bucket, "moving", objects=3, docs=30)
    pinned = prepare._in_place_dataset

    def pin_then_overwrite(*args, **kwargs):
        out = pinned(*args, **kwargs)
        for i in range(3):  # someone rewrites the data after the job pinned it
            client.put_object(Bucket=data_bucket, Key=f"moving/part-{i:03d}.jsonl", Body=b'{"text": "new"}\n' * 200)
        return out

    monkeypatch.setattr(prepare, "_in_place_dataset", pin_then_overwrite)
    doc = small_spec(max_steps=8)
    doc["dataset"] = {"ref": f"s3://{data_bucket}/moving", "format": "jsonl", "license": "MIT",
                      "chunk_mb": 8 / 1024, "eval_fraction": 0.1}
    job_id = "inplace-moved-" + str(abs(hash(str(tmp_path))) % 10**6)
    try:
        with pytest.raises(Exception, match=r"moving/part-00\d\.jsonl is no longer the pinned ETag"):
            train_job(doc, "moved.yaml", str(EXAMPLES), job_id, False)
        record = JobStore().get(job_id)
        assert record.data["state"] == "failed"
        assert [s["state"] for s in record.data["segments"]] == ["failed"]  # not retried: the data changed
        assert not record.data.get("checkpoints")
    finally:
        s3_server.delete_bucket(data_bucket)
        s3_server.delete_bucket(job_bucket)


def test_preprocessing_workers_give_the_in_process_batches(s3_server, bucket):
    """`dataset.num_workers`: DataLoader worker processes read and tokenize the chunks; the batches are the same
    bytes, in the same order, as reading in the training process."""
    from trainforge.datasets.pipeline import StepLoader, StepSource

    put_jsonl(s3_server.client(), bucket, "w", objects=4)
    ds = pin_prefix(f"s3://{bucket}/w", spec(f"s3://{bucket}/w"))
    def source() -> StepSource:
        return StepSource(str(ds.path), ds.ref, 0.1, 5, 8, 1, 2, seq_len=31, tokenizer=tokenizer.NAME)

    inline = [(s, rows.copy()) for s, rows in StepLoader(source(), 0, 6, num_workers=0)]
    piped = list(StepLoader(source(), 0, 6, num_workers=2, mp_context="fork"))
    assert [s for s, _ in piped] == list(range(6))
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(inline, piped, strict=True))
    data = open_training_data(ds.path, ds.ref, eval_fraction=0.1, seed=5, seq_len=31)
    try:
        assert np.array_equal(inline[3][1], data.reader.get(data.order.rank_slice(3, 8, 1, 2)))
    finally:
        data.close()
