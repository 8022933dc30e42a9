"""`trainforge datasets`: build, list, show, tag and check dataset versions.

    trainforge datasets build SOURCE --out catalog://NAME[@BRANCH] (or file://DIR) --license SPDX [--seq-len N]
                              [--text-field F] [--workers N] [--no-pack] [--skip-bad] [--no-gate] [--json]
    trainforge datasets list [--json]
    trainforge datasets show NAME[@REF] [--json]
    trainforge datasets tag NAME[@REF] TAG [--json]
    trainforge datasets check NAME[@REF] | s3://BUCKET/PREFIX [--expectations SUITE.json] [--format F]
                              [--text-field F] [--license SPDX] [--json]

Exit status: 0 ok, 1 bad input rows / failed quality gate / unknown dataset, 2 unreadable source or bad arguments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from trainforge.cli import app, new_typer
from trainforge.commands.choices import InPlaceFormat
from trainforge.commands.common import EXIT_INVALID, EXIT_UNREADABLE, console, err_console, fail, print_json

datasets_app = new_typer("Build, list, show and tag versioned datasets.")
app.add_typer(datasets_app, name="datasets")


def _tokenizer_option(value: str) -> str:
    """--tokenizer: byte, bpe, or an existing tokenizer.json (or a folder holding one); anything else is a usage
    error naming the option, before the source is read."""
    from trainforge.datasets.tokenizer import tokenizer_file

    try:
        if value in ("byte", "bpe") or tokenizer_file(Path(value)).is_file():
            return value
    except OSError:  # an over-long name
        pass
    raise typer.BadParameter(f"'{value}' is not byte, bpe or the path of a Hugging Face tokenizer.json (or of a "
                             "model folder holding one)")


def _split(ref: str) -> tuple[str, str]:
    ref = ref.removeprefix("catalog://")
    name, _, branch = ref.partition("@")
    return name, branch or "main"


@datasets_app.command("build")
def build(
    source: Path = typer.Argument(..., help="A text/JSONL/Parquet file or a folder of them."),
    out: str = typer.Option(..., "--out", help="catalog://NAME[@BRANCH] (or NAME[@BRANCH]) or file://DIR."),
    license: str = typer.Option(..., "--license", help="The data's license (SPDX id); recorded in every run."),
    seq_len: int = typer.Option(1024, help="Tokens per training sequence (samples hold seq_len + 1)."),
    text_field: str = typer.Option("text", help="JSONL key / Parquet column holding the text."),
    workers: int = typer.Option(0, help="Tokenizer processes (0 = all cores)."),
    pack: bool = typer.Option(True, "--pack/--no-pack", help="Pack documents into full samples (else pad each)."),
    skip_bad: bool = typer.Option(False, "--skip-bad", help="Leave bad rows out instead of failing."),
    max_shard_mb: float = typer.Option(64.0, help="Upper bound on a shard's size."),
    gate: bool = typer.Option(True, "--gate/--no-gate", help="Run the quality gate before moving the branch."),
    tokenizer: str = typer.Option("byte", callback=_tokenizer_option, help="byte: built in; bpe: trained on SOURCE; or the path of a Hugging "
                                  "Face tokenizer.json (or a model folder holding one). bpe and a file are saved "
                                  "with the version, and their digest is part of its id."),
    vocab_size: int = typer.Option(8192, help="BPE vocabulary size (--tokenizer bpe)."),
    as_json: bool = typer.Option(False, "--json", help="Print the version's summary (or the error) as JSON."),
) -> None:
    """Tokenize SOURCE in parallel into a new immutable dataset version.

    \b
    Examples:
      trainforge datasets build corpus.jsonl --out catalog://web-text --license CC-BY-4.0
      trainforge datasets build docs/ --out catalog://docs@staging --license MIT --tokenizer bpe
      trainforge datasets build chat.jsonl --out catalog://chat --license MIT --tokenizer ./llama-folder/
    """
    from trainforge.datasets.build import BuildConfig, BuildError, build_dataset, build_version_dir
    from trainforge.datasets.catalog import CatalogError, EmbeddedCatalog

    if seq_len < 1:
        fail(f"--seq-len must be positive, got {seq_len}", EXIT_UNREADABLE)
    cfg = BuildConfig(license=license, seq_len=seq_len, text_field=text_field, num_workers=workers, pack=pack,
                      skip_bad=skip_bad, max_shard_bytes=int(max_shard_mb * 2**20), tokenizer=tokenizer,
                      vocab_size=vocab_size)
    report: dict[str, Any] | None = None
    try:
        if out.startswith("file://"):
            path = Path(out.removeprefix("file://")).resolve()
            ds = build_version_dir(source, path, path.name.lower(), cfg)
            if gate:
                report = _gate(ds)
        else:
            name, branch = _split(out)
            catalog = EmbeddedCatalog()
            ds = build_dataset(source, name, cfg, catalog=catalog, ref=None if gate else branch)
            if gate:
                report = _gate(ds)
                catalog.put_quality(ds.name, ds.version, report)
                if report["passed"]:
                    catalog.set_ref(name, branch, ds.version)
    except BuildError as exc:
        code = EXIT_UNREADABLE if "does not exist" in str(exc) or "holds no" in str(exc) else EXIT_INVALID
        fail(str(exc), code)
    except CatalogError as exc:
        fail(str(exc), EXIT_UNREADABLE)
    summary = _summary(ds)
    summary["quality"] = None if report is None else {"passed": report["passed"], "failures": report["failures"]}
    gate_failed = report is not None and not report["passed"]
    gate_error = f"version {ds.version[:12]} failed its quality gate; no branch was moved"
    if as_json:
        if gate_failed:  # one JSON object: the summary and the error
            fail(gate_error, extra=summary)
        print_json(summary)
    else:
        console.print(f"[green]built[/] {escape(ds.name)} version [bold]{ds.version[:12]}[/] "
                      f"({summary['num_samples']} samples, {summary['num_shards']} shards, {summary['bytes']} bytes)")
        p = ds.manifest.provenance
        console.print(f"  documents {p.get('documents')}, tokens {p.get('tokens')}, "
                      f"skipped rows {p.get('skipped_rows')}; license {escape(ds.license)}")
    if gate_failed:
        for f in report["failures"]:
            err_console.print(f"  [red]✗[/] {escape(f)}")
        fail(gate_error)


def _gate(ds: Any) -> dict[str, Any]:
    from trainforge.datasets.quality import run_gate

    return run_gate(ds)


def _summary(ds: Any) -> dict[str, Any]:
    m = ds.manifest
    if ds.in_place:  # a pinned s3:// prefix: objects read in place, tokenized by each job as it trains
        return {"name": ds.name, "version": ds.version, "ref": ds.ref, "path": str(ds.path), "license": ds.license,
                "num_samples": "counted while read", "num_shards": 0, "bytes": m.total_bytes,
                "sample_len": "seq_len + 1 of each job", "token_dtype": "-", "vocab_size": "-",
                "tokenizer": "each job's", "features": {}, "source": m.source, "pattern": m.pattern,
                "format": m.format, "text_field": m.text_field, "objects": len(m.objects),
                "pinned_by": "version id" if m.versioned else "etag", "chunk_bytes": m.chunk_bytes,
                "provenance": {"source": m.source, "read": "in place"}}
    return {"name": ds.name, "version": ds.version, "ref": ds.ref, "path": str(ds.path), "license": ds.license,
            "num_samples": m.num_samples, "num_shards": len(m.shards), "bytes": sum(s.bytes for s in m.shards),
            "sample_len": m.sample_len, "token_dtype": m.token_dtype, "vocab_size": m.vocab_size,
            "tokenizer": m.tokenizer, "features": m.features, "provenance": m.provenance}


@datasets_app.command("list")
def list_(as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """Datasets in the catalog, with their branches and tags."""
    from trainforge.datasets.catalog import EmbeddedCatalog

    catalog = EmbeddedCatalog()
    rows = [{"name": n, "versions": len(catalog.versions(n)), **catalog.refs(n)} for n in catalog.names()]
    if as_json:
        print_json(rows)
        return
    if not rows:
        console.print(f"no datasets in {escape(catalog.store.url)}")
    for r in rows:
        refs = ", ".join([f"{b}={v[:12]}" for b, v in r["branches"].items()]
                         + [f"tag {t}={v[:12]}" for t, v in r["tags"].items()])
        console.print(f"{escape(r['name'])}  ({r['versions']} version(s))  {escape(refs)}")


@datasets_app.command("show")
def show(ref: str = typer.Argument(..., help="NAME[@REF]: a branch, tag or version id (prefix)."),
         as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """One version: manifest summary, provenance and quality report."""
    from trainforge.datasets.catalog import CatalogError, EmbeddedCatalog

    name, at = _split(ref)
    catalog = EmbeddedCatalog()
    try:
        ds = catalog.resolve(name, at)
    except CatalogError as exc:
        fail(str(exc))
    summary = _summary(ds)
    summary["quality"] = catalog.get_quality(ds.name, ds.version)
    if as_json:
        print_json(summary)
        return
    for key in ("name", "version", "license", "num_samples", "num_shards", "bytes", "sample_len", "token_dtype",
                "vocab_size", "tokenizer"):
        console.print(f"{key:12} {escape(str(summary[key]))}")
    q = summary["quality"]
    console.print(f"{'quality':12} " + ("not checked" if q is None else "passed" if q["passed"] else
                                          "FAILED: " + escape("; ".join(q["failures"]))))


@datasets_app.command("check")
def check(ref: str = typer.Argument(..., help="NAME[@REF] in the catalog, or an s3:// prefix (pinned now)."),
          expectations: Path | None = typer.Option(None, help="A team's great-expectations suite (JSON) to run "
                                                   "with the built-in expectations."),
          format: InPlaceFormat = typer.Option(InPlaceFormat.jsonl, help="s3:// prefixes: how the objects are read."),
          text_field: str = typer.Option("text", help="s3:// prefixes: the JSON field or column with the text."),
          license: str | None = typer.Option(None, help="s3:// prefixes: the data's SPDX license (required)."),
          as_json: bool = typer.Option(False, "--json", help="Print the report as JSON.")) -> None:
    """Run the quality gate on a version and store its report with it: a job trains only on a version whose
    report passed. An s3:// prefix is pinned first (checked on a bounded sample of its records)."""
    from trainforge.datasets.catalog import CatalogError, EmbeddedCatalog
    from trainforge.datasets.gate import load_suite, run_and_store
    from trainforge.datasets.quality import SuiteError

    try:
        team = load_suite(str(expectations), Path.cwd()) if expectations else None
        if ref.startswith("s3://"):
            if not license:
                fail("an s3:// prefix needs --license (its SPDX id): the data has no manifest to take it from",
                     EXIT_UNREADABLE)
            from trainforge.datasets.pin_prefix import pin_prefix
            from trainforge.spec import DatasetSpec

            ds = pin_prefix(ref, DatasetSpec(ref=ref, format=format.value, text_field=text_field, license=license))
        else:
            name, at = _split(ref)
            ds = EmbeddedCatalog().resolve(name, at)
        report = run_and_store(ds, team)
    except (CatalogError, SuiteError) as exc:
        fail(str(exc), EXIT_UNREADABLE)
    except ValueError as exc:  # the spec's own validation of the reference (a whole bucket, ...)
        errors = getattr(exc, "errors", None)
        fail("; ".join(str(e["msg"]).removeprefix("Value error, ") for e in errors()) if callable(errors)
             else str(exc), EXIT_UNREADABLE)
    if as_json:
        if not report["passed"]:
            fail(f"{ds.name}@{ds.version[:12]} failed its quality gate", extra=report)
        print_json(report)
        return
    checked = report.get("documents_checked", report.get("samples_checked"))
    console.print(f"{escape(ds.name)}@{ds.version[:12]}: quality gate "
                  + ("[green]passed[/]" if report["passed"] else "[red]FAILED[/]") + f" ({checked} checked)")
    for f in report["failures"]:
        err_console.print(f"  [red]✗[/] {escape(f)}")
    if not report["passed"]:
        fail(f"{ds.name}@{ds.version[:12]} failed its quality gate; no job may train on it")


@datasets_app.command("tag")
def tag(ref: str = typer.Argument(..., help="NAME[@REF] to pin."),
        tag_name: str = typer.Argument(..., metavar="TAG", help="The tag's name."),
        as_json: bool = typer.Option(False, "--json", help="Print {name, tag, version} as JSON.")) -> None:
    """Pin a version under an immutable tag (use it as catalog://NAME@TAG)."""
    from trainforge.datasets.catalog import CatalogError, EmbeddedCatalog

    name, at = _split(ref)
    try:
        version = EmbeddedCatalog().tag(name, tag_name, at)
    except CatalogError as exc:
        fail(str(exc))
    if as_json:
        print_json({"name": name, "tag": tag_name, "version": version})
        return
    console.print(f"tagged {escape(name)}@{escape(tag_name)} -> {version[:12]}")
