"""What the Kubernetes side would do with a rendered manifest, for tests without a cluster: the
operators' CRD schemas (tests/launch/k8s_schemas/, strict about unknown fields, which the API
server would prune silently), the kubelet's ``$(VAR)`` expansion, and the environment each
operator gives its pods."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SCHEMAS = Path(__file__).resolve().parent / "k8s_schemas"
# kind -> the CRD schema files it must validate against (oldest and newest JobSet supported)
SCHEMA_FILES = {"PyTorchJob": ("pytorchjob-v1.9.0.json",), "JobSet": ("jobset-v0.6.0.json", "jobset-v0.12.0.json")}


def strict(schema: Any) -> Any:
    """The schema with ``additionalProperties: false`` on every object that lists its properties
    (unless it keeps unknown fields): a misspelt field fails here instead of vanishing."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def crd_schemas(kind: str) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for name in SCHEMA_FILES[kind]:
        doc = json.loads((SCHEMAS / name).read_text())
        assert doc["kind"] == kind, name
        found.append((f"{doc['source']['repository']}@{doc['source']['tag']}", strict(doc["openAPIV3Schema"])))
    return found


_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """The kubelet's expansion of a command word or env value: ``$$`` is ``$``, ``$(NAME)`` the
    variable's value when it is defined, else kept as written."""
    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return _REF.sub(one, text)


def pod_templates(workload: dict[str, Any]) -> list[dict[str, Any]]:
    if workload["kind"] == "PyTorchJob":
        return [spec["template"] for spec in workload["spec"]["pytorchReplicaSpecs"].values()]
    return [job["template"]["spec"]["template"] for job in workload["spec"]["replicatedJobs"]]


def operator_env(workload: dict[str, Any], pod: int, master_addr: str, port: int) -> dict[str, str]:
    """The variables the operator adds to pod ``pod``'s container (training-operator v1.9.0's
    pytorch/envvar.go; a Job's JOB_COMPLETION_INDEX for JobSet)."""
    if workload["kind"] == "JobSet":
        return {"JOB_COMPLETION_INDEX": str(pod)}
    specs = workload["spec"]["pytorchReplicaSpecs"]
    nodes = sum(spec["replicas"] for spec in specs.values())
    nproc = workload["spec"]["nprocPerNode"]
    return {"PYTHONUNBUFFERED": "1", "MASTER_ADDR": master_addr, "MASTER_PORT": str(port),
            "PET_MASTER_ADDR": master_addr, "PET_MASTER_PORT": str(port), "WORLD_SIZE": str(nodes * int(nproc)),
            "RANK": str(pod), "PET_NODE_RANK": str(pod), "PET_NPROC_PER_NODE": nproc, "PET_NNODES": str(nodes)}


def container_env(container: dict[str, Any], operator: Mapping[str, str],
                  secrets: Mapping[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: the operator's variables appended to
    the template's, values expanded in order, secretKeyRef from ``secrets``."""
    env: dict[str, str] = {}
    for item in [*container.get("env", []), *({"name": k, "value": v} for k, v in operator.items())]:
        if "valueFrom" in item:
            env[item["name"]] = secrets[item["valueFrom"]["secretKeyRef"]["key"]]
        else:
            env[item["name"]] = expand(item["value"], env)
    return env
