"""Quality gates: great-expectations suites run on a dataset version before jobs may use it.

Three batches are validated, each with its own suite:
- per shard: the Arrow schema is the one the manifest promises, and the bytes match the manifest's sha256;
- per sample (all samples, or an evenly spaced subset of `max_samples`): token ids within [0, vocab_size), no
  empty sample (at least one non-padding token), the length distribution (mean non-padding length), the duplicate
  rate (share of distinct sample hashes);
- the version's metadata: a license is present.
The report (JSON) is stored with the version in the catalog (`{name}/quality/{version}.json`); resolving a version
whose report failed refuses it, with the report's failures (see refs.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from trainforge._optional import require
from trainforge.datasets import tokenizer
from trainforge.datasets.catalog import ResolvedDataset
from trainforge.datasets.shards import ShardReader, sha256_file

logger = logging.getLogger(__name__)
NO_LICENSE = ["", "unknown", "none", "noassertion"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GateConfig:
    max_duplicate_rate: float = 0.05
    """Largest allowed share of samples that repeat another sample."""
    min_mean_tokens: float = 1.0
    """Smallest allowed mean of non-padding tokens per sample."""
    max_samples: int = 200_000
    """Samples checked (an evenly spaced subset above this)."""
    max_empty_rate: float = 0.01
    """Largest allowed share of empty documents (an in-place prefix's records with no text)."""


def expected_schema(ds: ResolvedDataset) -> pa.Schema:
    m = ds.manifest
    token = pa.uint16() if m.token_dtype == "uint16" else pa.uint32()
    fields = [pa.field("tokens", pa.list_(token, m.sample_len))]
    fields += [pa.field(n, pa.list_(pa.uint16(), f["dim"])) for n, f in m.features.items()]
    return pa.schema(fields)


def _frames(ds: ResolvedDataset, reader: ShardReader, cfg: GateConfig) -> tuple[Any, Any, Any]:
    pd = require("pandas", purpose="the dataset quality gate")

    want = str(expected_schema(ds))
    shard_rows = []
    for i, info in enumerate(ds.manifest.shards):
        path = reader.shard_path(i)
        schema = str(pa.ipc.open_file(pa.memory_map(str(path), "r")).schema)
        shard_rows.append({"file": info.file, "schema_matches": schema == want,
                           "sha256_matches": sha256_file(path) == info.sha256})
    n = ds.manifest.num_samples
    idx = np.arange(n) if n <= cfg.max_samples else np.linspace(0, n - 1, cfg.max_samples).astype(np.int64)
    samples = reader.get(idx.tolist())
    pad = tokenizer.pad_id(ds.manifest.tokenizer, ds.path)
    nonpad = samples != pad if pad is not None else np.ones_like(samples, bool)
    hashes = [int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=8).digest(), "little", signed=True)
              for row in samples]
    sample_frame = pd.DataFrame({"min_token": samples.min(axis=1), "max_token": samples.max(axis=1),
                                 "num_tokens": nonpad.sum(axis=1), "sample_hash": hashes})
    meta_frame = pd.DataFrame({"license": [ds.license], "name": [ds.name]})
    return pd.DataFrame(shard_rows), sample_frame, meta_frame


def _suites(ds: ResolvedDataset, cfg: GateConfig) -> dict[str, list[Any]]:
    gx = require("great_expectations", purpose="the dataset quality gate")
    E = gx.expectations
    return {
        "shards": [E.ExpectColumnValuesToBeInSet(column="schema_matches", value_set=[True]),
                   E.ExpectColumnValuesToBeInSet(column="sha256_matches", value_set=[True])],
        "samples": [E.ExpectColumnValuesToBeBetween(column="min_token", min_value=0),
                    E.ExpectColumnValuesToBeBetween(column="max_token", max_value=ds.manifest.vocab_size - 1),
                    E.ExpectColumnValuesToBeBetween(column="num_tokens", min_value=1),
                    E.ExpectColumnMeanToBeBetween(column="num_tokens", min_value=cfg.min_mean_tokens,
                                                  max_value=ds.manifest.sample_len),
                    E.ExpectColumnProportionOfUniqueValuesToBeBetween(column="sample_hash",
                                                                      min_value=1 - cfg.max_duplicate_rate)],
        "metadata": [E.ExpectColumnValuesToNotBeNull(column="license"),
                     E.ExpectColumnValuesToNotBeInSet(column="license", value_set=NO_LICENSE)],
    }


class SuiteError(ValueError):
    """A team's expectation suite (`dataset.expectations`) that cannot be used."""


@dataclass(frozen=True, slots=True)
class TeamSuite:
    """A team's own great-expectations suite (JSON: {"name", "expectations": [{"type", "kwargs"}]}), run on the
    per-record batch with the built-in ones: `documents` for an in-place prefix (each record's own scalar fields
    plus `_chars`, `_object`), `samples` for tokenized shards."""

    path: str
    text: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def expectations(self) -> list[Any]:
        gx = require("great_expectations", purpose="the dataset quality gate")
        try:
            doc = json.loads(self.text)
            suite = gx.ExpectationSuite(name=str(doc.get("name") or "team"), expectations=doc.get("expectations", []))
        except Exception as exc:  # GE raises its own and pydantic's errors for a bad expectation
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise SuiteError(f"{self.path} is not a great-expectations suite: {first}") from None
        if not suite.expectations:
            raise SuiteError(f"{self.path} holds no expectations")
        return list(suite.expectations)


def load_team_suite(path: Path) -> TeamSuite:
    """A suite file, refused with a readable reason (SuiteError) when it cannot be read or is not a suite."""
    try:
        text = path.read_text(encoding="utf-8")
        doc = json.loads(text)
    except FileNotFoundError:
        raise SuiteError(f"{path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise SuiteError(f"{path} is not a readable JSON file ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("expectations"), list):
        raise SuiteError(f"{path} is not an expectation suite: give {{\"name\": ..., \"expectations\": [{{\"type\": "
                         "\"expect_...\", \"kwargs\": {...}}]}")
    suite = TeamSuite(str(path), text)
    suite.expectations()  # every expectation type and its arguments, checked now
    return suite


def _validate(name: str, frames: dict[str, Any], suites: dict[str, list[Any]]) -> list[dict[str, Any]]:
    gx = require("great_expectations", purpose="the dataset quality gate")
    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = {"globally": False}  # type: ignore[assignment]
    source = context.data_sources.add_pandas(name="trainforge")
    checks: list[dict[str, Any]] = []
    for batch_name, expectations in suites.items():
        frame_name = batch_name.removeprefix("team:")
        asset = source.add_dataframe_asset(name=batch_name.replace(":", "-"))
        batch = asset.add_batch_definition_whole_dataframe("all").get_batch(
            batch_parameters={"dataframe": frames[frame_name]})
        suite = gx.ExpectationSuite(name=f"{name}-{batch_name.replace(':', '-')}")
        for e in expectations:
            suite.add_expectation(e)
        result = batch.validate(suite).to_json_dict()
        for r in result["results"]:
            cfg_ = r["expectation_config"]
            res = r.get("result", {})
            checks.append({"batch": batch_name, "expectation": cfg_["type"], "column": cfg_["kwargs"].get("column"),
                           "success": bool(r["success"]), "observed": res.get("observed_value"),
                           "unexpected_count": res.get("unexpected_count"),
                           "examples": res.get("partial_unexpected_list", [])[:5],
                           **({"error": str(r["exception_info"].get("exception_message"))}
                              if (r.get("exception_info") or {}).get("raised_exception") else {})})
    return checks


def _report(ds: ResolvedDataset, checks: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    gx = require("great_expectations", purpose="the dataset quality gate")
    failed = [c for c in checks if not c["success"]]
    return {"passed": not failed, "name": ds.name, "version": ds.version, "checks": checks,
            "failures": [f"{c['batch']}: {c['expectation']}({c['column']}) observed={c['observed']} "
                         f"unexpected={c['unexpected_count']} e.g. {c['examples']}"
                         + (f" error: {c['error']}" if c.get("error") else "") for c in failed],
            **extra, "great_expectations": gx.__version__}


def run_gate(ds: ResolvedDataset, reader: ShardReader | None = None, cfg: GateConfig | None = None,
             team: TeamSuite | None = None) -> dict[str, Any]:
    """Validate a version with great-expectations; returns the JSON-able report ({"passed": bool, ...}). An
    in-place version (an s3:// prefix) is checked on a bounded sample of its records (`run_in_place_gate`)."""
    if ds.in_place:
        return run_in_place_gate(ds, reader, cfg, team)
    cfg = cfg or GateConfig()
    if reader is None:
        from trainforge.datasets.stream import open_reader

        reader = open_reader(ds.path, ds.manifest)
    frames = dict(zip(("shards", "samples", "metadata"), _frames(ds, reader, cfg), strict=True))
    suites = _suites(ds, cfg)
    if team is not None:
        suites["team:samples"] = team.expectations()
    checks = _validate(ds.name, frames, suites)
    return _report(ds, checks, samples_checked=len(frames["samples"]), config=asdict(cfg),
                   **({"team_suite": {"path": team.path, "sha256": team.digest}} if team else {}))


# ------------------------------------------------------------------------------------ in-place prefixes
# A prefix may be 100 TB: the gate reads a sample, never the whole. SAMPLE_BYTES (32 MiB) in at most
# SAMPLE_CHUNKS (64) chunks spread evenly over the prefix (every part of it is represented, not only its first
# objects). That is ~8,000 documents of typical web text: enough to estimate an empty or duplicate rate of a few
# percent to about +-0.5% (binomial standard error), and a few seconds of reading at submit time.
SAMPLE_BYTES = 32 << 20
SAMPLE_CHUNKS = 64


def sample_chunks(num_chunks: int, chunk_bytes: int, max_bytes: int = SAMPLE_BYTES,
                  max_chunks: int = SAMPLE_CHUNKS) -> list[int]:
    """Chunk indices the gate reads: evenly spaced, at most `max_chunks` and about `max_bytes` in all."""
    k = max(1, min(num_chunks, max_chunks, max_bytes // max(1, chunk_bytes)))
    if num_chunks == 0:
        return []
    return sorted({int(round(i)) for i in np.linspace(0, num_chunks - 1, k)})


def _record_frames(ds: ResolvedDataset, reader: Any, chunks: list[int]) -> tuple[Any, Any]:
    pd = require("pandas", purpose="the dataset quality gate")
    m = ds.manifest
    rows = []
    for c in chunks:
        key = m.objects[reader.chunks[c].obj].key
        for rec in reader.records(c, max_bytes=max(1, SAMPLE_BYTES // max(1, len(chunks)))):
            text = rec.get(m.text_field)
            text = text if isinstance(text, str) else ""
            rows.append({**rec, "_object": key, "_chars": len(text.strip()),
                         "_hash": int.from_bytes(hashlib.blake2b(text.encode("utf-8", "replace"),
                                                                 digest_size=8).digest(), "little", signed=True)})
    documents = pd.DataFrame(rows) if rows else pd.DataFrame({"_object": [], "_chars": [], "_hash": [],
                                                              "_parsed": []})
    meta = pd.DataFrame({"license": [ds.license], "name": [ds.name]})
    return documents, meta


def run_in_place_gate(ds: ResolvedDataset, reader: Any = None, cfg: GateConfig | None = None,
                      team: TeamSuite | None = None) -> dict[str, Any]:
    """The gate of a pinned prefix, on a bounded sample of its records (reads pinned, as training does)."""
    gx = require("great_expectations", purpose="the dataset quality gate")
    E = gx.expectations
    cfg = cfg or GateConfig()
    own = reader is None
    if own:
        from trainforge.datasets.inplace import InPlaceReader, TokenizerSpec, open_data_store

        reader = InPlaceReader(ds.manifest, open_data_store(ds.manifest), sample_len=2, tokenizer_spec=TokenizerSpec())
    try:
        chunks = sample_chunks(len(reader.chunks), ds.manifest.chunk_bytes)
        documents, meta = _record_frames(ds, reader, chunks)
        read = reader.objects.bytes_read
    finally:
        if own:
            reader.close()
    text = ds.manifest.text_field
    suites: dict[str, list[Any]] = {
        "documents": [E.ExpectTableRowCountToBeBetween(min_value=1),
                      E.ExpectColumnValuesToBeInSet(column="_parsed", value_set=[True]),
                      E.ExpectColumnValuesToBeBetween(column="_chars", min_value=1, mostly=1 - cfg.max_empty_rate),
                      E.ExpectColumnProportionOfUniqueValuesToBeBetween(column="_hash",
                                                                        min_value=1 - cfg.max_duplicate_rate)],
        "metadata": [E.ExpectColumnValuesToNotBeNull(column="license"),
                     E.ExpectColumnValuesToNotBeInSet(column="license", value_set=NO_LICENSE)],
    }
    if ds.manifest.format != "text":
        suites["documents"].insert(1, E.ExpectColumnToExist(column=text))
    if team is not None:
        suites["team:documents"] = team.expectations()
    checks = _validate(ds.name, {"documents": documents, "metadata": meta}, suites)
    return _report(ds, checks, documents_checked=len(documents), chunks_checked=len(chunks),
                   bytes_read=read, config=asdict(cfg),
                   sample={"max_bytes": SAMPLE_BYTES, "max_chunks": SAMPLE_CHUNKS},
                   **({"team_suite": {"path": team.path, "sha256": team.digest}} if team else {}))
