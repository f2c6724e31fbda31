"""`kvmesh up --trace-exporter ... --otlp-endpoint ...`: the flags reach every child the launcher
starts (router, workers, kvmanager), nothing is added when tracing is off, and an OTLP exporter
with nowhere to send is a usage error. No process is started."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvmesh.cli import TRACE_EXPORTERS, _mesh_spec, parse_args
from kvmesh.launcher import Mesh, MeshSpec
from kvmesh.telemetry import Exporter

ROOT = Path(__file__).resolve().parents[2]
OTLP = ["--trace-exporter", "otlp", "--otlp-endpoint", "localhost:4317"]


def child_args(spec: MeshSpec) -> dict[str, list[str]]:
    """The argument list of each child the mesh would start, by module, without spawning."""
    built: dict[str, list[str]] = {}

    def spawn(name: str, module: str, args: list[str], ready_tag: str) -> None:
        built[module] = args

    mesh = Mesh(spec)
    mesh._spawn = spawn  # type: ignore[method-assign,assignment]
    mesh.start_kvmanager()
    mesh.start_worker("worker-0")
    mesh.start_worker("decode-0", Mesh._role_args("decode"))
    mesh.start_router()
    return built


def spec(tmp_path: Path, **kw) -> MeshSpec:  # type: ignore[no-untyped-def]
    return MeshSpec(
        model_path=Path("/m"), etcd_endpoints=("127.0.0.1:2379",), log_dir=tmp_path, **kw
    )


def flags(args: list[str]) -> dict[str, str]:
    return {
        flag: args[i + 1]
        for i, flag in enumerate(args[:-1])
        if flag in ("--trace-exporter", "--otlp-endpoint")
    }


@pytest.mark.parametrize(
    ("kw", "want"),
    [
        ({}, {}),
        ({"trace_exporter": "none", "otlp_endpoint": "localhost:4317"}, {}),
        ({"trace_exporter": "console"}, {"--trace-exporter": "console"}),
        (
            {"trace_exporter": "otlp", "otlp_endpoint": "http://collector:4317"},
            {"--trace-exporter": "otlp", "--otlp-endpoint": "http://collector:4317"},
        ),
        ({"trace_exporter": "otlp"}, {"--trace-exporter": "otlp"}),
    ],
    ids=["default", "none-ignores-endpoint", "console", "otlp", "otlp-from-environment"],
)
def test_every_child_gets_the_tracing_flags(tmp_path, kw, want):
    built = child_args(spec(tmp_path, **kw))
    assert set(built) == {"services.kvmanager.main", "services.worker.main", "services.router.main"}
    for module, args in built.items():
        assert flags(args) == want, module
        if not want:
            assert not any("trace" in a or "otlp" in a for a in args), module


def test_extra_args_come_after_the_tracing_flags(tmp_path):
    """A spec's own worker_args / router_args / kvmanager_args win (argparse: last one wins)."""
    extra = ("--trace-exporter", "none")
    built = child_args(
        spec(
            tmp_path,
            trace_exporter="console",
            worker_args=extra,
            router_args=extra,
            kvmanager_args=extra,
        )
    )
    for args in built.values():
        last = len(args) - 1 - args[::-1].index("--trace-exporter")
        assert args.index("console") < last and args[last + 1] == "none"


def test_each_service_names_itself():
    """The children need no service-name flag: each main() sets its own service.name."""
    for service in ("router", "worker", "kvmanager"):
        source = (ROOT / "services" / service / "main.py").read_text()
        assert f'setup_tracing("kvmesh-{service}"' in source


def test_choices_are_the_exporters():
    assert tuple(e.value for e in Exporter) == TRACE_EXPORTERS


def model_dir(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


@pytest.mark.parametrize("command", ["up", "demo"])
@pytest.mark.parametrize(
    ("argv", "environ", "exporter", "endpoint"),
    [
        ([], {}, "none", ""),
        (["--trace-exporter", "console"], {}, "console", ""),
        (OTLP, {}, "otlp", "localhost:4317"),
        (["--trace-exporter", "otlp"], {"OTEL_EXPORTER_OTLP_ENDPOINT": "c:4317"}, "otlp", ""),
        (
            ["--trace-exporter", "otlp"],
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317/v1/traces"},
            "otlp",
            "",
        ),
    ],
    ids=["default", "console", "otlp", "otlp-env", "otlp-traces-env"],
)
def test_flags_reach_the_spec(tmp_path, command, argv, environ, exporter, endpoint):
    a = parse_args([command, "--model", model_dir(tmp_path), *argv], environ=environ)
    s = _mesh_spec(a)
    assert (s.trace_exporter, s.otlp_endpoint) == (exporter, endpoint)


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["--trace-exporter", "otlp"], {}, "needs --otlp-endpoint"),
        (
            ["--trace-exporter", "otlp"],
            {"OTEL_EXPORTER_OTLP_ENDPOINT": ""},
            "needs --otlp-endpoint",
        ),
        (["--otlp-endpoint", "localhost:4317"], {}, "needs --trace-exporter otlp"),
        (
            ["--trace-exporter", "console", "--otlp-endpoint", "localhost:4317"],
            {},
            "needs --trace-exporter otlp",
        ),
        (["--trace-exporter", "otlp", "--otlp-endpoint", "grpc://c:4317"], {}, "use host:port"),
        (["--trace-exporter", "jaeger"], {}, "invalid choice"),
    ],
    ids=[
        "otlp-nowhere",
        "otlp-empty-env",
        "endpoint-alone",
        "endpoint-console",
        "bad-scheme",
        "bad-exporter",
    ],
)
def test_usage_errors(capsys, argv, environ, message):
    with pytest.raises(SystemExit) as info:
        parse_args(["up", *argv], environ=environ)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "kvmesh up: error:" in err and message in err


def test_other_commands_are_not_checked():
    a = parse_args(["status", "--etcd", "127.0.0.1:1"], environ={})
    assert not hasattr(a, "trace_exporter")
    assert isinstance(a, argparse.Namespace)
