"""The lineage store: which data every checkpoint and model version was trained on (the legal use case).

A small graph in SQL (SQLAlchemy Core): SQLite in $TRAINFORGE_HOME/lineage.db by default, PostgreSQL in production
($TRAINFORGE_LINEAGE_URL, e.g. `postgresql+psycopg2://user@host/db`). Written by the train-job flow's tasks as
things happen; read by `trainforge lineage ...`, the `lineage-query` flow and this module's functions.

Nodes (`kind:key`):
  dataset:{name}@{version}      license, license class, provenance; its files in `lineage_files`
  job:{job_id}                  team, code commit, config hash, MLflow run
  checkpoint:{job_id}@{step}    a committed checkpoint
  model:{name}/{version}        an MLflow model version
Edges point from the thing that depends to what it depends on (`src` depends on `dst`):
  job        trained-on      dataset
  checkpoint produced-by     job
  job        resumed-from    checkpoint     (a segment that restarted from a committed checkpoint)
  job        fine-tuned-from checkpoint | model
  model      promoted-as     checkpoint     (read: the checkpoint was promoted as the model version)
So "everything upstream of X" is the transitive closure along edges, and "everything trained on dataset D, directly
or through fine-tuning" is the closure in the other direction. Both are one recursive CTE (SQLite and PostgreSQL).

Removal: `withdraw_dataset` marks a dataset version withdrawn; `quarantine` marks every affected checkpoint and
model version, with who and why; `check_usable` refuses quarantined nodes and anything trained on withdrawn data
(promotion and loading call it); `withdrawal` says who withdrew a version, when and why (dataset resolution calls
it: a withdrawn version resolves for no job); `trained_on_report` lists what was trained on a version with each
model's checkpoint, marked withdrawn. lineage_withdrawal.py adds the MLflow tags.
"""

from __future__ import annotations

import fnmatch
import json
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import (
    JSON,
    Column,
    Float,
    ForeignKey,
    Index,
    MetaData,
    String,
    Table,
    Text,
    and_,
    create_engine,
    event,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from trainforge.home import current_user, home

ENV_URL = "TRAINFORGE_LINEAGE_URL"
NODE_KINDS = ("dataset", "job", "checkpoint", "model", "weights")  # weights: a base model from outside
EDGE_KINDS = ("trained-on", "produced-by", "resumed-from", "fine-tuned-from", "promoted-as")
STATUSES = ("active", "withdrawn", "quarantined")

metadata = MetaData()

nodes = Table(
    "lineage_nodes", metadata,
    Column("id", String(512), primary_key=True),
    Column("kind", String(16), nullable=False, index=True),
    Column("name", String(256), nullable=False, index=True),  # dataset, job id, job id, registered model
    Column("version", String(128), nullable=False, default=""),  # dataset version, '', step, model version
    Column("team", String(128), nullable=False, default=""),
    Column("license", String(128), nullable=False, default=""),
    Column("license_class", String(32), nullable=False, default=""),
    Column("status", String(16), nullable=False, default="active"),
    Column("attrs", JSON, nullable=False, default=dict),
    Column("created_at", Float, nullable=False),
)
edges = Table(
    "lineage_edges", metadata,
    Column("src", String(512), ForeignKey("lineage_nodes.id"), primary_key=True),
    Column("kind", String(32), primary_key=True),
    Column("dst", String(512), ForeignKey("lineage_nodes.id"), primary_key=True),
    Column("created_at", Float, nullable=False),
    Index("lineage_edges_dst", "dst"),
)
files = Table(
    "lineage_files", metadata,
    Column("node", String(512), ForeignKey("lineage_nodes.id"), primary_key=True),
    Column("path", String(2048), primary_key=True),
    Column("sha256", String(64), nullable=False, default=""),
    Index("lineage_files_path", "path"),
)
audit = Table(
    "lineage_audit", metadata,
    Column("seq", String(40), primary_key=True),
    Column("node", String(512), nullable=False, index=True),
    Column("action", String(32), nullable=False),
    Column("who", String(128), nullable=False),
    Column("why", Text, nullable=False),
    Column("at", Float, nullable=False),
)

# ------------------------------------------------------------------------------------------ pure helpers

# SPDX ids (and common spellings) by class; `license_class` falls back to "unknown". Legal asks by class.
_LICENSE_CLASSES: dict[str, tuple[str, ...]] = {
    "public-domain": ("CC0-*", "Unlicense", "PDDL-*", "public-domain"),
    "permissive": ("MIT", "Apache-*", "BSD-*", "PSF-*", "Python-*", "ISC", "Zlib", "CC-BY-[0-9]*", "ODC-By-*"),
    "non-commercial": ("CC-BY-NC*", "*-NC-*", "*NonCommercial*", "research-only*"),
    "copyleft": ("GPL-*", "AGPL-*", "LGPL-*", "MPL-*", "CC-BY-SA-*", "ODbL-*", "EPL-*"),
    "proprietary": ("proprietary*", "internal*", "LicenseRef-*"),
}
_CLASS_ORDER = ("non-commercial", "copyleft", "public-domain", "permissive", "proprietary")


def license_class(license_id: str) -> str:
    """The class of a license id: public-domain, permissive, copyleft, non-commercial, proprietary or unknown.
    Non-commercial is tested first: CC-BY-NC-SA is non-commercial before it is share-alike."""
    for cls in _CLASS_ORDER:
        if any(fnmatch.fnmatchcase(license_id.lower(), p.lower()) for p in _LICENSE_CLASSES[cls]):
            return cls
    return "unknown"


def dataset_id(name: str, version: str) -> str:
    return f"dataset:{name}@{version}"


def job_id_node(job_id: str) -> str:
    return f"job:{job_id}"


def checkpoint_id(job_id: str, step: int) -> str:
    return f"checkpoint:{job_id}@{int(step)}"


def model_id(name: str, version: str | int) -> str:
    return f"model:{name}/{version}"


def weights_id(source: str, sha256: str) -> str:
    """A base model from outside the platform (a Hugging Face folder): where it was read, and what it held."""
    return f"weights:{source}@{sha256[:16]}"


def parse_target(text: str) -> str:
    """A node id from what users type: `models:/name/3`, `model:name/3`, `name/3` (model version),
    `JOB@STEP` or `checkpoint:JOB@STEP`, `job:ID`, `dataset:NAME@VERSION`."""
    if text.startswith("models:/"):
        return "model:" + text.removeprefix("models:/")
    if text.split(":", 1)[0] in NODE_KINDS:
        return text
    if "@" in text and text.rsplit("@", 1)[1].isdigit():
        return "checkpoint:" + text
    if "/" in text and text.rsplit("/", 1)[1].isdigit():
        return "model:" + text
    return "job:" + text


# manifests whose tokenizer travels as the version's tokenizer.json (datasets/tokenizer.py: ships_json); written
# out here because the lineage store does not import the data pipeline
_TOKENIZER_FILE_PREFIXES = ("bpe:sha256:", "hf:sha256:")


def dataset_files_of(manifest: Mapping[str, Any], path: str = "") -> list[tuple[str, str]]:
    """(path, sha256) of what a dataset version contains: its shards (under its path), the tokenizer.json it was
    tokenized with (a BPE or pretrained one; its sha256 is the digest in the manifest's tokenizer id) and, where its
    provenance lists them, the source files and folder it was built from (so a query by source file or prefix finds
    it)."""
    if manifest.get("kind") == _IN_PLACE_KIND:
        return _in_place_files(manifest)
    out = []
    base = path.rstrip("/")
    for shard in manifest.get("shards", []):
        out.append((f"{base}/{shard['file']}" if base else shard["file"], shard.get("sha256", "")))
    tok = str(manifest.get("tokenizer", ""))
    if tok.startswith(_TOKENIZER_FILE_PREFIXES):
        out.append((f"{base}/tokenizer.json" if base else "tokenizer.json", tok.rsplit(":", 1)[1]))
    prov = manifest.get("provenance") or {}
    if isinstance(prov.get("source"), str) and ("/" in prov["source"] or "://" in prov["source"]):
        out.append((prov["source"], ""))
    for key in ("source_files", "sources", "files"):
        if isinstance(prov.get(key), list):
            out.extend((str(p), "") for p in prov[key] if isinstance(p, str))
    return sorted(set(out))


_IN_PLACE_KIND = "s3-prefix"  # datasets/prefix_manifest.py KIND (not imported: lineage does not import the pipeline)


def _in_place_files(manifest: Mapping[str, Any]) -> list[tuple[str, str]]:
    """An s3:// prefix read in place: the prefix itself and every object as `s3://bucket/key`, with its ETag (the
    object store's identity of its bytes, quotes dropped) where shards have their sha256."""
    source = str(manifest.get("source", "")).rstrip("/")
    bucket = source.removeprefix("s3://").partition("/")[0]
    out = [(source, "")]
    out += [(f"s3://{bucket}/{o['key']}", str(o.get("etag", "")).strip('"')) for o in manifest.get("objects", [])]
    return sorted(set(out))


def dataset_provenance(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """What a version was made from: a built version's own provenance, or an in-place prefix's description (the
    prefix, pattern, format, object count, bytes, and whether reads go by version id)."""
    if manifest.get("kind") != _IN_PLACE_KIND:
        return dict(manifest.get("provenance") or {})
    objects = manifest.get("objects", [])
    return {"source": manifest.get("source", ""), "pattern": manifest.get("pattern", ""),
            "format": manifest.get("format", ""), "text_field": manifest.get("text_field", ""),
            "objects": len(objects), "bytes": sum(int(o.get("size", 0)) for o in objects),
            "pinned_by": "version id" if manifest.get("versioned") else "etag", "read": "in place"}


# ------------------------------------------------------------------------------------------ results


@dataclass(frozen=True, slots=True)
class Node:
    id: str
    kind: str
    name: str
    version: str
    team: str = ""
    license: str = ""
    license_class: str = ""
    status: str = "active"
    attrs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "name": self.name, "version": self.version, "team": self.team,
                "license": self.license, "license_class": self.license_class, "status": self.status,
                "attrs": self.attrs}


@dataclass(frozen=True, slots=True)
class Withdrawal:
    """Who withdrew a dataset version, when (epoch seconds) and why: the last `withdrawn` entry of its audit."""

    dataset: str  # the node id, dataset:{name}@{version}
    name: str
    version: str
    who: str
    why: str
    at: float

    def when(self) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.at))


class QuarantinedError(PermissionError):
    """A checkpoint or model version was quarantined (trained on withdrawn data): no promotion, no loading."""


# ------------------------------------------------------------------------------------------ the store


def lineage_url() -> str:
    return os.environ.get(ENV_URL) or f"sqlite:///{home() / 'lineage.db'}"


_ENGINES: dict[str, Engine] = {}
_ENGINES_LOCK = threading.Lock()


def _engine(url: str) -> Engine:
    with _ENGINES_LOCK:
        if url not in _ENGINES:
            if url.startswith("sqlite"):
                eng = create_engine(url, connect_args={"timeout": 30})

                @event.listens_for(eng, "connect")
                def _pragmas(conn: Any, _record: Any) -> None:
                    cur = conn.cursor()
                    cur.execute("PRAGMA journal_mode=WAL")
                    cur.execute("PRAGMA foreign_keys=ON")
                    cur.close()
            else:
                eng = create_engine(url, pool_pre_ping=True)
            metadata.create_all(eng)
            _ENGINES[url] = eng
        return _ENGINES[url]


class LineageStore:
    """The graph. Every write is idempotent (a retried task records the same node or edge again harmlessly)."""

    def __init__(self, url: str | None = None):
        self.url = url or lineage_url()
        self.engine = _engine(self.url)

    # ---------------------------------------------------------------- writes

    def _upsert_node(self, conn: Any, node_id: str, kind: str, name: str, version: str = "", *, team: str = "",
                     license: str = "", attrs: Mapping[str, Any] | None = None) -> None:
        row = conn.execute(select(nodes.c.attrs).where(nodes.c.id == node_id)).first()
        values = {"kind": kind, "name": name, "version": str(version), "team": team}
        if license:
            values |= {"license": license, "license_class": license_class(license)}
        if row is None:
            try:
                with conn.begin_nested():
                    conn.execute(insert(nodes).values(id=node_id, attrs=dict(attrs or {}), created_at=time.time(),
                                                      **{"license": "", "license_class": "", **values}))
                return
            except IntegrityError:  # inserted concurrently: fall through to the update
                row = conn.execute(select(nodes.c.attrs).where(nodes.c.id == node_id)).first()
        merged = {**(row.attrs if row else {}), **(attrs or {})}
        conn.execute(update(nodes).where(nodes.c.id == node_id).values(attrs=merged, **values))

    def _edge(self, conn: Any, src: str, kind: str, dst: str) -> None:
        if kind not in EDGE_KINDS:
            raise ValueError(f"unknown edge kind {kind!r}; one of {', '.join(EDGE_KINDS)}")
        exists = conn.execute(select(edges.c.src).where(and_(edges.c.src == src, edges.c.kind == kind,
                                                             edges.c.dst == dst))).first()
        if exists is None:
            try:
                with conn.begin_nested():
                    conn.execute(insert(edges).values(src=src, kind=kind, dst=dst, created_at=time.time()))
            except IntegrityError:
                pass

    def record_dataset(self, name: str, version: str, *, license: str, ref: str = "", path: str = "",
                       provenance: Mapping[str, Any] | None = None,
                       file_list: Iterable[tuple[str, str]] = (), tokenizer: str = "") -> str:
        node = dataset_id(name, version)
        attrs = {"ref": ref, "path": path, "provenance": dict(provenance or {}), **({"tokenizer": tokenizer}
                                                                                  if tokenizer else {})}
        with self.engine.begin() as conn:
            self._upsert_node(conn, node, "dataset", name, version, license=license, attrs=attrs)
            known = {r.path for r in conn.execute(select(files.c.path).where(files.c.node == node))}
            rows = [{"node": node, "path": p, "sha256": s} for p, s in dict(file_list).items() if p not in known]
            if rows:
                conn.execute(insert(files), rows)
        return node

    def record_job(self, job_id: str, *, team: str, dataset: Mapping[str, Any], code_commit: str = "",
                   config_hash: str = "", mlflow_run_id: str = "", fine_tuned_from: str | None = None,
                   code_repo: str = "") -> str:
        """A job and what it trains on. `dataset` is the flow's resolved dataset (name, version, license, ref,
        path, and the manifest when known); `fine_tuned_from` a node id (checkpoint or model) it starts from."""
        manifest = dataset.get("manifest") or _read_manifest(dataset.get("path", ""))
        ds = self.record_dataset(dataset["name"], dataset["version"], license=dataset.get("license", ""),
                                 ref=dataset.get("ref", ""), path=dataset.get("path", ""),
                                 provenance=dataset_provenance(manifest) if manifest else None,
                                 file_list=dataset_files_of(manifest, dataset.get("path", "")) if manifest else (),
                                 tokenizer=str(manifest.get("tokenizer", "")) if manifest else "")
        node = job_id_node(job_id)
        with self.engine.begin() as conn:
            self._upsert_node(conn, node, "job", job_id, team=team, license=dataset.get("license", ""),
                              attrs={"code_commit": code_commit, "code_repo": code_repo, "config_hash": config_hash,
                                     "mlflow_run_id": mlflow_run_id, "dataset_ref": dataset.get("ref", "")})
            self._edge(conn, node, "trained-on", ds)
            if fine_tuned_from:
                self._require(conn, fine_tuned_from)
                self.check_usable(fine_tuned_from)
                self._edge(conn, node, "fine-tuned-from", fine_tuned_from)
        return node

    def record_weights(self, source: str, sha256: str, *, license: str = "",
                       file_list: Iterable[tuple[str, str]] = ()) -> str:
        """A Hugging Face folder a job starts from (`init_from`): its source, content hash, license and files, so
        a legal query finds every job and model built on it (only dataset versions can be withdrawn today)."""
        node = weights_id(source, sha256)
        with self.engine.begin() as conn:
            self._upsert_node(conn, node, "weights", source, sha256[:16], license=license,
                              attrs={"source": source, "sha256": sha256})
            known = {r.path for r in conn.execute(select(files.c.path).where(files.c.node == node))}
            rows = [{"node": node, "path": p, "sha256": h} for p, h in dict(file_list).items() if p not in known]
            if rows:
                conn.execute(insert(files), rows)
        return node

    def record_checkpoint(self, job_id: str, step: int, *, team: str = "", attrs: Mapping[str, Any] | None = None
                          ) -> str:
        node = checkpoint_id(job_id, step)
        with self.engine.begin() as conn:
            self._upsert_node(conn, node, "checkpoint", job_id, str(step), team=team, attrs=attrs)
            self._require(conn, job_id_node(job_id))
            self._edge(conn, node, "produced-by", job_id_node(job_id))
        return node

    def record_resume(self, job_id: str, step: int) -> None:
        with self.engine.begin() as conn:
            self._upsert_node(conn, checkpoint_id(job_id, step), "checkpoint", job_id, str(step))
            self._edge(conn, checkpoint_id(job_id, step), "produced-by", job_id_node(job_id))
            self._edge(conn, job_id_node(job_id), "resumed-from", checkpoint_id(job_id, step))

    def record_promotion(self, job_id: str, step: int, model_name: str, version: str | int, *, team: str = "",
                         attrs: Mapping[str, Any] | None = None) -> str:
        node = model_id(model_name, version)
        ckpt = checkpoint_id(job_id, step)
        with self.engine.begin() as conn:
            self._upsert_node(conn, ckpt, "checkpoint", job_id, str(step), team=team)
            self._edge(conn, ckpt, "produced-by", job_id_node(job_id))
            self._upsert_node(conn, node, "model", model_name, str(version), team=team, attrs=attrs)
            self._edge(conn, node, "promoted-as", ckpt)
        return node

    def _require(self, conn: Any, node_id: str) -> None:
        if conn.execute(select(nodes.c.id).where(nodes.c.id == node_id)).first() is None:
            raise LookupError(f"lineage has no node {node_id!r}; record it first (a job before its checkpoints, "
                              "a parent before the job fine-tuned from it)")

    # ---------------------------------------------------------------- reads

    def node(self, node_id: str) -> Node:
        with self.engine.connect() as conn:
            row = conn.execute(select(nodes).where(nodes.c.id == node_id)).first()
        if row is None:
            raise LookupError(f"no lineage node {node_id!r}")
        return _node(row)

    def _closure(self, start: list[str], upstream: bool) -> list[Node]:
        """Every node reachable from `start` along edges (upstream: src -> dst), excluding the start nodes."""
        if not start:
            return []
        near, far = (edges.c.src, edges.c.dst) if upstream else (edges.c.dst, edges.c.src)
        seed = select(nodes.c.id.label("id")).where(nodes.c.id.in_(start)).cte("reach", recursive=True)
        step = select(far.label("id")).select_from(edges.join(seed, near == seed.c.id))
        reach = seed.union(step)  # UNION (not ALL): cycles (job -> checkpoint -> job) terminate
        query = select(nodes).where(nodes.c.id.in_(select(reach.c.id))).where(nodes.c.id.not_in(start))
        with self.engine.connect() as conn:
            return sorted((_node(r) for r in conn.execute(query)), key=_sort_key)

    def upstream(self, node_id: str) -> list[Node]:
        self.node(node_id)
        return self._closure([node_id], upstream=True)

    def downstream(self, node_ids: list[str]) -> list[Node]:
        return self._closure(node_ids, upstream=False)

    def datasets_of(self, target: str) -> list[Node]:
        """The dataset versions (with license and provenance) a model version, checkpoint or job depends on,
        directly or through resume and fine-tuning ancestry."""
        return [n for n in self.upstream(parse_target(target)) if n.kind == "dataset"]

    def find_datasets(self, name: str | None = None, version: str | None = None, file: str | None = None,
                      license: str | None = None) -> list[Node]:
        """Dataset versions by name, version (full id or a prefix of it), contained file (exact path, or a
        prefix ending in '/', or a glob) and license (SPDX id, glob, or class)."""
        query = select(nodes).where(nodes.c.kind == "dataset")
        if name:
            query = query.where(nodes.c.name == name)
        if version:
            query = query.where(nodes.c.version.startswith(version, autoescape=True))
        if license:
            query = query.where(or_(nodes.c.license_class == license, nodes.c.license == license)) if not any(
                c in license for c in "*?[") else query
        if file:
            query = query.where(nodes.c.id.in_(select(files.c.node).where(_file_match(file))))
        with self.engine.connect() as conn:
            found = [_node(r) for r in conn.execute(query)]
        if license and any(c in license for c in "*?["):
            found = [n for n in found if fnmatch.fnmatchcase(n.license, license)]
        return sorted(found, key=_sort_key)

    def trained_on(self, name: str | None = None, version: str | None = None, file: str | None = None,
                   kinds: tuple[str, ...] = ("checkpoint", "model")) -> dict[str, Any]:
        """Every checkpoint and model version trained on the matching dataset versions, directly or through
        resume and fine-tuning ancestry."""
        datasets = self.find_datasets(name, version, file)
        affected = [n for n in self.downstream([d.id for d in datasets]) if n.kind in kinds]
        return {"datasets": datasets, "affected": affected}

    def runs_by_license(self, license: str) -> dict[str, Any]:
        """Jobs (runs) that used a dataset of a license class (`non-commercial`), SPDX id or glob (`CC-BY-NC*`)."""
        datasets = self.find_datasets(license=license)
        jobs = [n for n in self.downstream([d.id for d in datasets]) if n.kind == "job"]
        return {"datasets": datasets, "jobs": jobs}

    def withdrawal(self, name: str, version: str) -> Withdrawal | None:
        """The withdrawal of dataset version `name@version` (the full version id), or None if it is not withdrawn
        (or lineage has never seen it)."""
        node_id = dataset_id(name, version)
        with self.engine.connect() as conn:
            row = conn.execute(select(nodes.c.status).where(nodes.c.id == node_id)).first()
            if row is None or row.status != "withdrawn":
                return None
            last = conn.execute(select(audit).where(and_(audit.c.node == node_id, audit.c.action == "withdrawn"))
                                .order_by(audit.c.at.desc(), audit.c.seq.desc()).limit(1)).first()
        if last is None:  # marked withdrawn without an audit entry (hand-edited database): still withdrawn
            return Withdrawal(node_id, name, version, "unknown", "no reason recorded", 0.0)
        return Withdrawal(node_id, name, version, last.who, last.why, last.at)

    def promoted_from(self, model_ids: list[str]) -> dict[str, str]:
        """model node id -> the checkpoint node id it was promoted as."""
        if not model_ids:
            return {}
        query = select(edges.c.src, edges.c.dst).where(and_(edges.c.kind == "promoted-as", edges.c.src.in_(model_ids)))
        with self.engine.connect() as conn:
            return {r.src: r.dst for r in conn.execute(query)}

    def trained_on_report(self, name: str | None = None, version: str | None = None, file: str | None = None
                          ) -> dict[str, list[dict[str, Any]]]:
        """`trained_on` as rows: each dataset with its withdrawal (by, at, why); the jobs trained on it (directly or
        through fine-tuning, whether or not they committed anything); each affected checkpoint and model
        version with `checkpoint` (a model's: the checkpoint it was promoted as), that checkpoint's storage
        `prefix`, and `withdrawn` (the withdrawn dataset versions among those queried it was trained on)."""
        result = self.trained_on(name, version, file, kinds=("job", "checkpoint", "model"))
        jobs = [n.to_dict() for n in result["affected"] if n.kind == "job"]
        result["affected"] = [n for n in result["affected"] if n.kind != "job"]
        datasets: list[dict[str, Any]] = []
        tainted: dict[str, list[str]] = {}
        for d in result["datasets"]:
            w = self.withdrawal(d.name, d.version)
            datasets.append(d.to_dict() | {"withdrawn_by": w.who if w else "", "withdrawn_at": w.when() if w else "",
                                           "withdrawn_why": w.why if w else ""})
            if w:
                for n in self.downstream([d.id]):
                    tainted.setdefault(n.id, []).append(f"{d.name}@{d.version}")
        affected = result["affected"]
        promoted = self.promoted_from([n.id for n in affected if n.kind == "model"])
        by_id = {n.id: n for n in affected}
        rows = []
        for n in affected:
            ckpt = promoted.get(n.id, "") if n.kind == "model" else n.id
            ckpt_node = by_id.get(ckpt)
            rows.append(n.to_dict() | {"checkpoint": ckpt.removeprefix("checkpoint:"),
                                       "prefix": (ckpt_node.attrs.get("prefix", "") if ckpt_node else ""),
                                       "withdrawn": ", ".join(sorted(tainted.get(n.id, [])))})
        return {"datasets": datasets, "jobs": jobs, "affected": rows}

    def history(self, node_id: str) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(audit).where(audit.c.node == node_id).order_by(audit.c.at, audit.c.seq))
            return [{"node": r.node, "action": r.action, "who": r.who, "why": r.why, "at": r.at} for r in rows]

    # ---------------------------------------------------------------- removal workflow

    def withdraw_dataset(self, name: str, version: str, *, who: str | None = None, why: str,
                         quarantine: bool = False) -> dict[str, Any]:
        """Mark a dataset version withdrawn and list what was trained on it; with `quarantine`, block those
        checkpoints and model versions from promotion and loading. Recorded with who and why."""
        if not why.strip():
            raise ValueError("say why the dataset version is withdrawn (it is recorded for the audit)")
        who = who or current_user()
        datasets = self.find_datasets(name, version)
        if not datasets:
            raise LookupError(f"no dataset version {name}@{version} in the lineage store")
        if len(datasets) > 1:
            raise LookupError(f"{name}@{version} matches {len(datasets)} versions: give more of the version id")
        ds = datasets[0]
        with self.engine.begin() as conn:
            conn.execute(update(nodes).where(nodes.c.id == ds.id).values(status="withdrawn"))
            _audit(conn, ds.id, "withdrawn", who, why)
        result = self.trained_on(name, ds.version)
        if quarantine:
            self.quarantine([n.id for n in result["affected"]], who=who, why=f"trained on withdrawn {ds.id}: {why}")
            result = self.trained_on(name, ds.version)
        return result

    def quarantine(self, node_ids: list[str], *, who: str | None = None, why: str) -> None:
        who = who or current_user()
        with self.engine.begin() as conn:
            for node_id in node_ids:
                conn.execute(update(nodes).where(nodes.c.id == node_id).values(status="quarantined"))
                _audit(conn, node_id, "quarantined", who, why)

    def check_usable(self, target: str, must_exist: bool = False) -> None:
        """Raise QuarantinedError if the node, or anything it was trained from, is quarantined or withdrawn
        (LookupError if `must_exist` and lineage has never seen it)."""
        node_id = parse_target(target)
        with self.engine.connect() as conn:
            row = conn.execute(select(nodes).where(nodes.c.id == node_id)).first()
        if row is None:
            if must_exist:
                raise LookupError(f"lineage has no {node_id!r}: a job can only start from a checkpoint or model "
                                  "version the platform trained or registered")
            return  # never recorded: nothing is known against it
        blocked = [n for n in [_node(row), *self._closure([node_id], upstream=True)]
                   if n.status in ("quarantined", "withdrawn")]
        if blocked:
            reasons = "; ".join(f"{n.id} is {n.status}" + _last_why(self.history(n.id)) for n in blocked[:5])
            raise QuarantinedError(f"{node_id} may not be promoted or loaded: {reasons}")


def _node(row: Any) -> Node:
    return Node(row.id, row.kind, row.name, row.version, row.team, row.license, row.license_class, row.status,
                dict(row.attrs or {}))


def _sort_key(n: Node) -> tuple[int, str, int, str]:
    return (NODE_KINDS.index(n.kind), n.name, int(n.version) if n.version.isdigit() else 0, n.version)


def _file_match(pattern: str) -> Any:
    if any(c in pattern for c in "*?["):
        like = pattern.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_").replace("*", "%")
        return files.c.path.like(like.replace("?", "_"), escape="\\")
    if pattern.endswith("/"):
        return files.c.path.startswith(pattern, autoescape=True)
    return or_(files.c.path == pattern, files.c.path.startswith(pattern + "/", autoescape=True),
               files.c.path.endswith("/" + pattern, autoescape=True), files.c.sha256 == pattern)


def _audit(conn: Any, node_id: str, action: str, who: str, why: str) -> None:
    conn.execute(insert(audit).values(seq=f"{time.time_ns():020d}-{os.urandom(4).hex()}", node=node_id,
                                      action=action, who=who, why=why, at=time.time()))


def _last_why(history: list[dict[str, Any]]) -> str:
    return f" ({history[-1]['who']}: {history[-1]['why']})" if history else ""


def _read_manifest(path: str) -> dict[str, Any] | None:
    if not path:
        return None
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def node_table(items: list[Node]) -> list[dict[str, Any]]:
    """Rows for tables and JSON output."""
    return [n.to_dict() for n in items]
