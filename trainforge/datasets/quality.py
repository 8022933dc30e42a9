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
import logging
from dataclasses import asdict, dataclass
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


def run_gate(ds: ResolvedDataset, reader: ShardReader | None = None, cfg: GateConfig | None = None) -> dict[str, Any]:
    """Validate a version with great-expectations; returns the JSON-able report ({"passed": bool, ...})."""
    gx = require("great_expectations", purpose="the dataset quality gate")

    cfg = cfg or GateConfig()
    if reader is None:
        from trainforge.datasets.stream import open_reader

        reader = open_reader(ds.path, ds.manifest)
    frames = dict(zip(("shards", "samples", "metadata"), _frames(ds, reader, cfg), strict=True))
    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = {"globally": False}  # type: ignore[assignment]
    source = context.data_sources.add_pandas(name="trainforge")
    checks: list[dict[str, Any]] = []
    for batch_name, expectations in _suites(ds, cfg).items():
        batch_def = source.add_dataframe_asset(name=batch_name).add_batch_definition_whole_dataframe("all")
        batch = batch_def.get_batch(batch_parameters={"dataframe": frames[batch_name]})
        suite = gx.ExpectationSuite(name=f"{ds.name}-{batch_name}")
        for e in expectations:
            suite.add_expectation(e)
        result = batch.validate(suite).to_json_dict()
        for r in result["results"]:
            cfg_ = r["expectation_config"]
            res = r.get("result", {})
            checks.append({"batch": batch_name, "expectation": cfg_["type"], "column": cfg_["kwargs"].get("column"),
                           "success": bool(r["success"]), "observed": res.get("observed_value"),
                           "unexpected_count": res.get("unexpected_count"),
                           "examples": res.get("partial_unexpected_list", [])[:5]})
    failed = [c for c in checks if not c["success"]]
    return {"passed": not failed, "name": ds.name, "version": ds.version, "checks": checks,
            "failures": [f"{c['batch']}: {c['expectation']}({c['column']}) observed={c['observed']} "
                         f"unexpected={c['unexpected_count']} e.g. {c['examples']}" for c in failed],
            "samples_checked": len(frames["samples"]), "config": asdict(cfg), "great_expectations": gx.__version__}
