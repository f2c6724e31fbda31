"""CORS of the OpenAI front door (services/router/http/cors.py): which headers a preflight and
an actual request get, as vLLM's --allowed-origins / --allowed-methods / --allowed-headers /
--allow-credentials (Starlette's CORSMiddleware) give them; the router's flags and `kvmesh up`
passing them through. No process is started."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh import errors
from kvmesh.cli import _mesh_spec, parse_args
from kvmesh.launcher import Mesh
from services.router.config import RouterConfig
from services.router.http.cors import ALL_METHODS, CorsPolicy, parse_list
from services.router.main import parse_args as router_args

APP = "https://app.example"
OTHER = "https://evil.example"


@pytest.mark.parametrize(
    ("policy", "origin", "method", "asked", "status", "want"),
    [
        pytest.param(CorsPolicy(), APP, "POST", "", 400, {}, id="default-allows-none"),
        pytest.param(
            CorsPolicy((APP,)),
            APP,
            "POST",
            "authorization, content-type",
            200,
            {
                "Access-Control-Allow-Origin": APP,
                "Access-Control-Allow-Methods": ", ".join(ALL_METHODS),
                "Access-Control-Allow-Headers": "authorization, content-type",
                "Vary": "Origin",
            },
            id="listed-origin",
        ),
        pytest.param(CorsPolicy((APP,)), OTHER, "POST", "", 400, {}, id="unlisted-origin"),
        pytest.param(
            CorsPolicy(("*",)),
            OTHER,
            "GET",
            "",
            200,
            {"Access-Control-Allow-Origin": "*"},
            id="star-any-origin",
        ),
        pytest.param(
            CorsPolicy(("*",), allow_credentials=True),
            OTHER,
            "GET",
            "",
            200,
            {"Access-Control-Allow-Origin": OTHER, "Access-Control-Allow-Credentials": "true"},
            id="star-with-credentials-echoes-the-origin",
        ),
        pytest.param(
            CorsPolicy((APP,), allowed_methods=("GET", "POST")),
            APP,
            "DELETE",
            "",
            400,
            {},
            id="method-not-allowed",
        ),
        pytest.param(
            CorsPolicy((APP,), allowed_methods=("GET", "POST")),
            APP,
            "post",
            "",
            200,
            {"Access-Control-Allow-Methods": "GET, POST"},
            id="listed-methods",
        ),
        pytest.param(
            CorsPolicy((APP,), allowed_headers=("Content-Type",)),
            APP,
            "POST",
            "content-type, x-secret",
            400,
            {},
            id="header-not-allowed",
        ),
        pytest.param(
            CorsPolicy((APP,), allowed_headers=("Content-Type", "Authorization")),
            APP,
            "POST",
            "content-type",
            200,
            {"Access-Control-Allow-Headers": "Content-Type, Authorization"},
            id="listed-headers",
        ),
    ],
)
def test_preflight(policy, origin, method, asked, status, want):
    got_status, headers = policy.preflight(origin, method, asked)
    assert got_status == status
    if status != 200:
        assert "Access-Control-Allow-Origin" not in headers
        return
    assert headers["Access-Control-Max-Age"] == "600"
    for name, value in want.items():
        assert headers[name] == value, name


@pytest.mark.parametrize(
    ("policy", "origin", "want"),
    [
        pytest.param(CorsPolicy(), APP, {}, id="off"),
        pytest.param(CorsPolicy((APP,)), None, {}, id="no-origin-header"),
        pytest.param(CorsPolicy((APP,)), OTHER, {}, id="unlisted"),
        pytest.param(
            CorsPolicy((APP,)), APP, {"Access-Control-Allow-Origin": APP, "Vary": "Origin"}, id="ok"
        ),
        pytest.param(CorsPolicy(("*",)), OTHER, {"Access-Control-Allow-Origin": "*"}, id="star"),
    ],
)
def test_actual_request_headers(policy, origin, want):
    assert policy.simple(origin) == want


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        pytest.param("", (), id="empty"),
        pytest.param('["https://a.example", "*"]', ("https://a.example", "*"), id="json"),
        pytest.param("GET, POST", ("GET", "POST"), id="comma"),
        pytest.param("*", ("*",), id="star"),
    ],
)
def test_parse_list(raw, want):
    assert parse_list("--allowed-origins", raw) == want


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        pytest.param("[1, 2]", "want a JSON list of strings", id="not-strings"),
        pytest.param('["a"', "not a JSON list", id="bad-json"),
    ],
)
def test_parse_list_names_the_flag(raw, says):
    with pytest.raises(errors.InvalidArgument, match=f"--allowed-methods: {says}"):
        parse_list("--allowed-methods", raw)


@pytest.mark.parametrize("origin", ["app.example", "https://app.example/", "https://a.b/path/"])
def test_an_origin_is_scheme_host_port(origin):
    with pytest.raises(errors.InvalidArgument, match="allowed_origins"):
        CorsPolicy((origin,))


def test_router_flags_default_to_no_cors():
    assert router_args([]).cors == RouterConfig().cors == CorsPolicy()
    assert not CorsPolicy().enabled


def test_router_flags_as_vllm_takes_them():
    cfg = router_args(
        [
            "--allowed-origins",
            f'["{APP}"]',
            "--allowed-methods",
            '["GET", "POST"]',
            "--allowed-headers",
            "Content-Type,Authorization",
            "--allow-credentials",
        ]
    )
    assert cfg.cors == CorsPolicy((APP,), ("GET", "POST"), ("Content-Type", "Authorization"), True)


def test_router_rejects_a_bad_origin(capsys):
    with pytest.raises(SystemExit):
        router_args(["--allowed-origins", "app.example"])
    assert "is not an origin" in capsys.readouterr().err


def router_argv(tmp_path: Path, *argv: str) -> list[str]:
    """The router's argument list `kvmesh up ARGV` would start it with (nothing spawned)."""
    (tmp_path / "config.json").write_text("{}")
    a = parse_args(["up", "--model", str(tmp_path), "--etcd", "127.0.0.1:2379", *argv])
    built: dict[str, list[str]] = {}

    def spawn(name: str, module: str, args: list[str], ready_tag: str) -> None:
        built[module] = args

    mesh = Mesh(_mesh_spec(a))
    mesh._spawn = spawn  # type: ignore[method-assign,assignment]
    mesh.start_router()
    return built["services.router.main"]


def test_kvmesh_up_passes_cors_to_the_router(tmp_path: Path):
    argv = router_argv(tmp_path, "--allowed-origins", "*", "--allow-credentials")
    assert router_args(argv).cors == CorsPolicy(("*",), allow_credentials=True)
    argv = router_argv(tmp_path, "--allowed-methods", "GET", "--allowed-headers", '["X-A"]')
    assert router_args(argv).cors == CorsPolicy((), ("GET",), ("X-A",))
    # Without the flags the router keeps its default.
    argv = router_argv(tmp_path)
    assert not any(a.startswith("--allow") for a in argv)
    assert router_args(argv).cors == CorsPolicy()
