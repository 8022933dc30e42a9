"""`trainforge plan`: the auto-parallelism advisor and the memory / step-time model on the command line.

    trainforge plan --model llama-70b --gpus 512 --gpu-type h100 [--global-batch N] [--seq-len N] [--explain]
                    [--json] [--top K] [--layout tp=8,pp=4,dp=16,mb=1,schedule=1f1b,vpp=1,sharding=...,ac=...]
    trainforge plan JOB.yaml [--cluster CLUSTER.yaml]

Exit status: 0 a feasible plan, 1 infeasible (the message says by how much and what to change), 2 bad input.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import typer

from trainforge.cli import app
from trainforge.commands.common import EXIT_INVALID, EXIT_UNREADABLE, err_console, fail, print_json
from trainforge.commands.common import console as _console
from trainforge.spec import Engine, GpuType, Precision

GiB = 2**30
LAYOUT_KEYS = {"dp": "dp", "tp": "tp", "pp": "pp", "ep": "ep", "vpp": "vpp", "mb": "micro_batch_size",
               "micro_batch_size": "micro_batch_size", "schedule": "schedule", "sharding": "sharding",
               "ac": "activation_checkpointing", "activation_checkpointing": "activation_checkpointing"}
INT_KEYS = {"dp", "tp", "pp", "ep", "vpp", "micro_batch_size"}


def parse_layout(text: str) -> dict[str, Any]:
    """`tp=8,pp=12,dp=16,mb=1,schedule=1f1b` -> Layout fields."""
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in LAYOUT_KEYS:
            raise ValueError(f"--layout: cannot read {part!r}; keys: {', '.join(sorted(LAYOUT_KEYS))}")
        name = LAYOUT_KEYS[key.strip()]
        out[name] = int(value) if name in INT_KEYS else value.strip()
    return out


def default_global_batch(seq_len: int, gpus: int) -> int:
    """About 4M tokens per step, and at least one sequence per 8 GPUs, as a power of two."""
    want = max(4 * 2**20 // seq_len, gpus // 8, 1)
    return 1 << (want - 1).bit_length()


@app.command()
def plan(
    job: Path | None = typer.Argument(None, help="A job spec: plan it on --cluster (alternative to --model)."),
    model: str | None = typer.Option(None, help="Preset (llama-1b ... llama-405b) or a YAML/JSON file of "
                                     "architecture numbers (layers, hidden, heads, kv_heads, ffn_hidden, mlp, vocab, "
                                     "seq_len, experts, top_k)."),
    gpus: int | None = typer.Option(None, help="World size."),
    gpu_type: GpuType = typer.Option(GpuType.H100, help="Accelerator type (the hardware catalog's)."),
    gpus_per_node: int = typer.Option(8, help="GPUs per node (the tensor-parallel domain)."),
    global_batch: int | None = typer.Option(None, help="Sequences per step (default ~4M tokens)."),
    seq_len: int | None = typer.Option(None, help="Tokens per sequence (default: the model file's, else 4096)."),
    precision: Precision = typer.Option(Precision.BF16, help="Compute precision."),
    engine: Engine = typer.Option(Engine.NATIVE, help="The engine that runs the job: native (DDP/FSDP2/TP/PP/EP) "
                                  "or deepspeed (ZeRO 0-3, data parallel only); only layouts it runs are planned "
                                  "(a job spec's parallelism.engine wins)."),
    layout: str | None = typer.Option(None, help="Evaluate this one layout instead of searching, e.g. "
                                      "tp=8,pp=12,dp=16,mb=1,schedule=1f1b,vpp=1,sharding=none,ac=full."),
    uneven_stages: bool = typer.Option(False, help="Allow pipeline stages with unequal block counts."),
    cluster: Path | None = typer.Option(None, help="Cluster description (links, node size, MTBF)."),
    node_mtbf_hours: float | None = typer.Option(None, help="Per-node MTBF for the checkpoint interval "
                                                 "(default: the cluster's, else 50,000 h)."),
    top: int = typer.Option(5, help="How many plans to list."),
    explain: bool = typer.Option(False, "--explain", help="Show the memory arithmetic and the reasoning."),
    as_json: bool = typer.Option(False, "--json", help="Print the stable JSON (schema trainforge.plan/v1)."),
) -> None:
    """Choose a parallel layout, or check one: memory per GPU, communication, step time, MFU and checkpointing.

    \b
    Examples:
      trainforge plan --model llama-70b --gpus 512 --gpu-type h100 --global-batch 1024 --explain
      trainforge plan examples/llama-7b-finetune.yaml --cluster examples/clusters/fleet-10k.yaml
    """
    from trainforge.plan.advisor import InfeasibleLayoutError

    try:
        req, fixed_layout, mtbf = _request(job, model, gpus, gpu_type.value, gpus_per_node, global_batch, seq_len,
                                           precision.value, layout, uneven_stages, cluster, node_mtbf_hours)
        if job is None:
            req = replace(req, engine=engine.value)
    except (ValueError, OSError) as exc:
        fail(str(exc), EXIT_UNREADABLE)
    try:
        _run(req, fixed_layout, mtbf, top, explain, as_json)
    except InfeasibleLayoutError as exc:
        if as_json:
            print_json({"schema": "trainforge.plan/v1", "feasible": False, "error": str(exc)})
            raise typer.Exit(EXIT_INVALID) from None
        fail(str(exc), EXIT_INVALID)


def _request(job, model, gpus, gpu_type, gpus_per_node, global_batch, seq_len, precision, layout, uneven,
             cluster_path, node_mtbf_hours):  # -> (PlanRequest, Layout | None, float)
    from trainforge.plan.advisor import PlanRequest
    from trainforge.plan.cluster import default_cluster, load_cluster
    from trainforge.plan.hardware import gpu_spec
    from trainforge.plan.layout import Layout
    from trainforge.plan.model import resolve_model
    from trainforge.plan.topology import default_topology, topology_for

    cluster = load_cluster(cluster_path) if cluster_path else None
    fixed: dict[str, Any] = parse_layout(layout) if layout else {}
    if job is not None:
        from trainforge.plan.model import shape_from_spec
        from trainforge.plan.resolve import explicit_layout, plan_request
        from trainforge.spec import load_spec

        spec = load_spec(job)
        cluster = cluster or default_cluster()
        req = plan_request(spec, shape_from_spec(spec.model, spec.name), cluster)
        req = replace(req, uneven_stages=uneven)
        fixed_layout = explicit_layout(spec) if spec.parallelism.strategy == "explicit" and not fixed else None
        if fixed:
            req = replace(req, fixed=fixed)
        return req, fixed_layout or _full_layout(req, fixed, Layout), node_mtbf_hours or cluster.node_mtbf_hours
    if not model or not gpus:
        raise ValueError("give a job spec, or --model and --gpus")
    shape, file_seq = resolve_model(model)
    seq = seq_len or file_seq or 4096
    gpu = gpu_spec(gpu_type)
    topo = (topology_for(cluster, gpu.name, gpus_per_node) if cluster
            else default_topology(gpu.name, min(gpus_per_node, gpus)))
    req = PlanRequest(shape, gpu, topo, gpus, global_batch or default_global_batch(seq, gpus), seq, precision,
                      fixed, uneven_stages=uneven)
    mtbf = node_mtbf_hours or (cluster.node_mtbf_hours if cluster else 50_000)
    return req, _full_layout(req, fixed, Layout), mtbf


def _full_layout(req, fixed: dict[str, Any], layout_cls):  # -> Layout | None
    """A --layout that names tp and pp (dp follows) is evaluated as given; a partial one constrains the search."""
    if not fixed or not ({"tp", "pp"} <= fixed.keys() or "dp" in fixed and {"tp", "pp"} & fixed.keys()):
        return None
    values = {"tp": 1, "pp": 1, "ep": 1, "vpp": 1, "schedule": "1f1b", "sharding": "none",
              "activation_checkpointing": "none", **fixed}
    values.setdefault("dp", max(1, req.world_size // (values["tp"] * values["pp"])))
    values.setdefault("micro_batch_size", 1)
    if values["vpp"] > 1 and "schedule" not in fixed:
        values["schedule"] = "interleaved-1f1b"
    return layout_cls(**values)


def _run(req, fixed_layout, mtbf_hours: float, top: int, explain: bool, as_json: bool) -> None:
    from trainforge.plan.advisor import (
        InfeasibleLayoutError,
        SearchResult,
        evaluate_layout,
        no_plan_message,
        search,
    )
    from trainforge.plan.checkpointing import plan_checkpoints
    from trainforge.plan.report import SCHEMA, plan_to_dict, request_to_dict
    from trainforge.plan.report import explain as explain_lines

    if fixed_layout is not None:
        plan = evaluate_layout(req, fixed_layout)
        result = SearchResult(req, [plan] if plan.feasible else [], considered=1)
        plans = [plan]
    else:
        result = search(req)
        plans = result.plans[:top]
        if not plans:
            raise InfeasibleLayoutError(no_plan_message(result))
    best = plans[0]
    nodes = max(1, req.world_size // req.topology.gpus_per_node)
    # Saves are asynchronous (the trainer's default): training blocks only while staging, ~10% of a write.
    ckpt = plan_checkpoints(req.model, nodes=nodes, node_mtbf_hours=mtbf_hours, precision=req.precision,
                            step_time_s=best.step.step_time_s if best.step else 1.0, async_stall_fraction=0.1)
    lines = explain_lines(result, top) if fixed_layout is None else []
    if as_json:
        print_json({
            "schema": SCHEMA, "request": request_to_dict(req),
            "search": {"considered": result.considered, "feasible": len(result.plans),
                       "rejected": dict(result.rejected), "elapsed_s": result.elapsed_s},
            "plans": [plan_to_dict(p, req) for p in plans], "explanation": lines,
            "checkpoint": {"bytes": ckpt.checkpoint_bytes, "write_s": ckpt.write_s, "interval_s": ckpt.interval_s,
                           "interval_steps": ckpt.interval_steps, "cluster_mtbf_s": ckpt.cluster_mtbf_s,
                           "failures_per_day": ckpt.failures_per_day, "overhead_fraction": ckpt.overhead_fraction},
        })
        raise typer.Exit(0 if best.feasible else EXIT_INVALID)
    _print_human(req, result, plans, lines, ckpt, explain)
    if not best.feasible:
        from trainforge.plan.advisor import does_not_fit_message

        if best.problems:
            for p in best.problems:
                err_console.print(f"  [red]✗[/] {p.field}: {p.message}. Fix: {p.fix}")
        else:
            err_console.print(f"[bold red]✗[/] {does_not_fit_message(req, best)}")
        raise typer.Exit(EXIT_INVALID)


def _print_human(req, result, plans, lines, ckpt, explain: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, width=max(150, _console.width))

    m = req.model
    console.print(f"[bold]{m.name}[/] ({m.total_params / 1e9:.2f}B params) on {req.world_size} x {req.gpu.name}, "
                  f"global batch {req.global_batch_size} x {req.seq_len} tokens, {req.precision}; links: "
                  f"{req.topology.intra.name} in node, {req.topology.inter.name} between nodes")
    if len(plans) > 1 or result.considered > 1:
        console.print(f"searched {result.considered} layouts in {result.elapsed_s * 1000:.0f} ms: "
                      f"{len(result.plans)} feasible; rejected {dict(result.rejected)}")
    table = Table(show_lines=False)
    for col in ("#", "dp", "tp", "pp", "vpp", "mb", "schedule", "sharding", "ac", "GiB/GPU", "step s", "tok/s",
                "MFU", "bubble"):
        table.add_column(col, justify="right" if col not in ("schedule", "sharding", "ac") else "left")
    for i, p in enumerate(plans, 1):
        lay, s = p.layout, p.step
        table.add_row(str(i), str(lay.dp), str(lay.tp), str(lay.pp), str(lay.vpp), str(lay.micro_batch_size),
                      lay.schedule if lay.pp > 1 else "-", lay.sharding, lay.activation_checkpointing,
                      f"{p.memory.total_bytes / GiB:.1f}" + ("" if p.memory.fits else " ✗"),
                      f"{s.step_time_s:.2f}" if s else "-", f"{s.tokens_per_s:,.0f}" if s else "-",
                      f"{s.mfu:.1%}" if s else "-", f"{s.bubble_fraction:.1%}" if s else "-")
    console.print(table)
    best = plans[0]
    console.print(f"[bold]memory per GPU[/] ({best.layout.describe()}):")
    if explain:
        console.print(best.memory.explain(), markup=False)
    else:
        console.print("  " + ", ".join(f"{i.name} {i.bytes / GiB:.2f}" for i in best.memory.items if i.bytes)
                      + f" GiB = {best.memory.total_bytes / GiB:.2f} of {best.memory.capacity_bytes / GiB:.2f} GiB")
    if best.step is not None:
        console.print("[bold]communication per iteration[/] (per GPU):")
        for c in best.step.comm:
            console.print(f"  {c.kind:<32} {c.bytes_per_gpu / 1e9:10.2f} GB on {c.link} ({c.scope}) "
                          f"{c.time_s:.3f} s" + (f"  = {c.formula}" if explain else ""), markup=False)
        s = best.step
        if explain and s.overlap:
            console.print("[bold]overlap[/] (per step: each collective against the compute that hides it):")
            for t in s.overlap:
                console.print(f"  {t.name:<36} {t.total_s:.3f} s: hidden {t.hidden_s:.3f}, exposed {t.exposed_s:.3f}"
                              + (f" (window {t.window_s:.3f} s)" if t.window_s else "") + f"  -- {t.rule}",
                              markup=False)
        console.print(f"[bold]step[/] {s.step_time_s:.2f} s = compute {s.compute_s:.2f} + bubble {s.bubble_s:.2f} "
                      f"+ exposed comm {s.exposed_comm_s:.2f} + optimizer {s.optimizer_s:.3f}; "
                      f"{s.tokens_per_s:,.0f} tokens/s, MFU {s.mfu:.1%} (HFU {s.hfu:.1%})")
    for line in lines if explain else lines[:3]:
        console.print(f"  {line}", markup=False)
    console.print(f"[bold]checkpoints[/]: {ckpt.checkpoint_bytes / 1e12:.2f} TB per save, {ckpt.commit_s:.0f} s to "
                  f"write ({ckpt.write_s:.1f} s blocking, async); cluster MTBF {ckpt.cluster_mtbf_s / 3600:.1f} h -> every {ckpt.interval_s / 60:.0f} min "
                  f"({ckpt.interval_steps} steps, "
                  + (f"10-min loss cap; Daly {ckpt.daly_interval_s / 60:.0f} min" if ckpt.capped else "Young/Daly")
                  + f"), {ckpt.overhead_fraction:.1%} overhead ({ckpt.lost_hours_per_day:.2f} h/day)")
