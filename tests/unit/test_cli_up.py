"""`kvmesh up --policy` reaches the router as `kvmesh router --policy` (the router's own parser
reads it), with the choices of the router's profile registry; `kvmesh up` prints each child's
metrics URL from its ready line. No process is started."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from kvmesh.cli import _mesh_spec, describe_metrics, parse_args
from kvmesh.launcher import Mesh
from services.router.config import RouterConfig
from services.router.core.routing import POLICIES
from services.router.main import parse_args as router_args


def model_dir(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def router_argv(tmp_path: Path, *argv: str) -> list[str]:
    """The argument list `kvmesh up ARGV` would start the router with, without spawning."""
    a = parse_args(["up", "--model", model_dir(tmp_path), "--etcd", "127.0.0.1:2379", *argv])
    built: dict[str, list[str]] = {}

    def spawn(name: str, module: str, args: list[str], ready_tag: str) -> None:
        built[module] = args

    mesh = Mesh(_mesh_spec(a))
    mesh._spawn = spawn  # type: ignore[method-assign,assignment]
    mesh.start_router()
    return built["services.router.main"]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_builtin_profile_reaches_the_router(tmp_path, name):
    assert router_args(router_argv(tmp_path, "--policy", name)).policy == name


def test_default_is_the_routers(tmp_path):
    argv = router_argv(tmp_path)
    assert "--policy" not in argv
    assert router_args(argv).policy == RouterConfig().policy == "precise-sticky"


def test_profile_file_is_passed_absolute(tmp_path, monkeypatch):
    (tmp_path / "mine.yaml").write_text("name: mine\n")
    monkeypatch.chdir(tmp_path)
    policy = router_args(router_argv(tmp_path, "--policy", "mine.yaml")).policy
    assert policy == str(tmp_path / "mine.yaml")


@pytest.mark.parametrize(
    ("policy", "says"),
    [
        pytest.param("precise", "unknown profile 'precise'; choose one of", id="unknown"),
        pytest.param("missing.yaml", "no profile file 'missing.yaml'", id="no-file"),
    ],
)
def test_bad_policy_is_a_usage_error(tmp_path, capsys, policy, says):
    with pytest.raises(SystemExit) as info:
        parse_args(["up", "--model", model_dir(tmp_path), "--policy", policy])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "kvmesh up: error: argument --policy:" in err and says in err
    assert all(name in err for name in POLICIES) or "no profile file" in says


def child(name: str, **ready: str) -> SimpleNamespace:
    return SimpleNamespace(name=name, ready=ready)


def test_metrics_urls_of_every_child():
    mesh = SimpleNamespace(
        router=child("router", address="a:1", metrics="http://127.0.0.1:9100/metrics"),
        kvmanager=child("kvmanager", metrics="http://127.0.0.1:9101/metrics"),
        workers=[
            child("worker-0", metrics="http://127.0.0.1:9102/metrics"),
            child("worker-1"),  # --metrics-port -1: no URL in its ready line
        ],
    )
    assert describe_metrics(mesh) == (
        "  metrics router     http://127.0.0.1:9100/metrics\n"
        "          kvmanager  http://127.0.0.1:9101/metrics\n"
        "          worker-0   http://127.0.0.1:9102/metrics\n"
    )
    assert describe_metrics(SimpleNamespace(router=None, kvmanager=None, workers=[])) == ""


def test_a_model_that_is_neither_built_in_nor_a_directory_is_a_clear_exit(tmp_path):
    from kvmesh.cli import main

    with pytest.raises(SystemExit) as info:
        main(["up", "--model", str(tmp_path / "nope")])
    message = str(info.value.code)
    assert message.startswith("kvmesh: --model ") and "no config.json there" in message


@pytest.mark.parametrize(
    ("argv", "colocated"),
    [
        pytest.param(["--workers", "1"], False, id="one-worker"),
        pytest.param([], False, id="default-two"),
        pytest.param(["--workers", "1", "--colocate", "auto"], True, id="auto-one-worker"),
        pytest.param(["--workers", "2", "--colocate", "auto"], False, id="auto-two"),
        pytest.param(["--workers", "2", "--colocate", "on"], True, id="on-with-two"),
        pytest.param(["--workers", "1", "--router-processes", "2"], False, id="processes"),
    ],
)
def test_the_worker_runs_in_the_routers_process_when_asked(tmp_path, argv, colocated):
    a = parse_args(["up", "--model", model_dir(tmp_path), "--etcd", "127.0.0.1:2379", *argv])
    assert _mesh_spec(a).colocate is colocated


def test_the_node_gets_the_routers_flags_then_the_first_workers(tmp_path):
    a = parse_args(
        ["up", "--model", model_dir(tmp_path), "--etcd", "127.0.0.1:2379", "--workers", "1"]
    )
    mesh = Mesh(_mesh_spec(a))
    built: dict[str, list[str]] = {}

    def popen(module: str, args: list[str], log_path: Path) -> tuple[object, object]:
        built[module] = args
        raise RuntimeError("not started")

    mesh._popen = popen  # type: ignore[method-assign,assignment]
    with pytest.raises(RuntimeError, match="not started"):
        mesh.start_node()
    argv = built["services.node.main"]
    router, worker = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    assert router_args(router).etcd_endpoints == ("127.0.0.1:2379",)
    assert worker[worker.index("--worker-id") + 1] == "worker-0"
    assert "--model" in worker and "--model" not in router
