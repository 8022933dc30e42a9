"""Offline validation of rendered manifests: no API server can run here (no container engine), so every object is
checked against the schemas an API server would apply.

- Core kinds: the Kubernetes OpenAPI-derived JSON schemas that `kubernetes-validate` ships (strict: unknown fields
  are errors).
- JobSet and Kueue kinds: the projects' published CRDs, vendored unchanged in `crds/` (source, commit and licence in
  crds/README.md). An object is checked against `spec.versions[*].schema.openAPIV3Schema` of the served version its
  apiVersion names, with structural-schema semantics: a field a schema does not declare is an error (the API server
  would silently prune it: a typo'd field is a setting that never takes effect), unless the schema says
  `x-kubernetes-preserve-unknown-fields`; `x-kubernetes-int-or-string` accepts an integer or a string; `nullable`,
  `enum`, `pattern`, lengths, item counts, bounds, `int32`/`int64` ranges, `required`, list-type `set`/`map`
  uniqueness are enforced. The CRDs' CEL rules (`x-kubernetes-validations`) that apply on create are transcribed
  below (`_CEL`: no CEL interpreter here), each keyed by its exact rule text: a vendored CRD with a create-time
  rule not transcribed is refused when loaded. Transition rules (`oldSelf`: immutability on update) do not apply
  to a new object. Defaults are not applied (the server fills them in; they never make an object invalid).
- What CRDs embed from core types is also checked with the core schemas: the object's metadata as a strict
  `ObjectMeta` (CRDs declare the top-level `metadata` as an open object), and a JobSet's replicated-job template
  as a strict `batch/v1 Job` (on top of the CRD's own copy of the pod schema). Names and labels get Kubernetes'
  syntax rules (the schemas carry no patterns for them).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainforge._optional import require

KUBERNETES_VERSION = "1.33"
CRD_DIR = Path(__file__).parent / "crds"

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Keywords of the OpenAPI v3 subset that structural CRD schemas use. A schema using anything else is refused when
# the CRDs are loaded, so a newer CRD with a new keyword cannot be half-checked silently.
_CHECKED = {"type", "properties", "additionalProperties", "items", "required", "enum", "pattern", "minLength",
            "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minItems",
            "maxItems", "uniqueItems", "minProperties", "maxProperties", "format", "nullable", "anyOf", "allOf",
            "oneOf", "not", "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields",
            "x-kubernetes-embedded-resource", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
            "x-kubernetes-validations"}
_NOT_VALIDATING = {"description", "default", "example", "title", "x-kubernetes-map-type"}
_INT_RANGES = {"int32": (-2**31, 2**31 - 1), "int64": (-2**63, 2**63 - 1)}
_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_HOST = "kubernetes.io/hostname"


def _no_borrowing_without_cohort(field: str) -> Callable[[Any], bool]:
    return lambda s: field in s or "resourceGroups" not in s or all(
        "borrowingLimit" not in r for rg in s["resourceGroups"] for f in rg.get("flavors", [])
        for r in f.get("resources", []))


# The create-time CEL rules of the vendored CRDs, by their exact text -> the same predicate in Python (`self` is
# the value at the schema node carrying the rule; fields the server would default are read with their defaults).
_CEL: dict[str, Callable[[Any], bool]] = {
    "!(has(self.startupPolicy) && self.startupPolicy.startupPolicyOrder == 'InOrder' && "
    "self.replicatedJobs.exists(x, has(x.dependsOn)))":
        lambda s: not ((s.get("startupPolicy") or {}).get("startupPolicyOrder") == "InOrder"
                       and any("dependsOn" in x for x in s.get("replicatedJobs", []))),
    "self.templates.all(t, !has(t.metadata.namespace) || size(t.metadata.namespace) == 0)":
        lambda s: all(not (t.get("metadata") or {}).get("namespace") for t in s.get("templates", [])),
    "!has(self.cohort) && has(self.resourceGroups) ? self.resourceGroups.all(rg, rg.flavors.all(f, "
    "f.resources.all(r, !has(r.borrowingLimit)))) : true": _no_borrowing_without_cohort("cohort"),
    "!has(self.cohortName) && has(self.resourceGroups) ? self.resourceGroups.all(rg, rg.flavors.all(f, "
    "f.resources.all(r, !has(r.borrowingLimit)))) : true": _no_borrowing_without_cohort("cohortName"),
    "!has(self.preference) || (self.whenCanBorrow == 'TryNextFlavor' && self.whenCanPreempt == 'TryNextFlavor')":
        lambda s: "preference" not in s or (s.get("whenCanBorrow", "MayStopSearch") == "TryNextFlavor"
                                            and s.get("whenCanPreempt", "TryNextFlavor") == "TryNextFlavor"),
    "!(self.reclaimWithinCohort == 'Never' && has(self.borrowWithinCohort) &&  "
    "self.borrowWithinCohort.policy != 'Never')":
        lambda s: not (s.get("reclaimWithinCohort", "Never") == "Never" and "borrowWithinCohort" in s
                       and (s["borrowWithinCohort"] or {}).get("policy", "Never") != "Never"),
    "self.flavors.all(x, size(x.resources) == size(self.coveredResources))":
        lambda s: all(len(x.get("resources", [])) == len(s.get("coveredResources", [])) for x in s.get("flavors", [])),
    "!has(self.topologyName) || self.nodeLabels.size() >= 1":
        lambda s: "topologyName" not in s or len(s.get("nodeLabels") or {}) >= 1,
    "self.all(x, x.effect in ['NoSchedule', 'PreferNoSchedule', 'NoExecute'])":
        lambda s: all(x.get("effect") in _EFFECTS for x in s),
    "self.all(x, !has(x.key) ? x.operator == 'Exists' : true)":
        lambda s: all("key" in x or x.get("operator") == "Exists" for x in s),
    "self.all(x, has(x.tolerationSeconds) ? x.effect == 'NoExecute' : true)":
        lambda s: all("tolerationSeconds" not in x or x.get("effect") == "NoExecute" for x in s),
    "self.all(x, !has(x.operator) || x.operator in ['Equal', 'Exists'])":
        lambda s: all(x.get("operator", "Equal") in ("Equal", "Exists") for x in s),
    "self.all(x, has(x.operator) && x.operator == 'Exists' ? !has(x.value) : true)":
        lambda s: all(x.get("operator") != "Exists" or "value" not in x for x in s),
    "self.all(x, !has(x.effect) || x.effect in ['NoSchedule', 'PreferNoSchedule', 'NoExecute'])":
        lambda s: all(x.get("effect", "NoSchedule") in _EFFECTS for x in s),
    "size(self.filter(i, size(self.filter(j, j == i)) > 1)) == 0":
        lambda s: len(s) == len({json.dumps(x, sort_keys=True) for x in s}),
    "size(self.filter(i, i.nodeLabel == 'kubernetes.io/hostname')) == 0 || "
    "self[size(self) - 1].nodeLabel == 'kubernetes.io/hostname'":
        lambda s: all(x.get("nodeLabel") != _HOST for x in s) or s[-1].get("nodeLabel") == _HOST,
}


class ManifestInvalid(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class CrdVersion:
    kind: str
    api_version: str
    scope: str
    """`Namespaced` or `Cluster`."""
    storage: bool
    deprecated: bool
    schema: dict[str, Any]
    source: str
    """The vendored file it came from (named in errors)."""


def _check_keywords(schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        raise ValueError(f"{where}: a schema must be a mapping")
    unknown = set(schema) - _CHECKED - _NOT_VALIDATING
    if unknown:
        raise ValueError(f"{where}: schema keyword(s) {sorted(unknown)} are not supported by "
                         "trainforge/infra/k8s/validate.py; extend the validator before vendoring this CRD")
    for rule in schema.get("x-kubernetes-validations") or []:
        if "oldSelf" not in rule["rule"] and rule["rule"] not in _CEL:
            raise ValueError(f"{where}: CEL rule {rule['rule']!r} is not transcribed in validate.py `_CEL`; add it "
                             "before vendoring this CRD")
    for name, sub in (schema.get("properties") or {}).items():
        _check_keywords(sub, f"{where}.{name}")
    for key in ("items", "additionalProperties", "not"):
        if isinstance(schema.get(key), dict):
            _check_keywords(schema[key], f"{where}.{key}")
    for key in ("anyOf", "allOf", "oneOf"):
        for i, sub in enumerate(schema.get(key) or []):
            _check_keywords(sub, f"{where}.{key}[{i}]")


@functools.cache
def crd_versions() -> dict[tuple[str, str], CrdVersion]:
    """(apiVersion, kind) -> the served version's schema, from every vendored CRD (loaded once per process:
    the JobSet CRD is 0.8 MB, about half a second with libyaml)."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    out: dict[tuple[str, str], CrdVersion] = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        for doc in yaml.load_all(path.read_text(), Loader=loader):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec["versions"]:
                if not version.get("served"):
                    continue
                schema = version["schema"]["openAPIV3Schema"]
                _check_keywords(schema, f"{path.name} {version['name']}")
                key = (f"{spec['group']}/{version['name']}", spec["names"]["kind"])
                out[key] = CrdVersion(kind=key[1], api_version=key[0], scope=spec["scope"],
                                      storage=bool(version.get("storage")),
                                      deprecated=bool(version.get("deprecated")), schema=schema, source=path.name)
    return out


def _at(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    if _IDENT.match(key):
        return f"{path}.{key}" if path else key
    return f'{path}["{key}"]'


def _type_name(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(value), type(value).__name__)


_PY_TYPES: dict[str, type | tuple[type, ...]] = {"string": str, "boolean": bool, "array": list, "object": dict,
                                                  "integer": int, "number": (int, float)}


def _is_type(value: Any, t: str) -> bool:
    if isinstance(value, bool) and t != "boolean":  # bool is an int subclass in Python, never in JSON
        return False
    return isinstance(value, _PY_TYPES.get(t, object))


def schema_errors(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Every way `value` breaks the structural schema, each as `<field path>: <what is wrong>` (empty = valid)."""
    errors: list[str] = []
    _validate(value, schema, path, errors, root=True)
    return errors


def _validate(value: Any, schema: dict[str, Any], path: str, errors: list[str], *, root: bool = False) -> None:
    where = path or "<object>"
    if value is None:
        if not schema.get("nullable"):
            errors.append(f"{where}: null is not allowed here")
        return
    int_or_string = schema.get("x-kubernetes-int-or-string")
    t = schema.get("type")
    if int_or_string:
        if not (_is_type(value, "integer") or isinstance(value, str)):
            errors.append(f"{where}: must be an integer or a string, not {_type_name(value)}")
            return
    elif t and not _is_type(value, t):
        errors.append(f"{where}: must be {'an' if t[0] in 'aeiou' else 'a'} {t}, not {_type_name(value)} "
                      f"({value!r:.60})")
        return
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, str):
        _string(value, schema, where, errors)
    elif _is_type(value, "number"):
        _number(value, schema, where, errors)
    elif isinstance(value, list):
        _array(value, schema, path, errors)
    elif isinstance(value, dict):
        _object(value, schema, path, errors, root=root)
    for sub in schema.get("allOf") or []:
        _validate(value, sub, path, errors)
    # int-or-string's anyOf [integer, string] is checked above
    if schema.get("anyOf") and not int_or_string and all(schema_errors(value, sub, path) for sub in schema["anyOf"]):
        errors.append(f"{where}: matches none of the allowed forms (anyOf)")
    if schema.get("oneOf"):
        matching = sum(not schema_errors(value, sub, path) for sub in schema["oneOf"])
        if matching != 1:
            errors.append(f"{where}: must match exactly one of the allowed forms (oneOf), matches {matching}")
    if isinstance(schema.get("not"), dict) and not schema_errors(value, schema["not"], path):
        errors.append(f"{where}: is a form that is not allowed here (not)")
    for rule in schema.get("x-kubernetes-validations") or []:
        if "oldSelf" not in rule["rule"] and not _cel_holds(rule["rule"], value):
            errors.append(f"{where}: {rule.get('message') or 'fails a validation rule'} (the CRD's rule "
                          f"`{rule['rule']}`)")


def _cel_holds(rule: str, value: Any) -> bool:
    try:
        return _CEL[rule](value)
    except (AttributeError, TypeError, KeyError, IndexError):
        return True  # a malformed value below this node: the structural checks report it


def _string(value: str, schema: dict[str, Any], where: str, errors: list[str]) -> None:
    if "minLength" in schema and len(value) < schema["minLength"]:
        errors.append(f"{where}: {value!r} is shorter than {schema['minLength']} characters")
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        errors.append(f"{where}: {len(value)} characters, at most {schema['maxLength']} allowed")
    if "pattern" in schema and not re.search(schema["pattern"], value):
        errors.append(f"{where}: {value!r} does not match the pattern {schema['pattern']}")


def _number(value: float, schema: dict[str, Any], where: str, errors: list[str]) -> None:
    low, high = schema.get("minimum"), schema.get("maximum")
    if low is not None and (value < low or (schema.get("exclusiveMinimum") and value == low)):
        errors.append(f"{where}: {value} is below the minimum {low}")
    if high is not None and (value > high or (schema.get("exclusiveMaximum") and value == high)):
        errors.append(f"{where}: {value} is above the maximum {high}")
    if schema.get("multipleOf") and value % schema["multipleOf"]:
        errors.append(f"{where}: {value} is not a multiple of {schema['multipleOf']}")
    bounds = _INT_RANGES.get(schema.get("format", ""))
    if bounds and isinstance(value, int) and not bounds[0] <= value <= bounds[1]:
        errors.append(f"{where}: {value} does not fit {schema['format']}")


def _array(value: list[Any], schema: dict[str, Any], path: str, errors: list[str]) -> None:
    where = path or "<object>"
    if "minItems" in schema and len(value) < schema["minItems"]:
        errors.append(f"{where}: {len(value)} items, at least {schema['minItems']} needed")
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        errors.append(f"{where}: {len(value)} items, at most {schema['maxItems']} allowed")
    list_type = schema.get("x-kubernetes-list-type")
    if list_type == "set" or schema.get("uniqueItems"):
        seen: list[Any] = []
        for item in value:
            if item in seen:
                errors.append(f"{where}: {item!r} appears twice (a set)")
            seen.append(item)
    if list_type == "map":
        keys = schema.get("x-kubernetes-list-map-keys") or []
        seen_keys: set[tuple[Any, ...]] = set()
        for item in value:
            if isinstance(item, dict):
                k = tuple(item.get(name) for name in keys)
                if k in seen_keys:
                    errors.append(f"{where}: two items with {dict(zip(keys, k, strict=True))} (keys must be unique)")
                seen_keys.add(k)
    if isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            _validate(item, schema["items"], _at(path, i), errors)


def _object(value: dict[str, Any], schema: dict[str, Any], path: str, errors: list[str], *, root: bool) -> None:
    where = path or "<object>"
    for name in schema.get("required") or []:
        if name not in value:
            errors.append(f"{_at(path, name)}: required field missing")
    if "minProperties" in schema and len(value) < schema["minProperties"]:
        errors.append(f"{where}: {len(value)} fields, at least {schema['minProperties']} needed")
    if "maxProperties" in schema and len(value) > schema["maxProperties"]:
        errors.append(f"{where}: {len(value)} fields, at most {schema['maxProperties']} allowed")
    props: dict[str, Any] = schema.get("properties") or {}
    extra = schema.get("additionalProperties")
    preserve = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
    embedded = bool(schema.get("x-kubernetes-embedded-resource"))
    for key, item in value.items():
        sub = _at(path, key)
        if key in props:
            if root and key == "metadata":
                continue  # the API server's ObjectMeta, checked as core metadata (validate_manifest)
            _validate(item, props[key], sub, errors)
        elif isinstance(extra, dict):
            _validate(item, extra, sub, errors)
        elif extra is True or preserve or (embedded and key in ("apiVersion", "kind", "metadata")):
            continue
        else:
            known = ", ".join(sorted(props)) or "none: the schema declares no fields here"
            errors.append(f"{sub}: unknown field {key!r} (known fields: {known})")


@functools.cache
def _core_validator(api_version: str, kind: str) -> Any:
    """kubernetes-validate's strict schema of one core kind as a ready validator, built once per process:
    `kubernetes_validate.validate` re-reads its 5 MB `_definitions.json` on every call (0.2 s per object)."""
    import jsonschema
    import kubernetes_validate
    from kubernetes_validate import utils
    from referencing import Registry, Resource

    version = [v for v in utils.all_versions() if utils.major_minor(v) <= KUBERNETES_VERSION][-1]
    schema_dir = f"kubernetes-json-schema/v{version}-local-strict"
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    try:
        schema = utils.schema_contents(f"{schema_dir}/{kind.lower()}-{group_version}.json", KUBERNETES_VERSION)
    except FileNotFoundError:
        raise kubernetes_validate.SchemaNotFoundError(version=KUBERNETES_VERSION, kind=kind,
                                                      api_version=api_version) from None
    definitions = utils.schema_contents(f"{schema_dir}/_definitions.json", KUBERNETES_VERSION)
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def _core(obj: dict[str, Any], where: str) -> None:
    # The CRDs are checked by this module's own walker; core kinds need kubernetes-validate's schemas.
    for module in ("jsonschema", "kubernetes_validate", "referencing"):
        require(module, purpose="validating core Kubernetes objects offline (render --validate)")
    import jsonschema
    import kubernetes_validate

    try:
        _core_validator(obj.get("apiVersion", "?"), obj.get("kind", "?")).validate(obj)
    except jsonschema.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        raise ManifestInvalid(f"{where}: {path}: {exc.message}") from None
    except kubernetes_validate.SchemaNotFoundError as exc:
        raise ManifestInvalid(f"{where}: {exc.message}") from None


def _crd(obj: dict[str, Any], crd: CrdVersion, where: str) -> None:
    errors = schema_errors(obj, crd.schema)
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ManifestInvalid(f"{where}: {errors[0]}{more} [schema: {crd.source}, {crd.api_version}]")


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


_CORE_CLUSTER_SCOPED = {"PriorityClass", "Namespace", "ClusterRole", "ClusterRoleBinding", "StorageClass"}


def crd_for(obj: dict[str, Any]) -> CrdVersion | None:
    """The vendored CRD version `obj` is an instance of; None for a core kind. An apiVersion the CRD does not serve
    is an error (naming the versions it does)."""
    api, kind = obj.get("apiVersion", "?"), obj.get("kind", "?")
    versions = crd_versions()
    if (api, kind) in versions:
        return versions[(api, kind)]
    served = sorted(v.api_version for (a, k), v in versions.items() if k == kind and a.split("/")[0] ==
                    api.split("/")[0])
    if served:
        meta = obj.get("metadata") or {}
        raise ManifestInvalid(f"{kind}/{meta.get('name', '?')}: apiVersion {api!r} is not served by the "
                              f"{kind} CRD; use one of {served}")
    return None


def validate_manifest(obj: dict[str, Any]) -> None:
    """Raise ManifestInvalid naming the object and the field when `obj` would be refused by the API server."""
    kind = obj.get("kind", "?")
    meta = obj.get("metadata") or {}
    where = f"{kind}/{meta.get('name', '?')}"
    crd = crd_for(obj)
    cluster_scoped = crd.scope == "Cluster" if crd else kind in _CORE_CLUSTER_SCOPED
    if not cluster_scoped and not meta.get("namespace"):
        raise ManifestInvalid(f"{where}: a namespaced object needs metadata.namespace")
    if cluster_scoped and meta.get("namespace"):
        raise ManifestInvalid(f"{where}: {kind} is cluster-scoped; remove metadata.namespace")
    if crd is None:
        _core(obj, where)
        _names_and_labels(meta, where)
        return
    _crd(obj, crd, where)
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
