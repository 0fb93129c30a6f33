"""Validation of custom resources against the CRDs their operators ship (tests/deploy/crds/).

A CRD's ``openAPIV3Schema`` is a structural schema; the API server prunes or refuses (with
``kubectl --validate=strict``, the default) any field the schema does not declare. This turns
it into a JSON Schema that does the same, strictly:

- an object with ``properties`` and no ``additionalProperties`` accepts no other field, unless
  it carries ``x-kubernetes-preserve-unknown-fields: true``;
- ``x-kubernetes-int-or-string: true`` accepts an integer or a string;
- ``x-kubernetes-embedded-resource`` objects keep their declared fields only (as above).

CEL rules (``x-kubernetes-validations``) cannot be evaluated here: a field that carries them must
not be set by the chart (``validate`` refuses it, so that a new one gets a real check).
"""
from __future__ import annotations

import functools
import pathlib
from typing import Any

import jsonschema
import yaml

CRD_DIR = pathlib.Path(__file__).resolve().parent / "crds"
CRD_FILES = {
    ("ray.io/v1", "RayCluster"): "ray.io_rayclusters.yaml",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
}


class CRDValidationError(AssertionError):
    pass


def _strict(node: Any, cel_paths: list[tuple[str, ...]], path: tuple[str, ...] = ()) -> Any:
    if isinstance(node, list):
        return [_strict(x, cel_paths, path) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: _strict(sub, cel_paths, (*path, name)) for name, sub in value.items()}
        elif key == "items":
            out[key] = _strict(value, cel_paths, (*path, "[]"))
        elif key == "additionalProperties" and isinstance(value, dict):
            out[key] = _strict(value, cel_paths, (*path, "*"))
        elif key.startswith("x-kubernetes-") or key in ("description", "format"):
            continue   # format: int32/int64/date-time are checked by the API server, not needed here
        else:
            out[key] = _strict(value, cel_paths, path)
    if node.get("x-kubernetes-validations"):
        cel_paths.append(path)
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out = {"anyOf": [{"type": "integer"}, {"type": "string"}], **out}
    if (node.get("type") == "object" and "properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.cache
def _crd(api_version: str, kind: str) -> tuple[jsonschema.Draft7Validator, tuple[tuple[str, ...], ...], str]:
    file = CRD_FILES[(api_version, kind)]
    crd = yaml.safe_load((CRD_DIR / file).read_text())
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind, file
    (entry,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert entry["served"], f"{file}: {api_version} is not served"
    cel: list[tuple[str, ...]] = []
    schema = _strict(entry["schema"]["openAPIV3Schema"], cel)
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema), tuple(cel), file


def _present(obj: Any, path: tuple[str, ...]) -> bool:
    if not path:
        return True
    head, rest = path[0], path[1:]
    if head == "[]":
        return isinstance(obj, list) and any(_present(x, rest) for x in obj)
    if head == "*":
        return isinstance(obj, dict) and any(_present(x, rest) for x in obj.values())
    return isinstance(obj, dict) and head in obj and _present(obj[head], rest)


def validate(obj: dict) -> None:
    """Raises CRDValidationError naming the first problems of a custom resource."""
    validator, cel_paths, file = _crd(obj["apiVersion"], obj["kind"])
    name = f"{obj['kind']}/{obj.get('metadata', {}).get('name')}"
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"  {'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message[:300]}" for e in errors[:10]]
        raise CRDValidationError(f"{name} does not validate against {file}:\n" + "\n".join(lines))
    for path in cel_paths:
        if _present(obj, path):
            raise CRDValidationError(f"{name} sets {'/'.join(path)}, which has CEL rules (x-kubernetes-validations) "
                                     f"in {file} that this test cannot evaluate")
