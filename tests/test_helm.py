"""The Helm chart `helm/cbserve` (a KubeRay RayService).

Always: the chart's plain YAML files parse, its copy of the Serve config equals `ray_config.yaml`,
and `values.yaml` has the documented keys.

With Helm (its Go SDK, from the `helm-python-sdk` package: `pip install helm-python-sdk==0.2.2`):
`helm lint`, and every template rendered for the default values and for other value sets
(`tp_size` 1 to 8, `values-8gpu.yaml`, autoscaling, the API key, the ServiceMonitor, a weights
volume or download, worker groups per accelerator type, the batch job on a shared volume),
checked as YAML, the RayService and RayJob against KubeRay's CRD schema (ray.io/v1, kept in
`tests/data/kuberay_v1_schemas.json.gz`: no unknown field, which Kubernetes would silently drop),
pod resources against what a replica asks Ray for, and `serveConfigV2` against Ray's own
`ServeDeploySchema`.
"""

from __future__ import annotations

import copy
import functools
import gzip
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
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

    After changing ray_config.yaml: cp ray_config.yaml helm/cbserve/files/serve_config.yaml
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
