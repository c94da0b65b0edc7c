"""The Helm chart `helm/cbserve` (a KubeRay RayService).

Always: the chart's plain YAML files parse, its copy of the Serve config (`make chart-config`)
equals `ray_config.yaml`, and `values.yaml` has the documented keys.

With Helm (its Go SDK, from the `helm-python-sdk` package: `pip install helm-python-sdk==0.2.2`):
`helm lint`, and every template rendered for the default values and for other value sets
(`tp_size` 1 to 8, `values-8gpu.yaml`, autoscaling, the API key, the ServiceMonitor, a weights
volume or download, worker groups per accelerator type, the batch job on a shared volume),
checked as YAML, the RayService and RayJob against KubeRay's CRD schema (ray.io/v1, kept in
`tests/data/kuberay_v1_schemas.json.gz`: no unknown field, which Kubernetes would silently drop),
pod resources against what a replica asks Ray for, and `serveConfigV2` against Ray's own
`ServeDeploySchema`.

Security (issue 26): every pod and container under Kubernetes' "restricted" Pod Security
Standard with a read-only root filesystem; the NetworkPolicies evaluated as Kubernetes would for
outside clients, other pods, the KubeRay operator and the batch job's submitter; ClusterIP
services only and Ray's token authentication; the ServiceMonitor's API key; a comment on every
value; and (with `unshare`, marked ray/slow) Ray, Serve and cbserve run on such a filesystem.
"""

from __future__ import annotations

import copy
import functools
import gzip
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "cbserve"
RAY_CONFIG = REPO / "ray_config.yaml"

# Every key a user is told to set (values.yaml's comments and the README's "Deploy on Kubernetes").
DOCUMENTED_KEYS = [
    "image.repository",
    "image.tag",
    "image.pullPolicy",
    "imagePullSecrets",
    "rayVersion",
    "model.name",
    "model.servedModelName",
    "model.dtype",
    "model.mountPath",
    "model.volume",
    "model.download.enabled",
    "model.download.uri",
    "model.download.image",
    "model.download.endpointUrl",
    "model.download.secretName",
    "model.download.sizeLimit",
    "tp_size",
    "autoscaling.enabled",
    "autoscaling.minReplicas",
    "autoscaling.maxReplicas",
    "autoscaling.idleTimeoutSeconds",
    "autoscaling.upscalingMode",
    "replicas",
    "serve.httpPort",
    "serve.grpcPort",
    "serve.args",
    "serve.runtimeEnv",
    "serve.ingressCpus",
    "apiKey.existingSecret",
    "apiKey.secretKey",
    "head.rayStartParams",
    "head.resources",
    "head.nodeSelector",
    "head.tolerations",
    "head.affinity",
    "worker.groupName",
    "worker.cpusPerRank",
    "worker.memoryPerRankGi",
    "worker.extraCpus",
    "worker.groups",
    "worker.rayStartParams",
    "worker.resources",
    "worker.nodeSelector",
    "worker.tolerations",
    "worker.affinity",
    "env",
    "serviceMonitor.enabled",
    "serviceMonitor.interval",
    "serviceMonitor.scrapeTimeout",
    "serviceMonitor.labels",
    "shared.volume",
    "shared.mountPath",
    "batch.enabled",
    "batch.input",
    "batch.output",
    "batch.replicas",
    "batch.args",
    "batch.ttlSecondsAfterFinished",
    "batch.submitterResources",
    "apiKey.protectMetrics",
    "rayAuth.enabled",
    "podSecurityContext.runAsNonRoot",
    "podSecurityContext.runAsUser",
    "podSecurityContext.runAsGroup",
    "podSecurityContext.fsGroup",
    "podSecurityContext.seccompProfile",
    "containerSecurityContext.allowPrivilegeEscalation",
    "containerSecurityContext.readOnlyRootFilesystem",
    "containerSecurityContext.capabilities",
    "tmp.sizeLimit",
    "networkPolicy.enabled",
    "networkPolicy.kuberayOperator.namespace",
    "networkPolicy.kuberayOperator.podLabels",
    "networkPolicy.serveFrom",
    "networkPolicy.extraIngress",
]

DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

# With a read-only root filesystem every container writes under this emptyDir.
TMP_VOLUME = {"name": "tmp", "emptyDir": {}}
TMP_MOUNT = {"name": "tmp", "mountPath": "/tmp"}


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _get(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        assert isinstance(node, dict) and part in node, f"missing key {dotted}"
        node = node[part]
    return node


# ---- without Helm -------------------------------------------------------------------------------


def test_chart_files_are_yaml() -> None:
    chart = _load(CHART / "Chart.yaml")
    assert chart["apiVersion"] == "v2" and chart["name"] == "cbserve" and chart["type"] == "application"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])
    assert isinstance(_load(CHART / "values.yaml"), dict)
    templates = sorted(p.name for p in (CHART / "templates").iterdir())
    assert {"rayservice.yaml", "servicemonitor.yaml", "batchjob.yaml", "_helpers.tpl"} <= set(templates)
    assert _load(CHART / "values-8gpu.yaml")["tp_size"] == 8


def test_serve_config_copy_equals_ray_config() -> None:
    """One source of truth: the chart renders serveConfigV2 from this copy of ray_config.yaml.

    After changing ray_config.yaml: make chart-config (tests/helm/test_chart_config.py checks it was run).
    """
    assert _load(CHART / "files" / "serve_config.yaml") == _load(RAY_CONFIG)


def test_values_have_the_documented_keys() -> None:
    values = _load(CHART / "values.yaml")
    for key in DOCUMENTED_KEYS:
        _get(values, key)
    assert values["tp_size"] == 1 and values["autoscaling"]["enabled"] is True
    assert values["apiKey"]["existingSecret"] == "" and values["serviceMonitor"]["enabled"] is False
    assert values["worker"]["resources"] == {}  # sized from tp_size
    assert values["batch"]["enabled"] is False and values["shared"]["volume"] == {}


# ---- with Helm ----------------------------------------------------------------------------------

BIG_VALUES: dict[str, Any] = {
    "tp_size": 4,
    "model": {"name": "Qwen/Qwen2.5-7B-Instruct", "servedModelName": "qwen"},
    "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6},
    "apiKey": {"existingSecret": "cbserve-api-key", "secretKey": "key"},
    "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    "worker": {
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "resources": {
            "requests": {"cpu": "16", "memory": "128Gi"},
            "limits": {"cpu": "16", "memory": "128Gi"},
        },
        "rayStartParams": {"num-gpus": 4},
    },
    "head": {"nodeSelector": {"node-role": "cpu"}, "rayStartParams": {"num-cpus": "8"}},
    "serve": {"args": {"engine": {"page_size": 128}}},
    "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
}


@pytest.fixture(scope="module")
def helm() -> Any:
    return pytest.importorskip("helm_python", reason="Helm's SDK: pip install helm-python-sdk==0.2.2")


def render(helm: Any, values: dict[str, Any] | None) -> dict[str, list[dict[str, Any]]]:
    """Every template rendered and parsed as YAML: {template file name: [documents]}."""
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name="llm", namespace="serving")
    out: dict[str, list[dict[str, Any]]] = {}
    for path, text in manifests.items():
        name = Path(path).name
        if name == "NOTES.txt":
            assert "llm-cbserve-serve-svc" in text
            continue
        out[name] = [d for d in yaml.safe_load_all(text) if d is not None]
    return out


def rayservice(docs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    (svc,) = docs["rayservice.yaml"]
    check_crd_schema(svc)
    return svc


@functools.cache
def crd_schemas() -> dict[str, Any]:
    with gzip.open(REPO / "tests" / "data" / "kuberay_v1_schemas.json.gz") as f:
        return json.load(f)


def unknown_fields(doc: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Keys of `doc` that `schema` does not define (Kubernetes prunes them without a word)."""
    if isinstance(doc, list):
        return [u for i, item in enumerate(doc) for u in unknown_fields(item, schema.get("items", {}), f"{path}[{i}]")]
    if not isinstance(doc, dict) or schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    props = schema.get("properties")
    if props is None:
        extra = schema.get("additionalProperties")
        return [u for k, v in doc.items() for u in unknown_fields(v, extra, f"{path}.{k}")] if isinstance(
            extra, dict) else []
    out: list[str] = []
    for k, v in doc.items():
        out += unknown_fields(v, props[k], f"{path}.{k}") if k in props else [f"{path}.{k}"]
    return out


def check_crd_schema(doc: dict[str, Any]) -> None:
    """`doc` (a RayService or RayJob) as KubeRay's CRD (ray.io/v1) would admit it."""
    import jsonschema

    schema = crd_schemas()[doc["kind"]]
    jsonschema.Draft7Validator(schema).validate(doc)
    assert not unknown_fields(doc, schema), unknown_fields(doc, schema)


def check_kuberay_fields(svc: dict[str, Any]) -> None:
    """What KubeRay's CRD (ray.io/v1) and Kubernetes require of a RayService."""
    assert svc["apiVersion"] == "ray.io/v1" and svc["kind"] == "RayService"
    name = svc["metadata"]["name"]
    assert DNS_1123.match(name) and len(name) <= 40, name
    spec = svc["spec"]
    assert isinstance(spec["serveConfigV2"], str)
    cluster = spec["rayClusterConfig"]
    assert isinstance(cluster["enableInTreeAutoscaling"], bool)
    head = cluster["headGroupSpec"]
    groups = cluster["workerGroupSpecs"]
    assert len(groups) == 1
    for group in (head, *groups):
        params = group["rayStartParams"]
        assert isinstance(params, dict) and all(isinstance(v, str) for v in params.values()), params
        containers = group["template"]["spec"]["containers"]
        assert containers and all(c["name"] and c["image"] for c in containers)
        for c in containers:
            for port in c.get("ports", []):
                assert isinstance(port["containerPort"], int) and len(port["name"]) <= 15
    worker = groups[0]
    assert worker["groupName"]
    assert 0 <= worker["minReplicas"] <= worker["replicas"] <= worker["maxReplicas"]


def serve_config(svc: dict[str, Any]) -> dict[str, Any]:
    from ray.serve.schema import ServeDeploySchema

    cfg = yaml.safe_load(svc["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(cfg)  # raises on anything Serve would refuse
    return cfg


def app_args(cfg: dict[str, Any]) -> dict[str, Any]:
    from cbserve.cluster.settings import ClusterArgs

    (app,) = cfg["applications"]
    ClusterArgs(**app["args"])  # build_app would accept them
    return app["args"]


def test_helm_lint(helm: Any) -> None:
    for values in (None, BIG_VALUES):
        report = helm.lint(str(CHART), values, strict=True)
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert not report["errors"] and not problems, report


def test_default_values_render_the_serve_config_of_ray_config(helm: Any) -> None:
    docs = render(helm, None)
    assert docs["servicemonitor.yaml"] == []  # off by default
    svc = rayservice(docs)
    check_kuberay_fields(svc)
    cfg = serve_config(svc)
    ray_cfg = _load(RAY_CONFIG)
    args, ray_args = app_args(cfg), ray_cfg["applications"][0]["args"]

    # Everything comes from ray_config.yaml except what depends on the Kubernetes cluster.
    expected = copy.deepcopy(ray_args)
    expected.update(tp_size=1, dtype="bfloat16", api_key=None)
    expected["worker"].update(num_gpus=1, num_cpus=1)
    expected["worker"]["autoscaling"].update(min_replicas=1, max_replicas=4, initial_replicas=1)
    assert args == expected
    app, ray_app = cfg["applications"][0], ray_cfg["applications"][0]
    assert {k: v for k, v in app.items() if k not in ("args", "deployments")} == {
        k: v for k, v in ray_app.items() if k != "args"
    }
    assert cfg["http_options"] == {**ray_cfg["http_options"], "host": "0.0.0.0"}
    assert cfg["grpc_options"] == ray_cfg["grpc_options"]
    assert cfg["proxy_location"] == ray_cfg["proxy_location"]

    # No replica on the head: it has no CPU for Ray, and every deployment needs some.
    cluster = svc["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert {d["name"]: d["ray_actor_options"]["num_cpus"] for d in app["deployments"]} == {
        "OpenAIIngress": 0.1,
        "StatsBoard": 0.1,
    }
    assert args["worker"]["num_cpus"] > 0

    assert cluster["enableInTreeAutoscaling"] is True
    worker = cluster["workerGroupSpecs"][0]
    assert (worker["minReplicas"], worker["maxReplicas"]) == (1, 4)
    container = worker["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["requests"] == {"cpu": "2", "memory": "32Gi"}  # 1 rank x 1 CPU + 1; 32Gi per rank
    assert worker["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    for group in (cluster["headGroupSpec"], worker):
        env = {e["name"]: e for e in group["template"]["spec"]["containers"][0]["env"]}
        assert "CBSERVE_API_KEY" not in env  # no API key by default
        assert env["RAY_worker_niceness"]["value"] == "0"  # workers at the node's priority
        assert env["RAY_SERVE_ENABLE_HA_PROXY"]["value"] == "1"  # HAProxy ingress, as make serve runs
        assert env["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"]["value"] == "1"  # as make serve's controller


def test_tp4_autoscaling_api_key_and_service_monitor(helm: Any) -> None:
    docs = render(helm, BIG_VALUES)
    svc = rayservice(docs)
    check_kuberay_fields(svc)
    cfg = serve_config(svc)
    args = app_args(cfg)
    assert args["tp_size"] == 4 and args["model"] == "Qwen/Qwen2.5-7B-Instruct"
    assert args["served_model_name"] == "qwen" and args["api_key"] is None
    assert args["engine"]["page_size"] == 128  # serve.args merged over ray_config.yaml's
    assert (
        args["engine"]["max_batch_tokens"]
        == _load(RAY_CONFIG)["applications"][0]["args"]["engine"]["max_batch_tokens"]
    )
    auto = args["worker"]["autoscaling"]
    assert (auto["min_replicas"], auto["max_replicas"], auto["initial_replicas"]) == (2, 6, 2)

    cluster = svc["spec"]["rayClusterConfig"]
    head, worker = cluster["headGroupSpec"], cluster["workerGroupSpecs"][0]
    assert head["rayStartParams"]["num-cpus"] == "0"  # not overridable: no replicas on the head
    assert worker["rayStartParams"] == {"num-gpus": "4"}
    assert (worker["minReplicas"], worker["replicas"], worker["maxReplicas"]) == (2, 2, 6)
    wc = worker["template"]["spec"]["containers"][0]
    assert wc["resources"]["limits"] == {"cpu": "16", "memory": "128Gi", "nvidia.com/gpu": 4}
    assert worker["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert head["template"]["spec"]["nodeSelector"] == {"node-role": "cpu"}
    for container in (head["template"]["spec"]["containers"][0], wc):
        env = {e["name"]: e for e in container["env"]}
        assert env["CBSERVE_API_KEY"]["valueFrom"]["secretKeyRef"] == {
            "name": "cbserve-api-key",
            "key": "key",
        }
        assert env["HF_HUB_OFFLINE"]["value"] == "1"

    service, monitor = docs["servicemonitor.yaml"]
    assert service["kind"] == "Service" and monitor["kind"] == "ServiceMonitor"
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == ["serving"]
    pod_labels = head["template"]["metadata"]["labels"] | {
        "ray.io/node-type": "head"
    }  # KubeRay adds the latter
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"][0]["targetPort"] in {
        p["name"] for p in head["template"]["spec"]["containers"][0]["ports"]
    }


def test_one_replica_has_the_ingress_inside_the_worker(helm: Any) -> None:
    """ingress_placement auto with one worker replica (ClusterArgs.ingress_in_worker): no OpenAIIngress
    deployment to give CPUs to (Serve refuses a config naming a deployment the app does not have)."""
    from cbserve.cluster.settings import ClusterArgs

    for values, in_worker in (({"autoscaling": {"enabled": False}, "replicas": 1}, True),
                              ({"autoscaling": {"minReplicas": 1, "maxReplicas": 1}}, True),
                              ({"autoscaling": {"enabled": False}, "replicas": 1,
                                "serve": {"args": {"ingress_placement": "own"}}}, False),
                              (None, False)):
        cfg = serve_config(rayservice(render(helm, values)))
        (app,) = cfg["applications"]
        assert ClusterArgs(**app["args"]).ingress_in_worker is in_worker
        names = {d["name"] for d in app["deployments"]}
        assert names == ({"StatsBoard"} if in_worker else {"OpenAIIngress", "StatsBoard"}), values


def test_fixed_replicas_without_autoscaling(helm: Any) -> None:
    svc = rayservice(render(helm, {"autoscaling": {"enabled": False}, "replicas": 3}))
    check_kuberay_fields(svc)
    args = app_args(serve_config(svc))
    assert args["worker"]["autoscaling"] is None and args["worker"]["num_replicas"] == 3
    cluster = svc["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in cluster
    worker = cluster["workerGroupSpecs"][0]
    assert (worker["minReplicas"], worker["replicas"], worker["maxReplicas"]) == (3, 3, 3)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"tp_size": 0}, "tp_size must be at least 1"),
        ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "minReplicas <= maxReplicas"),
        ({"autoscaling": {"enabled": False}, "replicas": 0}, "replicas must be at least 1"),
    ({"tp_size": 8, "worker": {"resources": {"limits": {"cpu": "8"}}}}, "a GPU worker pod has 8 CPUs but a replica needs"),
    ({"worker": {"resources": {"limits": {"cpu": "1500m"}}}, "tp_size": 2}, "has 1.5 CPUs"),
    ({"worker": {"groups": [{"name": "h100", "resources": {"requests": {"cpu": "2"}}}]}, "tp_size": 2}, "has 2 CPUs"),
    ({"worker": {"extraCpus": 0.1}}, "must cover the ingress and stats board"),
    ({"model": {"download": {"enabled": True}}}, "needs model.download.uri"),
    ({"batch": {"enabled": True}}, "batch.enabled needs shared.volume"),
    ({"batch": {"enabled": True, "output": "/tmp/out.jsonl"}, "shared": {"volume": {"emptyDir": {}}}},
     "batch.output .* must be under shared.mountPath"),
    ({"rayVersion": "2.50.0"}, "rayAuth.enabled needs Ray 2.52.0 or later"),
    ({"networkPolicy": {"kuberayOperator": {"namespace": ""}}}, "networkPolicy.kuberayOperator.namespace must name"),
    ],
)
def test_bad_values_fail_with_a_message(helm: Any, values: dict[str, Any], message: str) -> None:
    with pytest.raises(Exception, match=message):
        render(helm, values)


# ---- sizing for tp 1 to 8, the 8-GPU values file, weights, accelerator groups, the batch job ----


def _cores(quantity: str | float) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _gib(quantity: str) -> float:
    assert quantity.endswith("Gi"), quantity
    return float(quantity[:-2])


def check_pods_hold_a_replica(svc: dict[str, Any]) -> None:
    """Every GPU worker pod holds one whole replica as Ray would place it: tp_size bundles of
    {CPU: num_cpus, GPU: num_gpus} (STRICT_PACK: one pod), plus the ingress and stats board
    replicas (serve ingressCpus each) that may land there too."""
    cfg = serve_config(svc)
    args = app_args(cfg)
    tp, w = args["tp_size"], args["worker"]
    small = sum(d["ray_actor_options"]["num_cpus"] for d in cfg["applications"][0]["deployments"])
    for group in svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        res = group["template"]["spec"]["containers"][0]["resources"]
        assert res["limits"]["nvidia.com/gpu"] == tp == tp * w["num_gpus"]
        for side in ("requests", "limits"):
            assert _cores(res[side]["cpu"]) >= tp * w["num_cpus"] + small, (group["groupName"], res)
        offload = args.get("cpu_offload", {}).get("per_node_gib", 0)
        assert _gib(res["requests"]["memory"]) >= offload


@pytest.mark.parametrize("tp", range(1, 9))
def test_default_values_size_the_pods_for_every_tp_size(helm: Any, tp: int) -> None:
    svc = rayservice(render(helm, {"tp_size": tp}))
    check_kuberay_fields(svc)
    check_pods_hold_a_replica(svc)
    res = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]
    assert res["requests"] == {"cpu": str(tp + 1), "memory": f"{32 * tp}Gi"}  # values.yaml: 1 CPU, 32Gi a rank


def test_the_8gpu_values_file_installs_tp8(helm: Any) -> None:
    values = _load(CHART / "values-8gpu.yaml")
    assert not helm.lint(str(CHART), values, strict=True)["errors"]
    svc = rayservice(render(helm, values))
    check_kuberay_fields(svc)
    check_pods_hold_a_replica(svc)
    args = app_args(serve_config(svc))
    assert args["tp_size"] == 8 and args["worker"]["num_cpus"] == 2 and args["engine"]["page_size"] == 128
    (group,) = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    pod = group["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"] == {"cpu": "18", "memory": "768Gi", "nvidia.com/gpu": 8}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.count": "8"}
    assert pod["volumes"] == [{"name": "model", "persistentVolumeClaim": {"claimName": "llm-weights", "readOnly": True}},
                              TMP_VOLUME]
    assert pod["containers"][0]["volumeMounts"] == [{"name": "model", "mountPath": "/models", "readOnly": True},
                                                    TMP_MOUNT]


def test_weights_from_a_volume_or_an_object_store(helm: Any) -> None:
    pvc = {"model": {"name": "/models/Qwen2.5-7B-Instruct", "volume": {"hostPath": {"path": "/mnt/models"}}}}
    svc = rayservice(render(helm, pvc))
    cluster = svc["spec"]["rayClusterConfig"]
    worker = cluster["workerGroupSpecs"][0]["template"]["spec"]
    assert worker["volumes"] == [{"name": "model", "hostPath": {"path": "/mnt/models"}}, TMP_VOLUME]
    assert cluster["headGroupSpec"]["template"]["spec"]["volumes"] == [TMP_VOLUME]  # the head loads no model
    assert app_args(serve_config(svc))["model"] == "/models/Qwen2.5-7B-Instruct"

    s3 = {"model": {"name": "/models/Qwen2.5-7B-Instruct", "download": {
        "enabled": True, "uri": "s3://weights/models/Qwen2.5-7B-Instruct", "endpointUrl": "http://minio:9000",
        "secretName": "s3-creds"}}}
    worker = rayservice(render(helm, s3))["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    (init,) = worker["initContainers"]
    assert "s3://weights/models/Qwen2.5-7B-Instruct" in init["args"][0]
    assert "'/models/Qwen2.5-7B-Instruct'" in init["args"][0] or '"/models/Qwen2.5-7B-Instruct"' in init["args"][0]
    assert "--endpoint-url" in init["args"][0] and init["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    assert worker["volumes"] == [{"name": "model", "emptyDir": {"sizeLimit": "200Gi"}}, TMP_VOLUME]
    assert worker["containers"][0]["volumeMounts"] == [{"name": "model", "mountPath": "/models", "readOnly": False},
                                                       TMP_MOUNT]
    assert init["volumeMounts"] == [{"name": "model", "mountPath": "/models"}, TMP_MOUNT]


def test_a_worker_group_per_accelerator_type(helm: Any) -> None:
    groups = [
        {"name": "h100", "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
        {"name": "a100", "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}, "maxReplicas": 2,
         "resources": {"requests": {"cpu": "12", "memory": "200Gi"}, "limits": {"cpu": "12", "memory": "200Gi"}}},
    ]
    svc = rayservice(render(helm, {"tp_size": 4, "worker": {"groups": groups}}))
    check_pods_hold_a_replica(svc)
    h100, a100 = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert (h100["groupName"], h100["minReplicas"], h100["maxReplicas"]) == ("h100", 1, 4)
    assert (a100["groupName"], a100["minReplicas"], a100["maxReplicas"]) == ("a100", 0, 2)
    assert h100["template"]["spec"]["nodeSelector"] == groups[0]["nodeSelector"]
    assert a100["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] == "12"
    assert h100["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] == "5"
    for g in (h100, a100):  # worker.tolerations apply to every group
        assert g["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"


def test_the_batch_job_reads_and_writes_the_shared_volume(helm: Any) -> None:
    shared = {"persistentVolumeClaim": {"claimName": "cbserve-shared"}}
    values = {"tp_size": 2, "model": {"name": "/models/m", "volume": {"persistentVolumeClaim": {"claimName": "w"}}},
              "shared": {"volume": shared},
              "batch": {"enabled": True, "replicas": 3, "output": "/shared/out/run1.jsonl", "args": ["--max-tokens", "64"]}}
    docs = render(helm, values)
    (job,) = docs["batchjob.yaml"]
    check_crd_schema(job)
    spec = job["spec"]
    argv = shlex.split(spec["entrypoint"])
    assert argv[:3] == ["python", "-m", "cbserve.batch"]
    opts = {a: (b if not b.startswith("--") else "") for a, b in zip(argv[3:], [*argv[4:], "--"], strict=True)
            if a.startswith("--")}
    assert "--no-progress" in opts
    assert opts["--input"] == "/shared/prompts.jsonl" and opts["--output"] == "/shared/out/run1.jsonl"
    assert (opts["--tp-size"], opts["--replicas"], opts["--model"], opts["--max-tokens"]) == ("2", "3", "/models/m", "64")
    assert json.loads(opts["--engine"])["page_size"] == 64
    assert spec["shutdownAfterJobFinishes"] is True
    cluster = spec["rayClusterSpec"]
    head = cluster["headGroupSpec"]["template"]["spec"]  # the driver writes the results from here
    assert {"name": "shared", **shared} in head["volumes"]
    assert {"name": "shared", "mountPath": "/shared"} in head["containers"][0]["volumeMounts"]
    (workers,) = cluster["workerGroupSpecs"]
    assert workers["replicas"] == 3 and workers["template"]["spec"]["containers"][0]["resources"]["limits"][
        "nvidia.com/gpu"] == 2
    # The serving cluster mounts it too (for `ray job submit` against it).
    svc = rayservice(docs)
    serving_head = svc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert {"name": "shared", "mountPath": "/shared"} in serving_head["containers"][0]["volumeMounts"]
    assert docs["batchjob.yaml"] and render(helm, None)["batchjob.yaml"] == []


def test_the_node_kv_pool_gets_a_memory_backed_dev_shm(helm: Any) -> None:
    """A container's /dev/shm is 64 MiB: a shared node pool larger than that needs its own."""
    pooled = {"serve": {"args": {"cpu_offload": {"per_node_gib": 8, "node_pool": True}}}}
    svc = rayservice(render(helm, pooled))
    worker = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "9Gi"}} in worker["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in worker["containers"][0]["volumeMounts"]
    assert app_args(serve_config(svc))["cpu_offload"]["node_pool"] is True

    private = {"serve": {"args": {"cpu_offload": {"per_node_gib": 8}}}}
    worker = rayservice(render(helm, private))["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    assert "dshm" not in str(worker)


# ---- security and isolation (issue 26) ----------------------------------------------------------

# The user of rayproject/ray images (and of images built FROM them): `ray`, uid 1000, gid 100.
RAY_UID, RAY_GID = 1000, 100

BATCH_VALUES: dict[str, Any] = {
    "shared": {"volume": {"persistentVolumeClaim": {"claimName": "cbserve-shared"}}},
    "batch": {"enabled": True},
}
DOWNLOAD_VALUES: dict[str, Any] = {
    "model": {"download": {"enabled": True, "uri": "s3://weights/models/m"}},
}


def pod_templates(docs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Every pod template the chart renders, by a name saying where it is."""
    out: dict[str, dict[str, Any]] = {}
    clusters = [("serving", d["spec"]["rayClusterConfig"]) for d in docs["rayservice.yaml"]]
    for job in docs["batchjob.yaml"]:
        clusters.append(("batch", job["spec"]["rayClusterSpec"]))
        out["batch/submitter"] = job["spec"]["submitterPodTemplate"]
    for name, cluster in clusters:
        out[f"{name}/head"] = cluster["headGroupSpec"]["template"]
        for group in cluster["workerGroupSpecs"]:
            out[f"{name}/{group['groupName']}"] = group["template"]
    return out


def check_restricted_pod(where: str, pod: dict[str, Any]) -> None:
    """Kubernetes' "restricted" Pod Security Standard, and a read-only root filesystem with /tmp writable."""
    spec = pod["spec"]
    ctx = spec["securityContext"]
    assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] == RAY_UID and ctx["runAsGroup"] == RAY_GID, where
    assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}, where
    assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), where
    tmp = [v for v in spec["volumes"] if v["name"] == "tmp"]
    assert tmp == [TMP_VOLUME], where
    for c in spec["containers"] + spec.get("initContainers", []):
        check_restricted_container(f"{where}/{c['name']}", c["securityContext"])
        assert TMP_MOUNT in c["volumeMounts"], where


def check_restricted_container(where: str, ctx: dict[str, Any]) -> None:
    assert ctx["allowPrivilegeEscalation"] is False and ctx.get("privileged") is False, where
    assert ctx["capabilities"] == {"drop": ["ALL"]}, where  # nothing added back
    assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] == RAY_UID, where
    assert ctx["readOnlyRootFilesystem"] is True, where
    assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}, where


@pytest.mark.parametrize("values", [None, BIG_VALUES, DOWNLOAD_VALUES, BATCH_VALUES, "values-8gpu.yaml"])
def test_every_pod_and_container_runs_restricted(helm: Any, values: Any) -> None:
    if isinstance(values, str):
        values = _load(CHART / values)
    docs = render(helm, values)
    pods = pod_templates(docs)
    assert {"serving/head", "serving/gpu-workers"} <= pods.keys() or "serving/gpu-8x" in pods
    for where, pod in pods.items():
        check_restricted_pod(where, pod)
    cluster = rayservice(docs)["spec"]["rayClusterConfig"]
    # KubeRay's autoscaler sidecar: its securityContext comes from autoscalerOptions.
    auto = cluster["autoscalerOptions"]
    check_restricted_container("serving/autoscaler", auto["securityContext"])
    assert TMP_MOUNT in auto["volumeMounts"]
    # Only the head of an autoscaled cluster gets Kubernetes API credentials (for that sidecar).
    for where, pod in pods.items():
        assert pod["spec"]["automountServiceAccountToken"] is (where == "serving/head"), where


def test_read_only_root_filesystem_moves_the_home_caches_under_tmp(helm: Any) -> None:
    """What would be written under $HOME (read-only now) goes to the /tmp emptyDir; `env` still wins."""
    caches = {"TRITON_CACHE_DIR", "TORCH_EXTENSIONS_DIR", "CBSERVE_CACHE_DIR", "CUDA_CACHE_PATH", "HF_HOME"}
    baked = "/home/ray/.cache/huggingface"  # weights in the image's cache: `env` points there
    mine = {"env": [{"name": "HF_HOME", "value": baked}, {"name": "HF_HUB_OFFLINE", "value": "1"}]}
    for values, expected in ((None, {}), (mine, {"HF_HOME": baked})):
        for where, pod in pod_templates(render(helm, values)).items():
            if where.endswith("submitter"):
                continue
            env = pod["spec"]["containers"][0]["env"]
            names = [e["name"] for e in env]
            assert len(names) == len(set(names)), names  # no name twice
            values_of = {e["name"]: e.get("value") for e in env}
            for name in caches:
                assert values_of[name] == expected.get(name, values_of[name]), (where, name)
                if name not in expected:
                    assert values_of[name].startswith("/tmp/"), (where, name)
    writable = {"containerSecurityContext": {"readOnlyRootFilesystem": False}}
    for pod in pod_templates(render(helm, writable)).values():
        env = pod["spec"]["containers"][0].get("env", [])
        assert not caches & {e["name"] for e in env}


def test_the_batch_submitter_pod_is_ours(helm: Any) -> None:
    """KubeRay's `ray job submit` pod: our labels (the NetworkPolicy admits it by them), our image,
    no Kubernetes credentials, no command (KubeRay writes it)."""
    (job,) = render(helm, BATCH_VALUES)["batchjob.yaml"]
    check_crd_schema(job)
    pod = job["spec"]["submitterPodTemplate"]
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "batch-submitter"
    assert pod["metadata"]["labels"]["app.kubernetes.io/instance"] == "llm"
    assert pod["spec"]["restartPolicy"] == "Never"
    (container,) = pod["spec"]["containers"]
    assert container["image"] == "cbserve:0.1.0" and "command" not in container and "args" not in container


# A NetworkPolicy peer: (namespace, its labels, pod labels); None for a client outside the cluster.
Peer = tuple[str, dict[str, str], dict[str, str]] | None
NAMESPACE_LABELS = {ns: {"kubernetes.io/metadata.name": ns} for ns in ("serving", "kuberay-system", "elsewhere")}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # what the chart writes
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_matches(peer: dict[str, Any], source: Peer) -> bool:
    if "ipBlock" in peer:
        return source is None
    if source is None:
        return False
    ns, ns_labels, labels = source
    if "namespaceSelector" in peer:
        in_ns = _selects(peer["namespaceSelector"], ns_labels)
    else:
        in_ns = ns == "serving"  # a bare podSelector means the policy's own namespace
    return in_ns and _selects(peer.get("podSelector", {}), labels)


def admitted(policies: list[dict[str, Any]], target: dict[str, str], port: int, source: Peer) -> bool:
    """Whether Kubernetes' NetworkPolicy semantics let `source` reach a pod labelled `target` on `port`."""
    selecting = [p for p in policies if _selects(p["spec"]["podSelector"], target)
                 and "Ingress" in p["spec"]["policyTypes"]]
    if not selecting:
        return True  # a pod no policy selects is open
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(p["port"] == port and p.get("protocol", "TCP") == "TCP" for p in ports):
                continue
            peers = rule.get("from")
            if not peers or any(_peer_matches(peer, source) for peer in peers):
                return True
    return False


def check_network_policy_schema(policy: dict[str, Any]) -> None:
    """Its ingress rules against Kubernetes' NetworkPolicyIngressRule schema (which KubeRay's CRD
    embeds for its own network policies), its pod selector against LabelSelector's."""
    import jsonschema

    assert policy["apiVersion"] == "networking.k8s.io/v1" and policy["kind"] == "NetworkPolicy"
    assert DNS_1123.match(policy["metadata"]["name"]), policy["metadata"]["name"]
    cluster = crd_schemas()["RayService"]["properties"]["spec"]["properties"]["rayClusterConfig"]["properties"]
    rule = cluster["networkPolicy"]["properties"]["head"]["properties"]["ingressRules"]["items"]
    selector = rule["properties"]["from"]["items"]["properties"]["podSelector"]
    spec = policy["spec"]
    assert set(spec) <= {"podSelector", "policyTypes", "ingress"}, spec
    for doc, schema in [(spec["podSelector"], selector), *((r, rule) for r in spec.get("ingress", []))]:
        jsonschema.Draft7Validator(schema).validate(doc)
        assert not unknown_fields(doc, schema), unknown_fields(doc, schema)


def _ray_pods(docs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, str]]:
    """Each pod's labels as KubeRay creates it (it adds ray.io/node-type)."""
    out = {}
    for where, pod in pod_templates(docs).items():
        kind = "head" if where.endswith("/head") else "worker"
        extra = {} if where.endswith("submitter") else {"ray.io/node-type": kind}
        out[where] = pod["metadata"]["labels"] | extra
    return out


# Ray's ports: dashboard and job submission, GCS, Ray client, metrics, dashboard agent, a worker's.
RAY_PORTS = (8265, 6379, 10001, 8080, 52365, 10002)


def test_network_policy_admits_only_the_serve_ports_from_outside(helm: Any) -> None:
    docs = render(helm, BATCH_VALUES)
    policies = docs["networkpolicy.yaml"]
    assert len(policies) == 5  # per cluster: its pods, its head's dashboard; the submitter
    for policy in policies:
        check_network_policy_schema(policy)
    pods = _ray_pods(docs)
    operator = ("kuberay-system", NAMESPACE_LABELS["kuberay-system"], {"app.kubernetes.io/name": "kuberay-operator"})
    strangers: list[Peer] = [
        None,  # a client outside the cluster
        ("serving", NAMESPACE_LABELS["serving"], {"app": "other"}),  # any pod of the release's namespace
        ("serving", NAMESPACE_LABELS["serving"], {"app.kubernetes.io/name": "cbserve",
                                                  "app.kubernetes.io/instance": "llm"}),  # half our labels
        ("elsewhere", NAMESPACE_LABELS["elsewhere"], operator[2]),  # the operator's labels, another namespace
    ]
    for where, target in pods.items():
        serving = where.startswith("serving/")
        for source in strangers:
            assert admitted(policies, target, 8000, source) is serving, (where, source)
            assert admitted(policies, target, 9000, source) is serving, (where, source)
            for port in RAY_PORTS:
                assert not admitted(policies, target, port, source), (where, port, source)
        # The KubeRay operator: each cluster's dashboard (Serve config, job status), nothing else.
        for port in RAY_PORTS:
            assert admitted(policies, target, port, operator) is (port == 8265 and where.endswith("/head")), (
                where, port)

    def pod(where: str) -> Peer:
        return ("serving", NAMESPACE_LABELS["serving"], pods[where])

    # Ray pods of one cluster reach each other on every port; the two clusters are apart.
    for a in ("serving/head", "serving/gpu-workers"):
        for b in ("serving/head", "serving/gpu-workers"):
            assert all(admitted(policies, pods[b], port, pod(a)) for port in RAY_PORTS)
            assert not any(admitted(policies, pods[b], port, pod(a.replace("serving", "batch")))
                           for port in RAY_PORTS)
    assert all(admitted(policies, pods["batch/head"], port, pod("batch/gpu-workers")) for port in RAY_PORTS)
    # The job's submitter: its own cluster's dashboard only.
    submitter = pod("batch/submitter")
    assert admitted(policies, pods["batch/head"], 8265, submitter)
    assert not admitted(policies, pods["serving/head"], 8265, submitter)
    assert not any(admitted(policies, pods["batch/head"], port, submitter) for port in RAY_PORTS[1:])
    assert not admitted(policies, pods["batch/gpu-workers"], 8265, submitter)


def test_network_policy_knobs(helm: Any) -> None:
    ingress_nginx = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}
    prometheus = {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
                  "ports": [{"port": 8080, "protocol": "TCP"}]}
    values = {"networkPolicy": {"kuberayOperator": {"namespace": "ray-ops"}, "serveFrom": [ingress_nginx],
                                "extraIngress": [prometheus]}, "head": {"rayStartParams": {"dashboard-port": 8266}}}
    docs = render(helm, values)
    policies, pods = docs["networkpolicy.yaml"], _ray_pods(docs)
    for policy in policies:
        check_network_policy_schema(policy)
    nginx = ("ingress-nginx", {"kubernetes.io/metadata.name": "ingress-nginx"}, {})
    monitoring = ("monitoring", {"kubernetes.io/metadata.name": "monitoring"}, {})
    operator = ("ray-ops", {"kubernetes.io/metadata.name": "ray-ops"}, {"app.kubernetes.io/name": "kuberay-operator"})
    for target in (pods["serving/head"], pods["serving/gpu-workers"]):
        assert admitted(policies, target, 8000, nginx) and not admitted(policies, target, 8000, None)
        assert admitted(policies, target, 8080, monitoring) and not admitted(policies, target, 8265, monitoring)
    assert admitted(policies, pods["serving/head"], 8266, operator)
    moved = ("kuberay-system", NAMESPACE_LABELS["kuberay-system"], operator[2])  # the default namespace: not now
    assert not admitted(policies, pods["serving/head"], 8266, moved)
    assert not admitted(policies, pods["serving/head"], 8265, operator)
    assert render(helm, {"networkPolicy": {"enabled": False}})["networkpolicy.yaml"] == []


@pytest.mark.parametrize("values", [None, BATCH_VALUES, {**BIG_VALUES, **BATCH_VALUES}])
def test_ray_control_ports_stay_inside_the_cluster(helm: Any, values: Any) -> None:
    """No Service beyond the cluster (ClusterIP everywhere, no Ingress), and Ray's token
    authentication on the dashboard, job submission and GCS of every Ray cluster."""
    docs = render(helm, values)
    clusters = [d["spec"]["rayClusterConfig"] for d in docs["rayservice.yaml"]]
    clusters += [d["spec"]["rayClusterSpec"] for d in docs["batchjob.yaml"]]
    assert len(clusters) == (2 if values else 1)
    for cluster in clusters:
        assert cluster["authOptions"] == {"mode": "token"}
        head = cluster["headGroupSpec"]
        assert head["serviceType"] == "ClusterIP" and not head.get("enableIngress")
    for doc in (d for docs_ in docs.values() for d in docs_):
        assert doc["kind"] not in {"Ingress", "Route", "Gateway", "HTTPRoute"}, doc["kind"]
        if doc["kind"] == "Service":
            assert doc["spec"]["type"] == "ClusterIP", doc["metadata"]["name"]
    assert "authOptions" not in rayservice(render(helm, {"rayAuth": {"enabled": False}}))["spec"]["rayClusterConfig"]


def test_service_monitor_sends_the_api_key_when_metrics_need_it(helm: Any) -> None:
    def scrape(values: dict[str, Any]) -> tuple[bool, dict[str, Any] | None]:
        docs = render(helm, values)
        args = app_args(serve_config(rayservice(docs)))
        _, monitor = docs["servicemonitor.yaml"]
        (endpoint,) = monitor["spec"]["endpoints"]
        return args.get("metrics_require_api_key", False), endpoint.get("authorization")

    # With a key, /metrics asks for it (apiKey.protectMetrics) and Prometheus sends it from the Secret.
    key = {"type": "Bearer", "credentials": {"name": "cbserve-api-key", "key": "key"}}
    assert scrape(BIG_VALUES) == (True, key)
    assert scrape({**BIG_VALUES, "apiKey": {**BIG_VALUES["apiKey"], "protectMetrics": False}}) == (False, None)
    opened = {**BIG_VALUES, "apiKey": {**BIG_VALUES["apiKey"], "protectMetrics": False},
              "serve": {"args": {"metrics_require_api_key": True}}}
    assert scrape(opened) == (True, key)  # asked for through serve.args: still sent
    assert scrape({"serviceMonitor": {"enabled": True}}) == (False, None)  # no key: nothing to send

    # The metrics Service picks the serving cluster's head, not the batch job's.
    docs = render(helm, {**BATCH_VALUES, "serviceMonitor": {"enabled": True}})
    service = docs["servicemonitor.yaml"][0]
    pods = _ray_pods(docs)
    assert service["spec"]["selector"].items() <= pods["serving/head"].items()
    assert not service["spec"]["selector"].items() <= pods["batch/head"].items()


def test_serve_grpc_messages_are_capped_at_the_body_limit(helm: Any) -> None:
    """Serve's gRPC proxies run on every Ray pod and read the cap from their environment: the
    app's `limits.max_body_bytes` (as `make serve` sets it), not Serve's own 2 GiB."""
    def caps(values: dict[str, Any] | None) -> set[str | None]:
        docs = render(helm, values)
        out = set()
        for where, pod in pod_templates(docs).items():
            if where.endswith("submitter"):
                continue
            for container in pod["spec"]["containers"]:
                if container["name"].startswith("ray-"):
                    env = {e["name"]: e.get("value") for e in container.get("env", [])}
                    out.add(env.get("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"))
        return out

    file_cap = app_args(yaml.safe_load(RAY_CONFIG.read_text()))["limits"]["max_body_bytes"]
    assert caps(None) == {str(file_cap)}
    assert caps({"serve": {"args": {"limits": {"max_body_bytes": 4096}}}}) == {"4096"}


def _value_keys(text: str) -> list[tuple[str, bool]]:
    """(dotted key, has a comment of its own) for every mapping key of values.yaml, list items aside."""
    out: list[tuple[str, bool]] = []
    stack: list[tuple[int, str]] = []
    lines = text.splitlines()
    list_indent: int | None = None
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        if list_indent is not None and indent > list_indent:
            continue  # inside a list's items: values, not knobs
        list_indent = None
        if stripped.startswith("- "):
            list_indent = indent - 1
            continue
        match = re.match(r"([A-Za-z_][\w./-]*):(\s|$)", stripped)
        assert match, line
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, match.group(1)))
        above = lines[i - 1] if i else ""
        commented = "#" in line or (above.strip().startswith("#") and above.index("#") == indent)
        out.append((".".join(k for _, k in stack), commented))
        if stripped.endswith(":") and i + 1 < len(lines) and lines[i + 1].lstrip().startswith("- "):
            list_indent = indent
    return out


def test_every_value_is_commented() -> None:
    """Each knob of values.yaml has a comment: on its line, right above it, or on a key it is under."""
    keys = _value_keys((CHART / "values.yaml").read_text())
    assert len(keys) > 80
    commented = {k for k, c in keys if c}
    names = {k for k, _ in keys}
    leaves = [k for k in names if not any(other.startswith(k + ".") for other in names)]
    bare = sorted(k for k in leaves if not any(k == c or k.startswith(c + ".") for c in commented))
    assert not bare, bare


def test_security_defaults(helm: Any) -> None:
    """The secure settings are the defaults: values.yaml as it ships."""
    values = _load(CHART / "values.yaml")
    assert values["networkPolicy"]["enabled"] is True and values["rayAuth"]["enabled"] is True
    assert values["apiKey"]["protectMetrics"] is True and values["networkPolicy"]["serveFrom"] == []
    assert values["containerSecurityContext"]["readOnlyRootFilesystem"] is True
    assert values["podSecurityContext"]["runAsUser"] == RAY_UID


# Run in a mount namespace whose root is read-only, with fresh tmpfs at the chart's writable mounts:
# a Ray head with the dashboard and token authentication (what KubeRay's authOptions sets), Serve,
# the cbserve app on the tiny model, one completion; prints what it saw as one JSON line.
_POD_FILESYSTEM_RUN = """
import json, os, sys, urllib.error, urllib.request
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from tests.support.cluster import build_tiny_model, free_port

def writable(folder):
    try:
        Path(folder, ".probe").write_text("")
        return True
    except OSError:
        return False

def status(url, headers):
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60).status
    except urllib.error.HTTPError as exc:
        return exc.code

seen = {"root": writable("/"), "home": writable(os.path.expanduser("~")), "tmp": writable("/tmp")}
model = build_tiny_model(Path("/tmp/model"))
import ray
from ray import serve
from cbserve.cluster.app import build_app
dashboard, http = free_port(), free_port()
ray.init(address="local", num_cpus=2, include_dashboard=True, dashboard_host="127.0.0.1",
         dashboard_port=dashboard, log_to_driver=False)
try:
    seen["session"] = ray._private.worker._global_node.get_session_dir_path()
    serve.start(http_options={"host": "127.0.0.1", "port": http})
    args = {"model": str(model), "served_model_name": "tiny", "generation": {"max_tokens": 4},
            "engine": {"page_size": 8, "num_blocks": 64, "max_batch_tokens": 128}, "worker": {"num_cpus": 1.0}}
    serve.run(build_app(args), name="cbserve", route_prefix="/")
    body = json.dumps({"model": "tiny", "prompt": "hello world", "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{http}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    seen["completion_tokens"] = json.load(urllib.request.urlopen(request, timeout=300))["usage"]["completion_tokens"]
    jobs = f"http://127.0.0.1:{dashboard}/api/jobs/"
    seen["jobs_without_token"] = status(jobs, {})
    seen["jobs_with_token"] = status(jobs, {"Authorization": "Bearer " + os.environ["RAY_AUTH_TOKEN"]})
    from cbserve.kernels import cpu_kernels
    seen["cpu_kernels"] = cpu_kernels.unavailable_reason() or "built"  # by the replica, under TORCH_EXTENSIONS_DIR
    serve.shutdown()
finally:
    ray.shutdown()
print("SEEN " + json.dumps(seen))
"""


def _mount_point(path: Path) -> Path:
    path = path.resolve()
    while not os.path.ismount(path):
        path = path.parent
    return path


@pytest.mark.ray
@pytest.mark.slow
def test_ray_serves_on_the_pods_read_only_root_filesystem(helm: Any) -> None:
    """Ray, Serve and cbserve run as the chart's pods have them: the root filesystem read-only
    ($HOME included, empty as an image's), only the chart's emptyDir mounts (and KubeRay's
    /dev/shm) writable, the chart's environment (caches under /tmp), Ray token authentication on.
    The Serve port answers without Ray's token; the dashboard's job API only with it; the C++ CPU
    kernels build as they do outside."""
    import tempfile

    from cbserve.kernels import cpu_kernels

    if subprocess.run(["unshare", "-r", "-m", "true"], check=False, capture_output=True).returncode:
        pytest.skip("needs unprivileged user and mount namespaces (unshare -r -m)")
    spec = rayservice(render(helm, None))["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    emptydirs = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
    writable = [m["mountPath"] for m in container["volumeMounts"] if m["name"] in emptydirs]
    assert writable == ["/tmp"]
    covered = [p for p in (REPO, Path(sys.prefix)) if any(Path(p).resolve().is_relative_to(w) for w in writable)]
    if covered:
        pytest.skip(f"{covered[0]} lies under the pod's writable mounts ({', '.join(writable)}), which the test "
                    "replaces by an empty tmpfs: run it from a checkout elsewhere")
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    # An empty $HOME off /tmp (which the namespace covers), read-only there like the image's.
    home = tempfile.mkdtemp(prefix="cbserve-home-", dir="/var/tmp" if os.path.isdir("/var/tmp") else REPO.parent)
    env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "t0ken" * 8, "PYTHONPATH": str(REPO), "HOME": home}
    # Read-only: the root and whatever other mounts hold $HOME, the repository and Python.
    read_only = sorted({_mount_point(Path(p)) for p in ("/", home, REPO, sys.prefix)})
    steps = [f"mount -o remount,bind,ro {shlex.quote(str(p))}" for p in read_only]
    steps += [f"mount -t tmpfs -o size=4g tmpfs {shlex.quote(p)}" for p in writable]
    steps.append(shlex.join([sys.executable, "-c", _POD_FILESYSTEM_RUN, str(REPO)]))
    out = subprocess.run(["unshare", "-r", "-m", "sh", "-c", " && ".join(steps)], check=False,
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=800)
    os.rmdir(home)
    lines = [line for line in out.stdout.splitlines() if line.startswith("SEEN ")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    seen = json.loads(lines[-1][5:])
    assert (seen["root"], seen["home"], seen["tmp"]) == (False, False, True)
    assert seen["session"].startswith("/tmp/ray/")
    assert seen["completion_tokens"] == 4
    assert (seen["jobs_without_token"], seen["jobs_with_token"]) == (401, 200)
    assert seen["cpu_kernels"] == (cpu_kernels.unavailable_reason() or "built")
