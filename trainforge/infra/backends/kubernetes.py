"""The Kubernetes backend: apply a job's rendered manifests with the official `kubernetes` client and follow its
pods until the gang succeeds or fails.

The manifests come from `trainforge.infra.k8s` (pure); this module is the side effect. Cluster-scoped classes
(PriorityClass, WorkloadPriorityClass) are shared by every job: "already exists" is fine for them. Everything
else is the job's own, labelled with its JobSet name, and `delete` removes all of it.

Pods are followed by bounded polling (a list per `poll_s`, labelSelector on the JobSet name), which survives API
server restarts and watch expiries without bookkeeping; each phase change is reported through `on_change` so a
Prefect task can log it as the job's state. Tested against an in-process fake API server
(tests/integration/test_k8s_backend.py): no real cluster can run on the development machines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from trainforge._optional import require
from trainforge.infra.k8s.render import JOBSET_NAME_LABEL

logger = logging.getLogger(__name__)

# kind -> (group, version, plural) of the custom resources trainforge creates.
CUSTOM = {"JobSet": ("jobset.x-k8s.io", "v1alpha2", "jobsets"),
          "WorkloadPriorityClass": ("kueue.x-k8s.io", "v1beta2", "workloadpriorityclasses")}
SHARED_KINDS = {"PriorityClass", "WorkloadPriorityClass"}


class GangFailed(RuntimeError):
    def __init__(self, message: str, pods: dict[str, str]):
        super().__init__(message)
        self.pods = pods


@dataclass
class GangStatus:
    name: str
    state: str
    """pending | running | succeeded | failed"""
    pods: dict[str, str] = field(default_factory=dict)
    """pod name -> phase"""
    reason: str = ""


def api_client(host: str | None = None, *, context: str | None = None) -> Any:
    """An ApiClient: `host` (tests, `kubectl proxy`), else in-cluster credentials, else ~/.kube/config."""
    require("kubernetes", purpose="the kubernetes backend")
    from kubernetes import client, config

    if host:
        cfg = client.Configuration()
        cfg.host = host
        return client.ApiClient(cfg)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config(context=context)
    return client.ApiClient()


class KubernetesBackend:
    def __init__(self, api: Any, namespace: str = "trainforge"):
        from kubernetes import client

        self.api = api
        self.namespace = namespace
        self.core = client.CoreV1Api(api)
        self.net = client.NetworkingV1Api(api)
        self.sched = client.SchedulingV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    # -- apply / delete ----------------------------------------------------------------------------------------
    def apply(self, manifests: Iterable[dict[str, Any]]) -> list[str]:
        """Create every object in order; returns `Kind/name` of each one created (shared classes that exist
        already are skipped). A job object that exists already is an error: job ids are unique."""
        from kubernetes.client.exceptions import ApiException

        created = []
        for obj in manifests:
            kind, name = obj["kind"], obj["metadata"]["name"]
            try:
                self._create(obj)
            except ApiException as exc:
                if exc.status == 409 and kind in SHARED_KINDS:
                    continue
                raise RuntimeError(f"creating {kind}/{name} failed: {exc.status} {exc.reason}: "
                                   f"{(exc.body or '')[:500]}") from None
            created.append(f"{kind}/{name}")
            logger.info("created %s/%s", kind, name)
        return created

    def _create(self, obj: dict[str, Any]) -> None:
        kind, ns = obj["kind"], obj["metadata"].get("namespace", self.namespace)
        if kind == "ConfigMap":
            self.core.create_namespaced_config_map(ns, obj)
        elif kind == "Secret":
            self.core.create_namespaced_secret(ns, obj)
        elif kind == "NetworkPolicy":
            self.net.create_namespaced_network_policy(ns, obj)
        elif kind == "PriorityClass":
            self.sched.create_priority_class(obj)
        elif kind == "WorkloadPriorityClass":
            self.custom.create_cluster_custom_object(*CUSTOM[kind], obj)
        elif kind == "JobSet":
            self.custom.create_namespaced_custom_object(*CUSTOM[kind][:2], ns, CUSTOM[kind][2], obj)
        else:
            raise ValueError(f"the Kubernetes backend does not create {kind} objects")

    def delete(self, name: str) -> None:
        """Delete the job's JobSet (its Jobs and pods go with it: foreground propagation), ConfigMap and
        NetworkPolicy. Missing objects are fine (idempotent)."""
        from kubernetes.client.exceptions import ApiException

        calls: list[Callable[[], Any]] = [
            lambda: self.custom.delete_namespaced_custom_object(*CUSTOM["JobSet"][:2], self.namespace,
                                                                CUSTOM["JobSet"][2], name,
                                                                propagation_policy="Foreground"),
            lambda: self.core.delete_namespaced_config_map(f"{name}-config", self.namespace),
            lambda: self.net.delete_namespaced_network_policy(f"{name}-gang", self.namespace),
        ]
        for call in calls:
            try:
                call()
            except ApiException as exc:
                if exc.status != 404:
                    raise

    # -- status ------------------------------------------------------------------------------------------------
    def status(self, name: str) -> GangStatus:
        js = self.custom.get_namespaced_custom_object(*CUSTOM["JobSet"][:2], self.namespace, CUSTOM["JobSet"][2],
                                                      name)
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=f"{JOBSET_NAME_LABEL}={name}")
        phases = {p.metadata.name: (p.status.phase if p.status else None) or "Pending" for p in pods.items}
        return _status(name, js, phases)

    def wait(self, name: str, *, timeout_s: float, poll_s: float = 2.0,
             on_change: Callable[[GangStatus], None] | None = None) -> GangStatus:
        """Follow the gang until it succeeds (returned) or fails (GangFailed), at most timeout_s seconds."""
        deadline = time.monotonic() + timeout_s
        last: tuple[str, tuple[tuple[str, str], ...]] | None = None
        while True:
            st = self.status(name)
            key = (st.state, tuple(sorted(st.pods.items())))
            if key != last:
                last = key
                if on_change is not None:
                    on_change(st)
            if st.state == "succeeded":
                return st
            if st.state == "failed":
                raise GangFailed(f"job {name} failed: {st.reason or 'a pod failed'}; pods: {st.pods}", st.pods)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {name} still {st.state} after {timeout_s:g}s; pods: {st.pods}")
            time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))


def _status(name: str, js: dict[str, Any], phases: dict[str, str]) -> GangStatus:
    """JobSet's terminal state wins; otherwise the pods say pending (suspended by Kueue, or scheduling) or
    running (every pod of the gang is running)."""
    status = js.get("status") or {}
    terminal = status.get("terminalState", "")
    conditions = {c.get("type"): c for c in status.get("conditions", []) if c.get("status") == "True"}
    if terminal == "Completed" or "Completed" in conditions:
        return GangStatus(name, "succeeded", phases)
    if terminal == "Failed" or "Failed" in conditions:
        cond = conditions.get("Failed", {})
        return GangStatus(name, "failed", phases, cond.get("message") or cond.get("reason") or "JobSet failed")
    if js.get("spec", {}).get("suspend") or "Suspended" in conditions:
        return GangStatus(name, "pending", phases, "waiting for Kueue admission")
    if phases and all(p == "Running" for p in phases.values()):
        return GangStatus(name, "running", phases)
    return GangStatus(name, "pending", phases)
