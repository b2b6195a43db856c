"""The Kubernetes manifests (deploy/): each overlay renders, every object is valid against the
Kubernetes OpenAPI schemas, and the properties deploy/README.md promises hold.

Rendering uses `kubectl kustomize` (required: CI runs where kubectl is installed); validation uses
the schemas that the kubernetes-validate package bundles, offline, in strict mode (an unknown
field, such as a misspelt probe, is an error).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import kubernetes_validate  # the dev extra; bundles the schemas, needs no network
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
# The newest Kubernetes release whose schemas kubernetes-validate bundles (1.37.0 in its 1.37.0).
KUBERNETES_VERSION = kubernetes_validate.utils.latest_version()
ROLES = ("orchestrator", "draft", "target")
GRPC_PORTS = {"orchestrator": 50051, "draft": 50052, "target": 50053}
METRICS_PORT = 9400
HEALTH_PORT = 8081  # `serve --health-port`: grpc.health.v1 only, plaintext, what the kubelet probes
SERVER_DRAIN_S = 5  # ServerConfig.grace_s: how long in-flight RPCs get after SIGTERM
# gpu+tls, gpu+tp: the gpu overlay with components/tls, components/tensor-parallel (built in a temp dir)
OVERLAYS = ("dev", "gpu", "gpu+tls", "gpu+tp")


# ----------------------------------------------------------------------------- rendering
def _kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail("kubectl not found: these tests render deploy/ with `kubectl kustomize` "
                    "(kubectl 1.27 or newer, which bundles kustomize v5); install it and run again")
    return path


def _render(directory: Path) -> list[dict]:
    done = subprocess.run([_kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        pytest.fail(f"kubectl kustomize {directory} failed:\n{done.stderr}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    out = {"dev": _render(DEPLOY / "overlays" / "dev"), "gpu": _render(DEPLOY / "overlays" / "gpu")}
    for name, component in (("gpu+tls", "tls"), ("gpu+tp", "tensor-parallel")):
        with tempfile.TemporaryDirectory(prefix="specdec-deploy-") as tmp:
            # kustomize takes only relative paths to other kustomizations.
            rel = os.path.relpath(DEPLOY, tmp)
            (Path(tmp) / "kustomization.yaml").write_text(
                "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
                f"resources:\n  - {rel}/overlays/gpu\ncomponents:\n  - {rel}/components/{component}\n")
            out[name] = _render(Path(tmp))
    return out


def _objects(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _role(docs: list[dict], role: str) -> dict:
    return _objects(docs, "Deployment")[f"specdec-{role}"]


def _container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _pod_specs(docs: list[dict]):
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield d["metadata"]["name"], d["spec"]["template"]["spec"]


def _flags(container: dict) -> dict[str, str]:
    """--flag=value arguments as a dict (the manifests write every flag in that form)."""
    return dict(a[2:].split("=", 1) for a in container.get("args", []) if a.startswith("--") and "=" in a)


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels is used in deploy/: {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


# ----------------------------------------------------------------------------- schemas
def test_schemas_are_of_a_current_release() -> None:
    assert tuple(int(x) for x in KUBERNETES_VERSION.split(".")[:2]) >= (1, 37), (
        f"kubernetes-validate bundles schemas up to {KUBERNETES_VERSION} only: pip install -U kubernetes-validate")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid(rendered, overlay: str) -> None:
    errors = []
    for doc in rendered[overlay]:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {exc}")
        except kubernetes_validate.SchemaNotFoundError:
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: not a core kind (no schema); keep CRDs in deploy/optional/")
    assert not errors, "\n\n".join(errors)


def test_validation_catches_a_misspelt_field(rendered) -> None:
    """The check above would pass vacuously if strict mode ignored unknown fields."""
    deployment = _role(rendered["dev"], "target")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    container = _container(broken)
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


# ----------------------------------------------------------------------------- roles
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_roles_have_native_grpc_probes_on_their_health_port(rendered, overlay: str) -> None:
    """TLS or not, the kubelet's own gRPC probe (plaintext) checks the plaintext health port, at
    the same rates: no exec probes, no probe script."""
    for role in ROLES:
        container = _container(_role(rendered[overlay], role))
        port = GRPC_PORTS[role]
        assert {"name": "grpc", "containerPort": port} in container["ports"]
        assert {"name": "health", "containerPort": HEALTH_PORT} in container["ports"]
        flags = _flags(container)
        assert flags["port"] == str(port) and flags["host"] == "0.0.0.0"
        assert flags["health-port"] == str(HEALTH_PORT)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            spec = container[probe]
            assert spec["grpc"] == {"port": HEALTH_PORT}, f"{role} {probe}"
            assert "exec" not in spec and "httpGet" not in spec and "tcpSocket" not in spec, f"{role} {probe}"
        assert container["readinessProbe"]["periodSeconds"] == 5, role
        assert container["livenessProbe"]["periodSeconds"] == 10, role
        startup = container["startupProbe"]
        window = startup["periodSeconds"] * startup["failureThreshold"]
        assert window >= {"orchestrator": 60, "draft": 300, "target": 600}[role], f"{role}: startup window {window}s"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_roles_drain_before_they_are_killed(rendered, overlay: str) -> None:
    for role in ROLES:
        deployment = _role(rendered[overlay], role)
        pre_stop = _container(deployment)["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pre_stop > 0
        assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= pre_stop + SERVER_DRAIN_S + 5


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_role_has_a_disruption_budget(rendered, overlay: str) -> None:
    budgets = _objects(rendered[overlay], "PodDisruptionBudget")
    for role in ROLES:
        labels = _role(rendered[overlay], role)["spec"]["template"]["metadata"]["labels"]
        assert labels == {"app.kubernetes.io/name": "specdec", "app.kubernetes.io/component": role}
        assert _selects(budgets[f"specdec-{role}"]["spec"]["selector"], labels)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_headless_for_pools_and_the_orchestrator_reaches_them(rendered, overlay: str) -> None:
    services = _objects(rendered[overlay], "Service")
    for role in ("draft", "target"):
        assert services[f"specdec-{role}"]["spec"]["clusterIP"] == "None"
    api = services["specdec-orchestrator"]["spec"]
    assert "clusterIP" not in api and [p["port"] for p in api["ports"]] == [GRPC_PORTS["orchestrator"]]
    assert services["specdec-orchestrator-pods"]["spec"]["clusterIP"] == "None"  # each pod scraped by name
    flags = _flags(_container(_role(rendered[overlay], "orchestrator")))
    assert flags["drafter-address"] == f"specdec-draft:{GRPC_PORTS['draft']}"
    assert flags["verifier-address"] == f"specdec-target:{GRPC_PORTS['target']}"
    for role in ROLES:
        pod_labels = _role(rendered[overlay], role)["spec"]["template"]["metadata"]["labels"]
        assert services[f"specdec-{role}"]["spec"]["selector"] == pod_labels


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_health_port_is_on_no_service(rendered, overlay: str) -> None:
    for name, service in _objects(rendered[overlay], "Service").items():
        for port in service["spec"]["ports"]:
            assert port["port"] != HEALTH_PORT and port.get("targetPort") not in (HEALTH_PORT, "health"), f"{name}: {port}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_models_are_mounted_read_only_and_secrets_come_from_files(rendered, overlay: str) -> None:
    for role in ROLES:
        deployment = _role(rendered[overlay], role)
        container = _container(deployment)
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert mounts["/models"]["readOnly"] is True
        assert mounts["/etc/specdec/secrets"]["readOnly"] is True
        flags = _flags(container)
        assert flags["target"] == "/models/target"  # the orchestrator: its tokenizer
        assert flags["service-token-file"] == "/etc/specdec/secrets/service-token"
        if role == "draft":
            assert flags["draft"] == "/models/draft"
        if role == "orchestrator":
            assert flags["api-keys-file"] == "/etc/specdec/secrets/api-keys"
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        source = "hostPath" if overlay == "dev" else "persistentVolumeClaim"
        assert set(volumes["models"]) == {"name", source}
        if overlay.endswith("+tls"):
            assert flags["tls-cert"] == "/etc/specdec/tls/tls.crt" and flags["tls-key"] == "/etc/specdec/tls/tls.key"
            assert flags["tls-ca"] == "/etc/specdec/tls/ca.crt"
            assert volumes["tls"]["secret"]["secretName"] == "specdec-tls"
            assert set(volumes) == {"models", "secrets", "tmp", "tls"}  # no probe script any more
        else:
            assert not {"tls-cert", "tls-key", "tls-ca"} & set(flags) and "tls" not in volumes


def _unparsed(docs: list[dict], names: set[str]) -> list[str]:
    """The Deployments among ``names`` whose args, $(VAR)s expanded as the kubelet does, `specdec`'s
    own parser rejects (a misspelt or renamed flag would otherwise show only as a crash-looping pod)."""
    from specdec.cli import build_parser

    config = _objects(docs, "ConfigMap")["specdec-config"]["data"]
    env = {**config, "CPU_LIMIT": "2", "POD_NAMESPACE": "specdec"}
    failed = []
    for name in sorted(names):
        args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in _container(_objects(docs, "Deployment")[name])["args"]]
        try:
            build_parser().parse_args(args)
        except SystemExit:
            failed.append(f"{name}: specdec {' '.join(args)}")
    return failed


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_roles_flags_parse_with_the_cli(rendered, overlay: str) -> None:
    failed = _unparsed(rendered[overlay], {f"specdec-{r}" for r in ROLES})
    assert not failed, "rejected by specdec's parser (its message is in the captured stderr):\n" + "\n".join(failed)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_autoscalers_flags_parse_with_the_cli(rendered, overlay: str) -> None:
    failed = _unparsed(rendered[overlay], {"specdec-autoscaler"})
    assert not failed, "rejected by specdec's parser (its message is in the captured stderr):\n" + "\n".join(failed)


# ----------------------------------------------------------------------------- overlays
def test_dev_is_one_cpu_replica_per_role_with_redis_inside(rendered) -> None:
    docs = rendered["dev"]
    deployments = _objects(docs, "Deployment")
    assert set(deployments) == {*(f"specdec-{r}" for r in ROLES), "specdec-autoscaler", "specdec-redis"}
    for deployment in deployments.values():
        assert deployment["spec"].get("replicas", 1) == 1
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            assert "nvidia.com/gpu" not in str(container["resources"])
    assert "specdec-redis" in _objects(docs, "Service")
    redis_args = _container(deployments["specdec-redis"])["args"]
    assert redis_args == ["--save", "", "--appendonly", "no"]  # nothing kept on disk
    assert not _objects(docs, "PersistentVolumeClaim")
    assert "PLACEHOLDER" in _objects(docs, "Secret")["specdec-secrets"]["stringData"]["api-keys"]


def test_gpu_target_gets_a_gpu_and_draft_its_own_pool(rendered) -> None:
    docs = rendered["gpu"]
    target = _container(_role(docs, "target"))["resources"]
    assert target["limits"]["nvidia.com/gpu"] == 1
    assert target["requests"].get("nvidia.com/gpu", 1) == 1  # an extended resource's request equals its limit
    draft = _role(docs, "draft")["spec"]["template"]["spec"]
    assert draft["nodeSelector"]
    tolerated = {t["key"] for t in draft["tolerations"]}
    assert set(draft["nodeSelector"]) <= tolerated, "the draft pool's nodes are tainted with the key they are selected by"
    for role in ("orchestrator", "draft"):
        assert "nvidia.com/gpu" not in str(_container(_role(docs, role))["resources"])
    assert int(_flags(_container(_role(docs, "target")))["max-kv-tokens"]) > 0  # admission's cap, within the page pool


# The gpu overlay's device flags: the target's model on its GPU in bfloat16 with its KV pages sized by
# memory fraction; the drafters on CPU cores. Written out here, so that a dropped flag fails.
GPU_TARGET_FLAGS = {"device": "cuda", "dtype": "bfloat16"}
GPU_DRAFT_FLAGS = {"draft-device": "cpu"}


@pytest.mark.parametrize("overlay", ("gpu", "gpu+tls", "gpu+tp"))
def test_gpu_runs_the_target_on_cuda_in_bfloat16_and_the_drafters_on_cpu(rendered, overlay: str) -> None:
    docs = rendered[overlay]
    target = _flags(_container(_role(docs, "target")))
    assert {k: target.get(k) for k in GPU_TARGET_FLAGS} == GPU_TARGET_FLAGS
    assert 0.5 <= float(target["kv-memory-fraction"]) < 1  # of the GPU's memory after the weights
    draft = _flags(_container(_role(docs, "draft")))
    assert {k: draft.get(k) for k in GPU_DRAFT_FLAGS} == GPU_DRAFT_FLAGS
    assert "device" not in draft  # --device is the target's; the draft pool has no GPU (draft-pool.yaml)


def test_the_gpu_flags_are_the_clis():
    """The device flags the gpu overlay passes are specdec's own, and mean what the overlay wants:
    `serve target` parses them into a CUDA target in bfloat16 with a KV memory fraction, `serve draft`
    into a CPU drafter (test_the_roles_flags_parse_with_the_cli checks every rendered flag parses)."""
    from specdec.cli import build_parser

    common = ["--target=/models/target", "--draft=/models/draft"]
    target = build_parser().parse_args(["serve", "target", *common, "--device=cuda", "--dtype=bfloat16", "--kv-memory-fraction=0.85"])
    assert (target.device, target.dtype, target.kv_memory_fraction) == ("cuda", "bfloat16", 0.85)
    draft = build_parser().parse_args(["serve", "draft", *common, "--draft-device=cpu"])
    assert draft.draft_device == "cpu"


def _args_flag(container: dict, name: str) -> str:
    """The value of --name=... as specdec reads it: the last one given."""
    return [a.split("=", 1)[1] for a in container["args"] if a.startswith(f"--{name}=")][-1]


def test_gpu_tp_is_one_pod_of_n_gpus_per_verifier(rendered) -> None:
    """components/tensor-parallel: each target pod is one tensor-parallel group; --tensor-parallel N,
    N GPUs asked for (request = limit), N ranks' threads within its CPU limit, a /dev/shm in memory
    for the ranks; one container (the ranks are its processes); everything else is the gpu overlay's."""
    gpu, tp = rendered["gpu"], rendered["gpu+tp"]
    deployment = _role(tp, "target")
    container = _container(deployment)  # (one container: it raises on more)
    n = int(_args_flag(container, "tensor-parallel"))
    assert n >= 2
    resources = container["resources"]
    assert int(resources["limits"]["nvidia.com/gpu"]) == int(resources["requests"]["nvidia.com/gpu"]) == n
    assert int(_args_flag(container, "threads")) * n <= int(resources["limits"]["cpu"])
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    # the group's flags on top of the gpu overlay's: the same command otherwise
    base = _container(_role(gpu, "target"))["args"]
    assert container["args"][:len(base)] == base
    assert {a.split("=", 1)[0] for a in container["args"][len(base):]} == {"--tensor-parallel", "--threads"}
    for role in ("orchestrator", "draft"):
        assert _role(tp, role) == _role(gpu, role)
    assert {(d["kind"], d["metadata"]["name"]) for d in tp} == {(d["kind"], d["metadata"]["name"]) for d in gpu}


def test_the_autoscaler_counts_a_tensor_parallel_group_as_one_verifier(rendered) -> None:
    """It scales the target Deployment's replicas and scrapes its pods through the headless Service,
    one metrics address per pod: with components/tensor-parallel a pod is one group of N ranks (rank
    0 serves the pod's only metrics port; the other ranks are processes in the same container, with no
    port of their own), so a replica, and a scraped pod, is one verifier of N GPUs. (A real two-rank
    verifier's /metrics as the autoscaler reads it: tests/test_tensor_parallel_serving.py.)"""
    from specdec.autoscale.flags import Deployments

    docs = rendered["gpu+tp"]
    autoscaler = _container(_objects(docs, "Deployment")["specdec-autoscaler"])
    flags = _flags(autoscaler)
    assert flags.get("target-deployment", Deployments.target) == "specdec-target"
    target = _role(docs, "target")
    assert [p["name"] for p in _container(target)["ports"] if p["name"] == "metrics"] == ["metrics"]
    service = _objects(docs, "Service")[flags["target-metrics"].rpartition(":")[0]]["spec"]
    assert service["clusterIP"] == "None" and service["selector"] == target["spec"]["template"]["metadata"]["labels"]
    assert [p for p in service["ports"] if p["name"] == "metrics"] == [{"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"}]


def test_tensor_parallel_on_cuda_is_refused_until_nccl_is_built() -> None:
    """A tripwire: components/tensor-parallel says its pods cannot start yet, because `serve target`
    refuses --tensor-parallel N on CUDA. When NCCL sharding lands this fails: update that comment."""
    from specdec.core.tensor_parallel import TensorParallelError
    from specdec.target.engine import TargetConfig
    from specdec.target.tp_ranks import check_tensor_parallel

    with pytest.raises(TensorParallelError, match="on CUDA .* is not built yet"):
        check_tensor_parallel(TargetConfig("/models/target", device="cuda", tensor_parallel=2), None)


def test_dev_runs_every_role_on_cpu(rendered) -> None:
    for role in ROLES:
        flags = _flags(_container(_role(rendered["dev"], role)))
        assert flags.get("device", "cpu") == "cpu" and flags.get("draft-device", "cpu") == "cpu", role


def test_gpu_has_no_redis_and_no_placeholder_secret(rendered) -> None:
    docs = rendered["gpu"]
    assert not [d for d in docs if d["metadata"]["name"] == "specdec-redis"]
    assert not _objects(docs, "Secret"), "overlays/gpu must not ship secrets: they are created with kubectl"
    env = {e["name"]: e for e in _container(_role(docs, "orchestrator"))["env"]}
    assert env["SPECDEC_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "specdec-secrets", "key": "redis-url"}


# ----------------------------------------------------------------------------- policy
def _ingress_peers_by_port(policy: dict) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for rule in policy["spec"]["ingress"]:
        assert rule.get("ports") and rule.get("from"), f"{policy['metadata']['name']}: a rule without ports or peers allows too much"
        for port in rule["ports"]:
            out.setdefault(port["port"], []).extend(rule["from"])
    return out


def _role_peer(role: str) -> dict:
    return {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "specdec", "app.kubernetes.io/component": role}}}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy_admits_only_callers_to_the_workers(rendered, overlay: str) -> None:
    policies = _objects(rendered[overlay], "NetworkPolicy")
    # Who calls whom: the orchestrator calls both pools; the verifiers stream from the drafters.
    callers = {"target": ["orchestrator"], "draft": ["orchestrator", "target"]}
    for role, allowed in callers.items():
        labels = _role(rendered[overlay], role)["spec"]["template"]["metadata"]["labels"]
        (policy,) = [p for p in policies.values() if _selects(p["spec"]["podSelector"], labels)]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        by_port = _ingress_peers_by_port(policy)
        assert set(by_port) == {GRPC_PORTS[role], METRICS_PORT}
        assert by_port[GRPC_PORTS[role]] == [_role_peer(r) for r in allowed]
        for peer in by_port[METRICS_PORT]:
            assert peer == {"podSelector": {}} or set(peer) == {"namespaceSelector"}
        assert HEALTH_PORT not in by_port  # the kubelet's only; it comes from the node (deploy/README.md)
    if overlay == "dev":
        redis = policies["specdec-redis"]
        assert _ingress_peers_by_port(redis) == {6379: [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "specdec"}}}]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_autoscaler_may_only_scale_the_two_pools(rendered, overlay: str) -> None:
    docs = rendered[overlay]
    pools = ["specdec-draft", "specdec-target"]
    (role,) = _objects(docs, "Role").values()
    assert not _objects(docs, "ClusterRole") and not _objects(docs, "ClusterRoleBinding")
    for rule in role["rules"]:
        assert rule["apiGroups"] == ["apps"] and rule["resourceNames"] == pools
        assert set(rule["verbs"]) <= {"get", "patch"}
        assert "patch" not in rule["verbs"] or rule["resources"] == ["deployments/scale"]
        assert set(rule["resources"]) <= {"deployments/scale", "deployments"}
    assert any(r["resources"] == ["deployments/scale"] and set(r["verbs"]) == {"get", "patch"} for r in role["rules"])
    (binding,) = _objects(docs, "RoleBinding").values()
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]}
    deployment = _objects(docs, "Deployment")["specdec-autoscaler"]
    namespace = deployment["metadata"]["namespace"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "specdec-autoscaler", "namespace": namespace}]
    spec = deployment["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == "specdec-autoscaler"
    container = _container(deployment)
    assert container["args"][:2] == ["autoscale", "--namespace=$(POD_NAMESPACE)"]
    assert {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}} in container["env"]
    for name in ROLES:  # the workers never talk to the API server: no token in their pods
        assert _role(docs, name)["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_autoscaler_scrapes_each_pool_through_its_headless_service(rendered, overlay: str) -> None:
    docs = rendered[overlay]
    container = _container(_objects(docs, "Deployment")["specdec-autoscaler"])
    flags = _flags(container)
    services = _objects(docs, "Service")
    expected = {"target-metrics": ("specdec-target", "target"), "draft-metrics": ("specdec-draft", "draft"),
                "orchestrator-metrics": ("specdec-orchestrator-pods", "orchestrator")}
    for flag, (service_name, role) in expected.items():
        host, _, port = flags[flag].rpartition(":")
        assert host == service_name, f"--{flag}={flags[flag]}"
        service = services[service_name]["spec"]
        assert service["clusterIP"] == "None", f"{service_name}: headless, so the name resolves to each pod"
        assert service["selector"] == _role(docs, role)["spec"]["template"]["metadata"]["labels"]
        assert {"name": "metrics", "port": int(port), "targetPort": "metrics"} in service["ports"]
        assert int(port) == METRICS_PORT
    assert float(flags["interval-s"]) > 0
    for pool in ("target", "draft"):
        assert 1 <= int(flags[f"min-{pool}"]) <= int(flags[f"max-{pool}"])
    # dev only says what it would do; gpu scales.
    assert ("--dry-run" in container["args"]) == (overlay == "dev")


# ----------------------------------------------------------------------------- every container
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_are_pinned(rendered, overlay: str) -> None:
    for name, spec in _pod_specs(rendered[overlay]):
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            image = container["image"]
            tag = image.rsplit("/", 1)[-1].partition(":")[2]
            assert "@sha256:" in image or (tag and tag != "latest"), f"{name}: image {image} is not pinned"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_requests_and_limits(rendered, overlay: str) -> None:
    for name, spec in _pod_specs(rendered[overlay]):
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            resources = container.get("resources", {})
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(kind, {})), f"{name}/{container['name']}: no {kind}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_runs_unprivileged(rendered, overlay: str) -> None:
    for name, spec in _pod_specs(rendered[overlay]):
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        for container in spec["containers"]:
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False and security["capabilities"] == {"drop": ["ALL"]}, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_roles_are_scraped(rendered, overlay: str) -> None:
    for role in ROLES:
        template = _role(rendered[overlay], role)["spec"]["template"]
        annotations = template["metadata"]["annotations"]
        assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT), "prometheus.io/path": "/metrics"}
        container = _container(_role(rendered[overlay], role))
        assert {"name": "metrics", "containerPort": METRICS_PORT} in container["ports"]
        assert _flags(container)["metrics-port"] == str(METRICS_PORT)


def test_service_monitor_is_optional_and_matches_the_services(rendered) -> None:
    (monitor,) = yaml.safe_load_all((DEPLOY / "optional" / "servicemonitor.yaml").read_text())
    assert monitor["kind"] == "ServiceMonitor" and monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert not any("servicemonitor" in p.read_text().lower() for p in DEPLOY.rglob("kustomization.yaml"))
    scraped = {}  # pod component -> the Services that the monitor scrapes it through
    for name, service in _objects(rendered["gpu"], "Service").items():
        if _selects(monitor["spec"]["selector"], service["metadata"]["labels"]) and \
                {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"} in service["spec"]["ports"]:
            scraped.setdefault(service["spec"]["selector"]["app.kubernetes.io/component"], []).append(name)
    assert {role: len(names) for role, names in scraped.items()} == {role: 1 for role in ROLES}, f"each pod once: {scraped}"
    for names in scraped.values():
        assert _objects(rendered["gpu"], "Service")[names[0]]["spec"]["clusterIP"] == "None"  # pod by pod
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]


# ----------------------------------------------------------------------------- the image
def test_the_image_takes_a_base_image_and_a_torch_index() -> None:
    """`docker build --build-arg BASE_IMAGE=nvidia/cuda:... --build-arg TORCH_INDEX=...` (deploy/README.md)
    builds the CUDA image from the same Dockerfile: the base is an argument, and torch comes from the
    chosen index before the server extra, which then keeps that build (no docker daemon needed here)."""
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]
    (at,) = [i for i, line in enumerate(lines) if line.startswith("FROM ")]
    assert lines[at] == "FROM ${BASE_IMAGE}" and any(line.startswith("ARG BASE_IMAGE=") for line in lines[:at])
    for arg in ("TORCH_SPEC", "TORCH_INDEX"):  # declared after FROM, where the RUN lines see them
        assert any(line.startswith(f"ARG {arg}=") for line in lines[at:]), arg
    torch_at = next(i for i, line in enumerate(lines) if "pip install" in line and "${TORCH_SPEC}" in line)
    assert '--index-url "${TORCH_INDEX}"' in lines[torch_at]
    assert torch_at < next(i for i, line in enumerate(lines) if 'pip install ".[server]"' in line)
