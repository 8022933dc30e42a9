"""Dataset-release subscriptions: a released dataset version triggers the training jobs that train on it.

The mechanism is Prefect's own: the `dataset-release` flow emits a `trainforge.dataset.released` event for the
resource `trainforge.dataset.<name>` (labels: branch, tag, version); a Prefect Automation per subscription,
with an EventTrigger on that event and resource, runs the `train-job` deployment (RunDeployment action) with the
subscribed job spec. The spec's `dataset.ref` is rewritten to a Jinja template of the event's version, so the
triggered run trains on exactly the version that was released, even if the branch moves again before the run
starts.

Subscriptions are declared in prefect.yaml under trainforge's own top-level key `dataset_triggers` (Prefect's
deploy ignores top-level keys it does not know):

    dataset_triggers:
      - spec: examples/tiny-cpu.yaml   # required: the job to run; its dataset.ref names dataset and branch
        dataset: demo-text             # optional: default from the spec's catalog://NAME@BRANCH
        branch: main                   # optional: the branch whose release triggers (default: the spec's)
        deployment: train-job/train-job  # optional
        enabled: true                  # optional

`install_automations` (the `trainforge automations install` command; `trainforge up` runs it after `prefect
deploy --all`) replaces every automation it owns, recognised by the name prefix, so it is idempotent and a removed
subscription disappears. The spec document is copied into the automation at install time: after editing a
subscribed spec, install again (`trainforge doctor` reports stale ones by the spec's sha256).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RELEASE_EVENT = "trainforge.dataset.released"
NAME_PREFIX = "trainforge-retrain: "
SECTION = "dataset_triggers"
DEFAULT_DEPLOYMENT = "train-job/train-job"
# Rendered by the Prefect server when the automation fires (RunDeployment parameters are Jinja-hydrated).
VERSION_TEMPLATE = "{{ event.payload.version }}"


class TriggerConfigError(ValueError):
    """A subscription that cannot be installed; the message names the file, the entry and the fix."""


def dataset_resource(name: str) -> str:
    return f"trainforge.dataset.{name}"


def release_event(name: str, version: str, branch: str, tag: str | None) -> dict[str, Any]:
    """The keyword arguments of `prefect.events.emit_event` for a released version (kept here, next to the
    trigger that matches it, so the two cannot drift apart)."""
    resource = {"prefect.resource.id": dataset_resource(name), "prefect.resource.name": name,
                "trainforge.dataset.name": name, "trainforge.dataset.branch": branch,
                "trainforge.dataset.version": version}
    if tag:
        resource["trainforge.dataset.tag"] = tag
    return {"event": RELEASE_EVENT, "resource": resource,
            "payload": {"name": name, "version": version, "branch": branch, "tag": tag,
                        "ref": f"catalog://{name}@{version}"}}


@dataclass(frozen=True)
class Subscription:
    spec_path: Path  # absolute
    source: str  # as written in the config (shown in names and job records)
    base_dir: str  # the flow's base_dir: relative to the repository when the spec lives in it
    document: dict[str, Any]  # the spec as parsed, dataset.ref still as written
    job_name: str
    dataset: str
    branch: str
    deployment: str
    enabled: bool

    @property
    def automation_name(self) -> str:
        return f"{NAME_PREFIX}{self.job_name} on {self.dataset}@{self.branch}"

    @property
    def spec_sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.document, sort_keys=True).encode()).hexdigest()

    def parameters(self) -> dict[str, Any]:
        """train_job's parameters: the spec with its dataset pinned to the released version."""
        doc = json.loads(json.dumps(self.document))
        doc["dataset"]["ref"] = f"catalog://{self.dataset}@{VERSION_TEMPLATE}"
        return {"spec": doc, "source": self.source, "base_dir": self.base_dir}


def load_subscriptions(config: Path, repo: Path | None = None) -> list[Subscription]:
    """The `dataset_triggers` entries of `config` (prefect.yaml). Raises TriggerConfigError naming the entry."""
    import yaml

    from trainforge.spec import SpecError, parse_spec, read_document

    repo = (repo or config.parent).resolve()
    try:
        doc = yaml.safe_load(config.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise TriggerConfigError(f"{config}: cannot read it ({exc}); pass --config PATH/prefect.yaml") from None
    entries = doc.get(SECTION) or []
    if not isinstance(entries, list):
        raise TriggerConfigError(f"{config}: `{SECTION}` must be a list of entries like `- spec: JOB.yaml`, "
                                 f"not a {type(entries).__name__}")
    subs: list[Subscription] = []
    allowed = {"spec", "dataset", "branch", "deployment", "enabled"}
    for i, entry in enumerate(entries):
        where = f"{config}: {SECTION}[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("spec"), str):
            raise TriggerConfigError(f"{where}: each entry needs `spec: PATH` (the job spec to run)")
        unknown = set(entry) - allowed
        if unknown:
            raise TriggerConfigError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
        path = Path(entry["spec"])
        if not path.is_absolute():
            path = config.parent / path
        path = path.resolve()
        if not path.is_file():
            raise TriggerConfigError(f"{where}: spec {entry['spec']!r} does not exist ({path}); fix the path "
                                     "(relative paths are relative to the config file)")
        try:
            document = read_document(path)
            spec = parse_spec(document, str(path))
        except SpecError as exc:
            raise TriggerConfigError(f"{where}: the spec is not valid ({exc}); "
                                     f"check it with `trainforge validate {entry['spec']}`") from None
        scheme, _, rest = spec.dataset.ref.partition("://")
        spec_name, _, spec_branch = rest.partition("@")
        if scheme != "catalog" and not entry.get("dataset"):
            raise TriggerConfigError(
                f"{where}: the spec's dataset.ref {spec.dataset.ref!r} is not a catalog:// dataset, so no release "
                "can move it; subscribe catalog datasets only (or give `dataset:` and train on catalog://NAME)")
        dataset = str(entry.get("dataset") or spec_name)
        branch = str(entry.get("branch") or spec_branch or "main")
        if scheme == "catalog" and dataset != spec_name:
            raise TriggerConfigError(f"{where}: `dataset: {dataset}` but the spec trains on {spec_name!r} "
                                     f"({spec.dataset.ref}); drop `dataset:` or fix the spec")
        deployment = str(entry.get("deployment") or DEFAULT_DEPLOYMENT)
        if deployment.count("/") != 1:
            raise TriggerConfigError(f"{where}: deployment {deployment!r} must be FLOW/DEPLOYMENT, "
                                     f"e.g. {DEFAULT_DEPLOYMENT}")
        try:  # the worker runs flows from the repository root (prefect.yaml's pull step): keep paths portable
            base_dir = str(path.parent.relative_to(repo)) or "."
            source = str(path.relative_to(repo))
        except ValueError:
            base_dir, source = str(path.parent), str(path)
        subs.append(Subscription(spec_path=path, source=source, base_dir=base_dir, document=dict(document),
                                 job_name=spec.name, dataset=dataset, branch=branch, deployment=deployment,
                                 enabled=bool(entry.get("enabled", True))))
    names = [s.automation_name for s in subs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise TriggerConfigError(f"{config}: {SECTION} lists the same job and dataset twice: {dupes}")
    return subs


def _automation(sub: Subscription, deployment_id: Any) -> Any:
    from datetime import timedelta

    from prefect.automations import AutomationCore, EventTrigger, RunDeployment

    return AutomationCore(
        name=sub.automation_name,
        description=f"spec={sub.source} sha256={sub.spec_sha256}",
        enabled=sub.enabled,
        trigger=EventTrigger(
            expect={RELEASE_EVENT},
            match={"prefect.resource.id": dataset_resource(sub.dataset), "trainforge.dataset.branch": sub.branch},
            posture="Reactive", threshold=1, within=timedelta(0)),
        actions=[RunDeployment(source="selected", deployment_id=deployment_id, parameters=sub.parameters())],
    )


def install_automations(subs: list[Subscription]) -> list[dict[str, Any]]:
    """Replace every trainforge-owned automation on the current Prefect API with one per subscription.

    Not owned by the deployment on purpose: `prefect deploy` deletes the automations a deployment owns and would
    drop these. Raises TriggerConfigError when a subscribed deployment is not registered."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        deployment_ids: dict[str, Any] = {}
        for name in sorted({s.deployment for s in subs}):
            try:
                deployment_ids[name] = client.read_deployment_by_name(name).id
            except ObjectNotFound:
                raise TriggerConfigError(
                    f"deployment {name} is not registered on the Prefect server: run `prefect --no-prompt deploy "
                    "--all` from the repository root first (`trainforge up` does both)") from None
        removed = 0
        for old in client.read_automations():
            if old.name.startswith(NAME_PREFIX):
                client.delete_automation(old.id)
                removed += 1
        out = []
        for sub in subs:
            automation_id = client.create_automation(_automation(sub, deployment_ids[sub.deployment]))
            out.append({"name": sub.automation_name, "id": str(automation_id), "spec": sub.source,
                        "dataset": sub.dataset, "branch": sub.branch, "deployment": sub.deployment,
                        "enabled": sub.enabled})
    return out


def remove_automations() -> int:
    """Delete every trainforge-owned automation on the current Prefect API; returns how many."""
    from prefect.client.orchestration import get_client

    n = 0
    with get_client(sync_client=True) as client:
        for old in client.read_automations():
            if old.name.startswith(NAME_PREFIX):
                client.delete_automation(old.id)
                n += 1
    return n


def installed_automations() -> list[dict[str, Any]]:
    """trainforge's automations on the current Prefect API: name, enabled, description, target deployment."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return [{"name": a.name, "id": str(a.id), "enabled": a.enabled, "description": a.description,
                 "deployment_ids": [str(getattr(act, "deployment_id", "")) for act in a.actions]}
                for a in client.read_automations() if a.name.startswith(NAME_PREFIX)]
