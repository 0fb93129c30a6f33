"""Generates helm/maskd/values.schema.json (JSON Schema draft-07, as Helm expects).

    python helm/tools/gen_schema.py

tests/test_helm.py checks that the shipped file equals build().
"""
import json
import pathlib

import yaml

CHART = pathlib.Path(__file__).resolve().parents[1] / "maskd"
# The values that become server flags: one line each in the chart's server-flags.yaml.
SERVER_FLAGS = yaml.safe_load((CHART / "server-flags.yaml").read_text())

port = {"type": "integer", "minimum": 1, "maximum": 65535}
posint = {"type": "integer", "minimum": 1}
nonneg = {"type": "integer", "minimum": 0}
opt_posint = {"type": ["integer", "null"], "minimum": 1}
obj = {"type": "object"}
arr = {"type": "array"}
strmap = {"type": "object", "additionalProperties": {"type": "string"}}
quantity = {"anyOf": [{"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei|e[0-9]+)?$"},
                      {"type": "number", "minimum": 0}]}
resources = {"type": "object", "additionalProperties": False, "properties": {
    "requests": {"type": "object", "additionalProperties": {"$ref": "#/definitions/quantity"}},
    "limits": {"type": "object", "additionalProperties": {"$ref": "#/definitions/quantity"}},
    "claims": arr}}
dns_name = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
            "maxLength": 253}
int_or_percent = {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": r"^[0-9]+%$"},
                            {"type": "null"}]}
scalar = {"type": ["string", "number", "boolean"]}
scalar_map = {"type": "object", "additionalProperties": scalar}
service_type = {"type": "string", "enum": ["ClusterIP", "NodePort", "LoadBalancer"]}
duration = {"type": "string", "pattern": r"^([0-9]+(ms|s|m|h))+$"}


def probe(with_service=False, with_enabled=False, with_success=False):
    props = {"periodSeconds": posint, "timeoutSeconds": posint, "failureThreshold": posint}
    if with_service:
        props["service"] = {"type": "string"}
    if with_enabled:
        props["enabled"] = {"type": "boolean"}
    if with_success:
        props["successThreshold"] = posint
    return {"type": "object", "additionalProperties": False, "properties": props}


def server_flag_values() -> dict:
    """The schema of each `server.*` value that server-flags.yaml maps to a flag."""
    out = {}
    for row in SERVER_FLAGS:
        kind = {"int": "integer", "number": "number", "string": "string", "bool": "boolean"}[row["type"]]
        schema: dict = {"type": kind if row.get("required") else [kind, "null"]}
        if "min" in row:
            schema["minimum"] = row["min"]
        if "exclusiveMin" in row:
            schema["exclusiveMinimum"] = row["exclusiveMin"]
        if "max" in row:
            schema["maximum"] = row["max"]
        if row["type"] == "string" and row.get("required") and "enum" not in row:
            schema["minLength"] = 1
        if "enum" in row:
            schema["enum"] = list(row["enum"]) + ([] if row.get("required") else [None])
        out[row["value"]] = schema
    return out


def sched():
    return {"nodeSelector": strmap, "tolerations": arr, "affinity": obj}


def strict(props, required=()):
    s = {"type": "object", "additionalProperties": False, "properties": props}
    if required:
        s["required"] = list(required)
    return s


secret_ref_rule = lambda: {"if": {"properties": {"enabled": {"const": True}}, "required": ["enabled"]},
                           "then": {"properties": {"secretName": {"$ref": "#/definitions/dnsName"}},
                                    "required": ["secretName"]}}

# auth.enabled needs a token's secret or a tokens file's secret (both may be set).
auth_secret_rule = lambda: {
    "if": {"properties": {"enabled": {"const": True}}, "required": ["enabled"]},
    "then": {"anyOf": [{"properties": {"secretName": {"$ref": "#/definitions/dnsName"}}, "required": ["secretName"]},
                       {"properties": {"tokensSecretName": {"$ref": "#/definitions/dnsName"}},
                        "required": ["tokensSecretName"]}]}}

SCHEMA = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "title": "maskd chart values",
    "type": "object",
    "additionalProperties": False,
    "definitions": {"quantity": quantity, "resources": resources, "dnsName": dns_name},
    "required": ["mode", "image", "server", "tls", "auth"],
    "properties": {
        "global": obj,
        "mode": {"type": "string", "enum": ["standalone", "ray"],
                 "description": "standalone: Deployment of `maskd serve`; "
                                "ray: KubeRay RayCluster + `maskd cluster up`."},
        "nameOverride": {"type": "string"},
        "fullnameOverride": {"type": "string"},
        "commonLabels": strmap,
        "image": strict({"repository": {"type": "string", "minLength": 1},
                         "tag": {"type": ["string", "number"]},
                         "digest": {"type": "string", "pattern": r"^$|^[a-z0-9]+:[a-f0-9]{32,}$"},
                         "pullPolicy": {"type": "string", "enum": ["Always", "IfNotPresent", "Never"]}},
                        ["repository", "pullPolicy"]),
        "imagePullSecrets": {"type": "array", "items": {"anyOf": [{"type": "string"},
                                                                  strict({"name": {"type": "string"}}, ["name"])]}},
        "serviceAccount": strict({"create": {"type": "boolean"}, "name": {"type": "string"}, "annotations": strmap,
                                  "automountServiceAccountToken": {"type": "boolean"}}),
        "server": strict({
            **server_flag_values(),
            "extraArgs": {"type": "array", "items": {"type": ["string", "number", "boolean"]}},
            "env": arr, "envFrom": arr,
        }, [row["value"] for row in SERVER_FLAGS if row.get("required")]),
        "tls": {**strict({"enabled": {"type": "boolean"}, "secretName": {"type": "string"},
                          "certKey": {"type": "string", "minLength": 1}, "keyKey": {"type": "string", "minLength": 1},
                          "mountPath": {"type": "string", "pattern": "^/"},
                          "clientCAKey": {"type": "string"}}, ["enabled"]), **secret_ref_rule()},
        "auth": {**strict({"enabled": {"type": "boolean"}, "secretName": {"type": "string"},
                           "secretKey": {"type": "string", "minLength": 1}, "tokensSecretName": {"type": "string"},
                           "tokensSecretKey": {"type": "string", "minLength": 1},
                           "mountPath": {"type": "string", "pattern": "^/"}, "allowPlaintext": {"type": "boolean"}},
                          ["enabled"]), **auth_secret_rule()},
        "replicaCount": nonneg,
        "resources": {"$ref": "#/definitions/resources"},
        **sched(),
        "topologySpreadConstraints": arr,
        "priorityClassName": {"type": "string"},
        "podAnnotations": strmap,
        "podLabels": strmap,
        "podSecurityContext": obj,
        "securityContext": obj,
        "terminationGracePeriodSeconds": nonneg,
        "preStop": strict({"type": {"type": "string", "enum": ["sleep", "exec", "none"]}, "seconds": nonneg}),
        "probes": strict({"type": {"type": "string", "enum": ["auto", "grpc", "tcp"]},
                          "startup": probe(with_enabled=True),
                          "readiness": probe(with_service=True, with_success=True),
                          "liveness": probe(with_service=True)}),
        "service": strict({"type": {"type": "string", "enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                           "annotations": strmap, "labels": strmap,
                           "headless": strict({"enabled": {"type": "boolean"}}),
                           "sessionAffinity": {"type": "string", "enum": ["None", "ClientIP"]},
                           "trafficDistribution": {"type": "string"}}),
        "podDisruptionBudget": strict({"enabled": {"type": "boolean"}, "maxUnavailable": int_or_percent,
                                       "minAvailable": int_or_percent}),
        "autoscaling": strict({"enabled": {"type": "boolean"}, "minReplicas": posint, "maxReplicas": posint,
                               "targetCPUUtilizationPercentage": {"type": ["integer", "null"], "minimum": 1,
                                                                  "maximum": 1000},
                               "metrics": arr, "behavior": obj}),
        "ray": strict({
            "rayVersion": {"type": ["string", "number"]},
            "enableInTreeAutoscaling": {"type": "boolean"},
            "head": strict({"rayStartParams": scalar_map,
                            "resources": {"$ref": "#/definitions/resources"},
                            "serviceType": service_type,
                            **sched(), "podAnnotations": strmap, "podLabels": strmap}),
            "worker": strict({"groupName": {"$ref": "#/definitions/dnsName"}, "threads": opt_posint,
                              "replicas": nonneg, "minReplicas": nonneg, "maxReplicas": posint,
                              "customResources": {"type": "object", "minProperties": 1,
                                                  "propertyNames": {"pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                                                  "additionalProperties": {"type": "number", "exclusiveMinimum": 0}},
                              "rayStartParams": scalar_map,
                              "resources": {"$ref": "#/definitions/resources"},
                              **sched(), "topologySpreadConstraints": arr,
                              "podAnnotations": strmap, "podLabels": strmap,
                              "terminationGracePeriodSeconds": nonneg},
                             ["groupName", "replicas", "minReplicas", "maxReplicas", "customResources"]),
            "clusterUp": strict({"workers": opt_posint, "extraArgs": {"type": "array", "items": scalar},
                                 "resources": {"$ref": "#/definitions/resources"}}),
            "directory": strict({"port": port, "service": strict({"type": service_type, "annotations": strmap})},
                                ["port"]),
        }),
        "metrics": strict({
            "serviceMonitor": strict({"enabled": {"type": "boolean"}, "labels": strmap, "interval": duration,
                                      "scrapeTimeout": duration, "namespace": {"type": "string"},
                                      "relabelings": arr, "metricRelabelings": arr}),
            "dashboard": strict({"enabled": {"type": "boolean"}, "label": {"type": "string", "minLength": 1},
                                 "labelValue": {"type": ["string", "number"]}, "folder": {"type": "string"},
                                 "namespace": {"type": "string"}, "annotations": strmap}),
        }),
        "tests": strict({"enabled": {"type": "boolean"}}),
    },
}


def build() -> dict:
    return SCHEMA


def main() -> None:
    path = CHART / "values.schema.json"
    path.write_text(json.dumps(build(), indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
