"""A gang on other machines gets the code, dataset and initial weights through the object store (tasks/inputs.py
publishes them, trainer/inputs.py fetches them into the node's folder): the node's copies are the flow's, byte for
byte; a fetch is checked against its hash; nothing is fetched twice; the flow's paths are never read again."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.segment_configs import segment_config
from trainforge.contract.config import SegmentConfig
from trainforge.datasets.catalog import EmbeddedCatalog, load_version_dir
from trainforge.datasets.demo import tiny_dataset
from trainforge.datasets.stream import CacheConfig, open_reader
from trainforge.infra.storage import open_store
from trainforge.tasks.inputs import InputsError, code_tar, publish_inputs
from trainforge.trainer.inputs import InputsFetchError, localize


def code_folder(root: Path) -> Path:
    code = root / "code"
    (code / "pkg").mkdir(parents=True)
    (code / "pkg" / "model.py").write_text("def build(cfg):\n    return 1\n")
    (code / "train.sh").write_text("#!/bin/sh\n")
    os.chmod(code / "train.sh", 0o755)
    for skipped in (".git", "pkg/__pycache__", ".venv"):
        (code / skipped).mkdir(parents=True)
        (code / skipped / "junk").write_text("not shipped")
    (code / "pkg" / "model.pyc").write_bytes(b"\0")
    return code


@pytest.fixture
def flow(tmp_path: Path) -> SegmentConfig:
    """A job's config as the flow makes it: every input a path on the flow's disk, the store a folder."""
    flow_disk = tmp_path / "flow"
    ds = tiny_dataset(EmbeddedCatalog(flow_disk / "catalog"), "ds-in", num_samples=40, sample_len=9, seed=5)
    weights = flow_disk / "init.safetensors"
    weights.write_bytes(os.urandom(4096))
    return segment_config(storage_url=(tmp_path / "store").as_uri(), code_dir=str(code_folder(flow_disk)),
                          init_weights=str(weights), run_dir=str(flow_disk / "run"),
                          dataset={"ref": "catalog://ds-in@main", "name": "ds-in", "version": ds.version,
                                   "path": str(ds.path)})


def test_the_code_tar_depends_only_on_the_tree(tmp_path: Path) -> None:
    code = code_folder(tmp_path)
    first = code_tar(code)
    os.utime(code / "pkg" / "model.py", (1, 1))  # a touched file, same content
    assert code_tar(code) == first
    (code / "pkg" / "model.py").write_text("def build(cfg):\n    return 2\n")
    assert code_tar(code) != first


def test_a_node_gets_the_flows_inputs_byte_for_byte_and_never_reads_the_flows_disk(
        tmp_path: Path, flow: SegmentConfig) -> None:
    published = publish_inputs(flow)
    assert published.inputs is not None and published.inputs.init_weights is not None
    store = open_store(flow.storage_url)
    job = flow.storage_prefix
    assert store.exists(f"{job}/{published.inputs.code}") and store.exists(f"{job}/{published.inputs.init_weights}")
    assert published.inputs.dataset_prefix.startswith(f"{job}/inputs/datasets/ds-in/versions/")
    original_rows = open_reader(Path(flow.dataset.path), load_version_dir(Path(flow.dataset.path), "x").manifest)
    expected = original_rows.get(list(range(40)))
    init_bytes = Path(flow.init_weights or "").read_bytes()

    shutil.rmtree(tmp_path / "flow")  # the node has none of the flow's paths
    node = published.for_node(str(tmp_path / "node" / "job"))
    local = localize(node)
    assert local.inputs is None and local.staging_dir == str(tmp_path / "node" / "job" / "staging")
    assert local.run_dir == str(tmp_path / "node" / "job" / "run")
    code = Path(local.code_dir)
    assert code.is_relative_to(tmp_path / "node") and (code / "pkg" / "model.py").read_text().endswith("return 1\n")
    assert os.access(code / "train.sh", os.X_OK)
    shipped = {str(p.relative_to(code)) for p in code.rglob("*")}
    assert shipped == {"pkg", "pkg/model.py", "train.sh"}, "history, caches and environments stay behind"
    assert Path(local.init_weights or "").read_bytes() == init_bytes
    data = Path(local.dataset.path)
    assert data.is_relative_to(tmp_path / "node")
    ds = load_version_dir(data, local.dataset.ref)
    assert ds.version == flow.dataset.version
    cache = CacheConfig(local_dir=tmp_path / "node" / "cache", local_max_bytes=None)
    assert np.array_equal(open_reader(data, ds.manifest, cache).get(list(range(40))), expected)

    # Another rank, a torchrun restart, a later segment: the node's copies, nothing fetched again.
    shutil.rmtree(tmp_path / "store" / job / "inputs" / "code")
    assert localize(node).code_dir == local.code_dir


def test_publishing_twice_uploads_nothing_new(tmp_path: Path, flow: SegmentConfig) -> None:
    first = publish_inputs(flow)
    keys = set(open_store(flow.storage_url).list(""))
    assert publish_inputs(flow) == first and set(open_store(flow.storage_url).list("")) == keys


def test_a_fetched_input_that_is_not_what_the_config_names_is_refused(tmp_path: Path, flow: SegmentConfig) -> None:
    published = publish_inputs(flow)
    assert published.inputs is not None
    open_store(flow.storage_url).put_bytes(f"{flow.storage_prefix}/{published.inputs.code}", b"tampered")
    node = published.for_node(str(tmp_path / "node"))
    with pytest.raises(InputsFetchError, match="sha256"):
        localize(node)
    assert not (tmp_path / "node" / "inputs" / "code" / published.inputs.code_sha256).exists()


def test_a_config_without_inputs_is_read_where_it_is(flow: SegmentConfig) -> None:
    assert localize(flow) is flow


def test_a_code_folder_too_big_to_ship_is_refused_saying_what_to_do(tmp_path: Path) -> None:
    code = code_folder(tmp_path)
    (code / "weights.bin").write_bytes(b"\0" * 2048)
    with pytest.raises(InputsError, match="code.repo"):
        code_tar(code, max_bytes=1024)


def hosts_cluster(**launcher: object) -> dict:
    return {"name": "two-machines", "launcher": {"backend": "hosts", **launcher},
            "node_groups": [{"name": "g", "gpu_type": "cpu", "nodes": 2, "gpus_per_node": 1,
                             "hosts": [{"name": "m1", "address": "10.9.0.1"}, {"name": "m2", "address": "10.9.0.2"}]}]}


def test_a_hosts_job_whose_store_is_a_folder_here_is_refused_before_anything_is_allocated(
        tmp_path: Path, flow: SegmentConfig) -> None:
    from trainforge.tasks import steps
    from trainforge.tasks.chaos import chaos_cluster
    from trainforge.tasks.prepare import JobRejected

    with chaos_cluster(hosts_cluster()), pytest.raises(JobRejected, match="TRAINFORGE_STORAGE_URL to an s3://"):
        steps.publish_inputs.fn(flow)
    assert not (tmp_path / "store").exists(), "nothing published"
    with chaos_cluster(hosts_cluster(shared_filesystem=True)):  # every host mounts the folder: it is one store
        assert steps.publish_inputs.fn(flow).inputs is not None
    assert steps.publish_inputs.fn(flow) is flow  # one host (the local backend): read where it is


def test_only_a_store_every_host_reaches_passes_for_a_hosts_job() -> None:
    from trainforge.plan.cluster import LauncherSpec
    from trainforge.tasks.prepare import JobRejected, check_store_reaches_nodes

    hosts = LauncherSpec(backend="hosts")
    for here in ("/var/store", "file:///var/store", "store"):  # every form open_store takes for a folder
        with pytest.raises(JobRejected, match="shared_filesystem"):
            check_store_reaches_nodes(here, hosts)
    check_store_reaches_nodes("s3://bucket/root", hosts)
    check_store_reaches_nodes("/var/store", LauncherSpec(backend="hosts", shared_filesystem=True))
    check_store_reaches_nodes("/var/store", LauncherSpec())  # one host


def test_a_missing_input_is_the_platforms_fault_named_with_its_key_and_store(tmp_path: Path,
                                                                             flow: SegmentConfig) -> None:
    published = publish_inputs(flow)
    assert published.inputs is not None
    store = open_store(flow.storage_url)
    store.delete(f"{flow.storage_prefix}/{published.inputs.init_weights}")
    with pytest.raises(InputsFetchError, match=r"inputs/init/.*from file://.*resubmit") as gone:
        localize(published.for_node(str(tmp_path / "node")))
    assert gone.value.the_jobs  # gone from the store: every node would fail so, no host is to blame
    assert not list((tmp_path / "node" / "inputs" / "init").glob("*")), "nothing half-fetched is left"


def test_a_store_a_node_cannot_read_is_the_nodes_fault_not_the_jobs(tmp_path: Path, flow: SegmentConfig,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from trainforge.infra.storage import LocalObjectStore, PermissionDeniedError

    published = publish_inputs(flow)

    def refused(self, key, *args, **kwargs):
        raise PermissionDeniedError(f"access denied: {key}")

    monkeypatch.setattr(LocalObjectStore, "get_bytes", refused)
    with pytest.raises(InputsFetchError, match="PermissionDeniedError") as refusal:
        localize(published.for_node(str(tmp_path / "node")))
    assert not refusal.value.the_jobs


def test_an_in_place_version_ships_its_manifest_and_tokenizer_and_its_grant_reads_the_prefix(tmp_path: Path) -> None:
    """An s3:// prefix read in place: the nodes get its manifest (and the job's tokenizer) from the job's prefix,
    the objects stay in their bucket, and the job's identity is granted that bucket prefix to read."""
    from trainforge.datasets.prefix_manifest import PrefixManifest, SourceObject
    from trainforge.datasets.training_data import save_in_place_tokenizer
    from trainforge.infra.storage.iam import grant_from_uris
    from trainforge.tasks.job_credentials import sources

    flow_disk = tmp_path / "flow"
    catalog = EmbeddedCatalog(flow_disk / "catalog")
    manifest = PrefixManifest("s3.corpus.web", "s3://corpus/web", "", "jsonl", "text", "MIT", 1 << 20, False,
                              (SourceObject("web/a.jsonl", 10, '"e1"'),))
    ds = catalog.commit_prefix(manifest)
    tok = save_in_place_tokenizer(ds.path, '{"model": {"type": "BPE"}, "added_tokens": []}')
    config = segment_config(storage_url=(tmp_path / "store").as_uri(), code_dir=str(code_folder(flow_disk)),
                            run_dir=str(flow_disk / "run"),
                            dataset={"ref": "s3://corpus/web", "name": ds.name, "version": ds.version,
                                     "path": str(ds.path), "tokenizer": tok})
    assert "s3://corpus/web" in sources(config)
    grant = grant_from_uris("s3://jobs/platform", "nlp", "j1", sources(config))
    assert grant is not None and "corpus/web/*" in grant.read_patterns()

    published = publish_inputs(config)
    assert published.inputs is not None and published.inputs.dataset_store == config.storage_url
    assert "s3://corpus/web" in sources(published)  # still granted once the nodes read from the job's prefix
    shutil.rmtree(flow_disk)
    local = localize(published.for_node(str(tmp_path / "node" / "job")))
    folder = Path(local.dataset.path)
    got = load_version_dir(folder, "x")
    assert got.in_place and got.version == ds.version and got.manifest == manifest
    assert (folder / "tokenizers" / f"{tok.rsplit(':', 1)[1]}.json").is_file()
    import json

    assert json.loads((folder / "source.json").read_text()) == {"store_url": "s3://corpus", "prefix": "web"}
