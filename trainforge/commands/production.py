"""`trainforge render` (a job's Kubernetes manifests) and `trainforge servers up|down|status` (the server stack).

`submit --backend kubernetes` (trainforge/commands/jobs.py) calls `submit_kubernetes` below.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import typer

from trainforge.cli import app
from trainforge.commands.common import (
    console,
    err_console,
    fail,
    load_cluster_option,
    print_json,
    print_spec_error,
)
from trainforge.spec import JobSpec, SpecError


def _load_spec(spec_file: Path, cluster: Any = None) -> JobSpec:
    from trainforge.validate import validate_file

    report = validate_file(spec_file, cluster)
    if not report.ok():
        print_spec_error(SpecError(report.errors(), str(spec_file), report.unreadable))
    assert report.spec is not None
    return report.spec


def _options(namespace: str, image: str | None, queue: str | None, topology_aware: bool) -> Any:
    import os

    from trainforge.infra.k8s.render import K8sOptions

    platform_env = {k: os.environ[k] for k in ("TRAINFORGE_STORAGE_URL", "MLFLOW_TRACKING_URI", "TRAINFORGE_LINEAGE_URL")
                    if os.environ.get(k)}
    kwargs: dict[str, Any] = {"namespace": namespace, "queue": queue, "topology_aware": topology_aware,
                              "env": platform_env}
    if image:
        kwargs["image"] = image
    return K8sOptions(**kwargs)


@app.command()
def render(
    spec_file: Path = typer.Argument(..., help="Job spec (YAML or JSON)."),
    backend: str = typer.Option("kubernetes", help="Only `kubernetes` renders manifests."),
    cluster: Path | None = typer.Option(None, help="Cluster description (default: $TRAINFORGE_CLUSTER, else this "
                                        "machine)."),
    job_id: str | None = typer.Option(None, help="Job id (default: a new one)."),
    namespace: str = typer.Option("trainforge", help="Namespace of the job's objects."),
    image: str | None = typer.Option(None, help="Worker image."),
    queue: str | None = typer.Option(None, help="Kueue LocalQueue (default: team-<team>)."),
    topology_aware: bool = typer.Option(False, help="Ask Kueue's topology-aware scheduling for rack locality."),
    validate: bool = typer.Option(True, help="Validate every manifest against the Kubernetes schemas."),
) -> None:
    """Print the Kubernetes manifests of a job (PriorityClass, Kueue WorkloadPriorityClass, ConfigMap,
    NetworkPolicy, JobSet), validated offline. Example: trainforge render examples/llama-7b-finetune.yaml
    --cluster examples/clusters/fleet-10k.yaml | kubectl apply -f -"""
    import yaml

    from trainforge.infra.k8s.job import manifests_for_spec
    from trainforge.infra.k8s.validate import ManifestInvalid, validate_manifests
    from trainforge.registry.jobs import new_job_id

    if backend != "kubernetes":
        fail(f"backend {backend!r} has no manifests to render: use --backend kubernetes")
    cluster_spec = load_cluster_option(cluster)
    spec = _load_spec(spec_file, cluster_spec)
    try:
        manifests = manifests_for_spec(spec, job_id or new_job_id(spec.name), cluster_spec,
                                       _options(namespace, image, queue, topology_aware))
        if validate:
            validate_manifests(manifests)
    except (ValueError, ManifestInvalid) as exc:
        fail(str(exc))

    class _NoAliases(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    sys.stdout.write(yaml.dump_all(manifests, Dumper=_NoAliases, sort_keys=False))


def submit_kubernetes(spec_file: Path, *, cluster: Path | None, namespace: str, image: str | None,
                      kube_api: str | None, timeout_s: float, as_json: bool) -> None:
    """Validate, plan, reserve the nodes with the live scheduler, render, apply, and follow the pods."""
    from trainforge.infra.backends.kubernetes import GangFailed, KubernetesBackend, api_client
    from trainforge.infra.k8s.job import preview_worker_config
    from trainforge.infra.k8s.render import jobset_name, render_job
    from trainforge.infra.k8s.validate import validate_manifests
    from trainforge.infra.scheduler.live import GangRequest, LiveScheduler
    from trainforge.registry.jobs import new_job_id
    from trainforge.tasks.prepare import make_plan, storage_url

    cluster_spec = load_cluster_option(cluster)
    spec = _load_spec(spec_file, cluster_spec)
    job_id = new_job_id(spec.name)
    plan = make_plan(spec, cluster_spec)
    layout = plan["layout"]
    scheduler = LiveScheduler(cluster_spec)
    allocation = scheduler.request(GangRequest(
        job_id=job_id, team=spec.team, priority=spec.priority.value, gpu_type=spec.resources.gpu_type.value,
        num_gpus=spec.resources.world_size,
        gpus_per_node=min(spec.resources.gpus_per_node, spec.resources.world_size),
        tp=layout.get("tp") or 1, pp=layout.get("pp") or 1, max_runtime_s=spec.max_runtime_s), timeout_s=timeout_s)
    events: list[dict[str, Any]] = []
    try:
        manifests = render_job(spec, job_id, cluster_spec, allocation.nodes,
                               preview_worker_config(spec, job_id, plan, storage_url()),
                               _options(namespace, image, None, False))
        validate_manifests(manifests)
        backend = KubernetesBackend(api_client(kube_api), namespace)
        created = backend.apply(manifests)
        name = jobset_name(job_id)
        t0 = time.monotonic()

        def report(st: Any) -> None:
            events.append({"t": round(time.monotonic() - t0, 2), "state": st.state, "pods": st.pods})
            if not as_json:
                err_console.print(f"[{time.monotonic() - t0:6.1f}s] {name}: {st.state} "
                                  f"{' '.join(f'{p}={ph}' for p, ph in sorted(st.pods.items()))}")

        try:
            final = backend.wait(name, timeout_s=timeout_s, on_change=report)
        except (GangFailed, TimeoutError) as exc:
            err_console.print(f"[bold red]job failed:[/] {exc}")
            raise typer.Exit(1) from None
    finally:
        scheduler.release(job_id)
    result = {"job_id": job_id, "jobset": name, "state": final.state, "created": created, "events": events}
    if as_json:
        print_json(result)
    else:
        console.print(f"[green]✓[/] job [bold]{job_id}[/] {final.state} on {len(allocation.nodes)} node(s)")


# ------------------------------------------------------------------------------------------------ servers

servers_app = typer.Typer(help="The full server stack on loopback: PostgreSQL, SeaweedFS S3, MLflow, Prefect.",
                          no_args_is_help=True)
app.add_typer(servers_app, name="servers")


def _stack(root: Path | None) -> Any:
    from trainforge.infra.servers import ServerStack

    return ServerStack(root)


@servers_app.command("up")
def servers_up(
    root: Path | None = typer.Option(None, help="State folder (default: $TRAINFORGE_HOME/servers)."),
    timeout: float = typer.Option(180.0, help="Seconds to wait for each server to be ready."),
) -> None:
    """Start every server (idempotent) and write the env file that points trainforge at them."""
    stack = _stack(root)
    t0 = time.monotonic()
    try:
        env_file = stack.up(ready_timeout_s=timeout)
    except Exception as exc:
        stack.down()
        fail(f"the stack did not start (everything was stopped again): {exc}")
    console.print(f"[green]✓[/] stack up in {time.monotonic() - t0:.1f} s; env file: {env_file}")
    console.print(f"  use it: set -a; . {env_file}; set +a")


@servers_app.command("down")
def servers_down(root: Path | None = typer.Option(None, help="State folder.")) -> None:
    """Stop every server of the stack (no orphans); data stays under the state folder."""
    stopped = _stack(root).down()
    console.print(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")


@servers_app.command("status")
def servers_status(root: Path | None = typer.Option(None, help="State folder."),
                   as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """Each server: running?, healthy?, its URL. Exits 1 when any is down."""
    rows = _stack(root).status()
    if as_json:
        print_json(rows)
    else:
        for r in rows:
            mark = "[green]✓[/]" if r["healthy"] else "[red]✗[/]"
            console.print(f"  {mark} {r['name']:10} pid {r['pid'] or '-':>7}  {r['url']}  {r['detail']}")
    if not all(r["healthy"] for r in rows):
        raise typer.Exit(1)
