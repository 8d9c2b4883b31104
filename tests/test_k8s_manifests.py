"""deploy/k8s/ checked against schemas: the Kubernetes objects against the Kubernetes API's own OpenAPI schemas
(kubernetes-validate, strict: an unknown or misspelt field fails), the inference gateway's custom resources
against deploy/k8s/schemas/; and what the server relies on is there: probes on /health, /metrics scraped, the
container port the Service and the InferencePool point at."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
CUSTOM = {("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.json",
          ("inference.networking.x-k8s.io/v1alpha2", "InferenceModel"): "inferencemodel-v1alpha2.json"}
VERSION = "1.33.0"


def documents() -> list[dict]:
    return [doc for path in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_each_manifest_is_valid(doc):
    schema = CUSTOM.get((doc["apiVersion"], doc["kind"]))
    if schema is None:
        kubernetes_validate.validate(doc, VERSION, strict=True)
    else:
        jsonschema.validate(doc, json.loads((K8S / "schemas" / schema).read_text()))


def test_a_misspelt_field_is_caught():
    deployment = next(d for d in documents() if d["kind"] == "Deployment")
    broken = json.loads(json.dumps(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/health"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSION, strict=True)
    pool = next(d for d in documents() if d["kind"] == "InferencePool")
    pool = {**pool, "spec": {**pool["spec"], "targetPorts": [{"number": 70000}]}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, json.loads((K8S / "schemas" / CUSTOM[(pool["apiVersion"], "InferencePool")]).read_text()))


def test_probes_metrics_and_ports_line_up():
    docs = {d["kind"]: d for d in documents()}
    pod = docs["Deployment"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    port = container["ports"][0]["containerPort"]
    assert f"--port={port}" in container["args"] and annotations["prometheus.io/port"] == str(port)
    assert docs["InferencePool"]["spec"]["targetPorts"][0]["number"] == port
    labels = pod["metadata"]["labels"]
    assert docs["Service"]["spec"]["selector"] == labels == docs["InferencePool"]["spec"]["selector"]["matchLabels"]
    adapters = {a.split("=", 1)[1].split("=")[0] for a in container["args"] if a.startswith("--lora=")}
    assert {t["name"] for t in docs["InferenceModel"]["spec"]["targetModels"]} <= adapters
