"""Offline validation of rendered manifests: no API server can run here (no container engine), so every object is
checked against the Kubernetes OpenAPI-derived JSON schemas that `kubernetes-validate` ships (strict: unknown
fields are errors), and the CRDs (JobSet, Kueue's WorkloadPriorityClass) against a hand-written schema subset.

CRD checks (documented in docs/production.md): the published JobSet/Kueue CRD YAML ships in no Python package,
so `JOBSET_SCHEMA` is written from JobSet v1alpha2's API types (jobset_types.go): every top-level spec field
with its type and enums, unknown fields refused. What CRD schemas embed from core types is validated with the
core schemas themselves: a replicated job's `template` is checked as a strict batch/v1 Job, and the JobSet's
metadata as strict ObjectMeta. Names and labels get Kubernetes' syntax rules (the schemas carry no patterns).
"""

from __future__ import annotations

import re
from typing import Any

KUBERNETES_VERSION = "1.33"

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")

_STR_LIST = {"type": "array", "items": {"type": "string"}}
JOBSET_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "jobset.x-k8s.io/v1alpha2"},
        "kind": {"const": "JobSet"},
        "metadata": {"type": "object"},
        "status": {"type": "object"},
        "spec": {
            "type": "object",
            "required": ["replicatedJobs"],
            "additionalProperties": False,
            "properties": {
                "replicatedJobs": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["name", "template"], "additionalProperties": False,
                    "properties": {
                        "name": {"type": "string", "minLength": 1},
                        "groupName": {"type": "string"},
                        "replicas": {"type": "integer", "minimum": 0, "maximum": 2147483647},
                        "template": {"type": "object", "required": ["spec"], "additionalProperties": False,
                                     "properties": {"metadata": {"type": "object"}, "spec": {"type": "object"}}},
                        "dependsOn": {"type": "array", "maxItems": 5, "items": {
                            "type": "object", "required": ["name", "status"], "additionalProperties": False,
                            "properties": {"name": {"type": "string"}, "status": {"enum": ["Ready", "Complete"]}}}},
                    }}},
                "network": {"type": "object", "additionalProperties": False, "properties": {
                    "enableDNSHostnames": {"type": "boolean"}, "subdomain": {"type": "string"},
                    "publishNotReadyAddresses": {"type": "boolean"}}},
                "successPolicy": {"type": "object", "required": ["operator"], "additionalProperties": False,
                                  "properties": {"operator": {"enum": ["All", "Any"]},
                                                 "targetReplicatedJobs": _STR_LIST}},
                "failurePolicy": {"type": "object", "additionalProperties": False, "properties": {
                    "maxRestarts": {"type": "integer", "minimum": 0, "maximum": 2147483647},
                    "restartStrategy": {"enum": ["Recreate", "BlockingRecreate", "InPlaceRestart"]},
                    "rules": {"type": "array", "items": {
                        "type": "object", "required": ["name", "action"], "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string", "pattern": r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"},
                            "action": {"enum": ["FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts",
                                                "RestartJob", "RestartJobAndIgnoreMaxRestarts"]},
                            "onJobFailureReasons": _STR_LIST, "onJobFailureMessagePatterns": _STR_LIST,
                            "targetReplicatedJobs": _STR_LIST}}}}},
                "startupPolicy": {"type": "object", "required": ["startupPolicyOrder"], "additionalProperties": False,
                                  "properties": {"startupPolicyOrder": {"enum": ["AnyOrder", "InOrder"]}}},
                "suspend": {"type": "boolean"},
                "coordinator": {"type": "object", "required": ["replicatedJob"], "additionalProperties": False,
                                "properties": {"replicatedJob": {"type": "string"}, "jobIndex": {"type": "integer"},
                                               "podIndex": {"type": "integer"}}},
                "managedBy": {"type": "string", "maxLength": 63},
                "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
                "volumeClaimPolicies": {"type": "array", "maxItems": 50, "items": {"type": "object"}},
            },
        },
    },
}

WORKLOAD_PRIORITY_CLASS_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "value"], "additionalProperties": False,
    "properties": {"apiVersion": {"const": "kueue.x-k8s.io/v1beta1"}, "kind": {"const": "WorkloadPriorityClass"},
                   "metadata": {"type": "object"},
                   "value": {"type": "integer", "minimum": -2147483648, "maximum": 2147483647},
                   "description": {"type": "string"}},
}

CRD_SCHEMAS = {("jobset.x-k8s.io/v1alpha2", "JobSet"): JOBSET_SCHEMA,
               ("kueue.x-k8s.io/v1beta1", "WorkloadPriorityClass"): WORKLOAD_PRIORITY_CLASS_SCHEMA}
CLUSTER_SCOPED = {"PriorityClass", "WorkloadPriorityClass", "Namespace"}


class ManifestInvalid(ValueError):
    pass


def _core(obj: dict[str, Any], where: str) -> None:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        raise ManifestInvalid(f"{where}: {path}: {exc.message}") from None
    except kubernetes_validate.SchemaNotFoundError as exc:
        raise ManifestInvalid(f"{where}: {exc.message}") from None


def _crd(obj: dict[str, Any], schema: dict[str, Any], where: str) -> None:
    import jsonschema

    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(obj), key=lambda e: list(e.path))
    if errors:
        e = errors[0]
        raise ManifestInvalid(f"{where}: {'.'.join(str(p) for p in e.path)}: {e.message}")


def _names_and_labels(meta: dict[str, Any], where: str, *, name_rule: re.Pattern[str] = _DNS_SUBDOMAIN) -> None:
    name = meta.get("name", "")
    if not name_rule.match(name) or len(name) > 253:
        raise ManifestInvalid(f"{where}: metadata.name {name!r} is not a valid Kubernetes name")
    for key, value in (meta.get("labels") or {}).items():
        prefix, _, label = key.rpartition("/")
        if (prefix and not _DNS_SUBDOMAIN.match(prefix)) or not _LABEL_NAME.match(label) or len(label) > 63:
            raise ManifestInvalid(f"{where}: label key {key!r} is not valid")
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            raise ManifestInvalid(f"{where}: label {key}={value!r}: values are at most 63 characters of "
                                  "[A-Za-z0-9-_.], beginning and ending alphanumeric")


def validate_manifest(obj: dict[str, Any]) -> None:
    """Raise ManifestInvalid naming the object and the field when `obj` would be refused by the API server."""
    kind, api = obj.get("kind", "?"), obj.get("apiVersion", "?")
    meta = obj.get("metadata") or {}
    where = f"{kind}/{meta.get('name', '?')}"
    if kind not in CLUSTER_SCOPED and not meta.get("namespace"):
        raise ManifestInvalid(f"{where}: a namespaced object needs metadata.namespace")
    schema = CRD_SCHEMAS.get((api, kind))
    if schema is None:
        _core(obj, where)
        _names_and_labels(meta, where)
        return
    _crd(obj, schema, where)
    _core({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta}, f"{where} metadata")
    _names_and_labels(meta, where, name_rule=_DNS_LABEL if kind == "JobSet" else _DNS_SUBDOMAIN)
    if kind == "JobSet":
        for rjob in obj["spec"]["replicatedJobs"]:
            sub = f"{where} replicatedJobs[{rjob['name']}]"
            if not _DNS_LABEL.match(rjob["name"]):
                raise ManifestInvalid(f"{sub}: name is not a DNS label")
            tmpl = rjob["template"]
            job = {"apiVersion": "batch/v1", "kind": "Job",
                   "metadata": {"name": f"{meta['name']}-{rjob['name']}-0", "namespace": meta.get("namespace"),
                                **({"labels": tmpl["metadata"]["labels"]} if tmpl.get("metadata", {}).get("labels")
                                   else {})},
                   "spec": tmpl["spec"]}
            _core(job, f"{sub}.template (as batch/v1 Job)")
            _names_and_labels(job["metadata"], sub, name_rule=_DNS_LABEL)
            pod_meta = tmpl["spec"].get("template", {}).get("metadata", {})
            _names_and_labels({"name": "pod", **pod_meta}, f"{sub} pod template")


def validate_manifests(objs: list[dict[str, Any]]) -> int:
    for obj in objs:
        validate_manifest(obj)
    return len(objs)
