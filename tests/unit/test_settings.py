"""Flags, environment and config file generated from the config dataclasses (kvmesh/settings.py):
every field of every service config has a doc and a flag, the flags launchers, docs and tests
use keep working, and the precedence is defaults < config file < environment < flags."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path

import pytest

from kvmesh.discovery.keys import Role
from kvmesh.settings import Option, options
from kvmesh.telemetry import Exporter
from services.kvmanager.config import KvManagerConfig
from services.kvmanager.core.config import Populate
from services.kvmanager.main import parse_args as kvmanager_args
from services.router.config import RouterConfig
from services.router.core.placement import Placement
from services.router.main import parse_args as router_args
from services.worker.config import WorkerConfig
from services.worker.main import parse_args as worker_args

CONFIGS = {"router": RouterConfig, "worker": WorkerConfig, "kvmanager": KvManagerConfig}

# The flags of the hand-written parsers these replace (kvmesh up, the launcher, docker/, deploy/,
# docs and tests pass them): each must still parse.
LEGACY_FLAGS = {
    "router": "--advertise-host --allow-credentials --allowed-headers --allowed-methods "
    "--allowed-origins --api-key --cluster --default-timeout-s --disagg-kv-bytes-per-token "
    "--disagg-network-gbps --disagg-placement --disagg-prefill-timeout-s "
    "--disagg-threshold-tokens --drain-grace-s --etcd --first-token-timeout-s --hash-algo "
    "--hash-seed --host --http-host --http-max-body-bytes --http-port --index-max-blocks "
    "--log-level --max-request-bytes --metrics-host --metrics-port --no-disagg "
    "--no-disagg-overlap --no-peer-hints --no-worker-mux --otlp-endpoint --peer-hint-min-blocks "
    "--policy --port --processes --reuse-port --router-id --tokenizer --trace-exporter",
    "worker": "--advertise-host --block-size --cluster --compute-cpus --drain-grace-s --dtype "
    "--engine --etcd --etcd-ttl-s --hash-seed --host --kv-cache-bytes --kv-events-config "
    "--kv-transfer-config --kvmanager --load-interval-s --log-level --max-model-len "
    "--max-num-seqs --metrics-host --metrics-port --model --no-prefix-caching --node "
    "--otlp-endpoint --port --role --seed --served-model-name --service-cpus "
    "--sim-capacity-blocks --sim-max-running --sim-speedup --structured-outputs-config "
    "--trace-exporter --worker-id",
    "kvmanager": "--advertise-host --cluster --cpu-bytes --cpu-populate --data-plane-host "
    "--data-plane-max-streams --data-plane-port --disk-bytes --disk-dir --drain-grace-s --etcd "
    "--fsync --host --io-threads --kvmanager-id --log-level --max-message-bytes --metrics-host "
    "--metrics-port --no-cpu-arena --node --otlp-endpoint --peer-fetch-timeout-s "
    "--peer-stall-timeout-s --port --shm-dir --shm-max-segments --trace-exporter "
    "--write-through",
}


def leaves(cls: type, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every leaf field of a config tree, found without kvmesh.settings."""
    hints = typing.get_type_hints(cls)
    out: list[tuple[str, ...]] = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if dataclasses.is_dataclass(hints[f.name]):
            out += leaves(hints[f.name], (*path, f.name))
        else:
            out.append((*path, f.name))
    return out


def parser_flags(service: str) -> set[str]:
    from kvmesh.settings import add_config_flags

    p = argparse.ArgumentParser()
    add_config_flags(p, CONFIGS[service])
    return {s for a in p._actions for s in a.option_strings}


@pytest.mark.parametrize("service", CONFIGS)
def test_every_field_has_a_doc_and_one_flag_of_its_own(service):
    opts = options(CONFIGS[service])
    assert [o.path for o in opts] == leaves(CONFIGS[service])
    for o in opts:
        assert o.doc.strip(), o.path
        assert o.flag and not o.flag.startswith("-"), o.path
    flags = [o.flag for o in opts]
    assert len(flags) == len(set(flags)), sorted(f for f in flags if flags.count(f) > 1)


def _doc_names_a_unit(o: Option) -> bool:
    units = ("second", "bytes", "byte", "1e9", "blocks", "tokens", "batches", "fraction")
    return o.path[-1].endswith(("_s", "_bytes", "_gbps")) or any(u in o.doc for u in units)


@pytest.mark.parametrize("service", CONFIGS)
def test_durations_and_sizes_say_their_unit(service):
    for o in options(CONFIGS[service]):
        if o.kind is float or o.path[-1].endswith(("_s", "_bytes")):
            assert _doc_names_a_unit(o), (o.path, o.doc)


@pytest.mark.parametrize("service", CONFIGS)
def test_the_flags_of_the_hand_written_parsers_still_exist(service):
    have = parser_flags(service)
    missing = [f for f in LEGACY_FLAGS[service].split() if f not in have]
    assert not missing


def test_flags_that_only_some_services_had_are_on_all_that_have_the_setting():
    # the drift this replaced: --etcd-ttl-s only on the worker, the router without these
    for flag in ("--etcd-ttl-s", "--metrics-refresh-s"):
        for service in CONFIGS:
            assert flag in parser_flags(service), (service, flag)
    router = parser_flags("router")
    for flag in ("--tokenizer-threads", "--max-retries", "--worker-call-timeout-s"):
        assert flag in router


def test_the_defaults_are_the_dataclasses_own():
    assert router_args([], {}) == RouterConfig()
    assert kvmanager_args([], {}) == KvManagerConfig()
    got = worker_args(["--engine", "simulated"], {})
    assert dataclasses.replace(got, engine=WorkerConfig().engine) == WorkerConfig(
        engine_kind="simulated"
    )
    # the engine core drains as long as the worker does, unless told otherwise
    assert got.engine.core_drain_s == 30
    assert (
        worker_args(["--engine", "simulated", "--drain-grace-s", "2.5"], {}).engine.core_drain_s
        == 3
    )
    told = worker_args(["--engine", "simulated", "--core-drain-s", "0"], {})
    assert told.engine.core_drain_s == 0


def test_values_of_every_kind_parse_from_flags():
    r = router_args(
        [
            "--etcd", "a:1, b:2", "--api-key", "k1", "--api-key", "k2",
            "--tokenizer", "m=/t", "--no-disagg", "--disagg-placement", "joint",
            "--disagg-network-gbps", "25", "--max-request-bytes", "2MiB",
            "--allowed-origins", '["https://a.example"]', "--trace-exporter", "console",
            "--hash-seed", "7", "--etcd-ttl-s", "4",
        ],
        {},
    )  # fmt: skip
    assert r.etcd_endpoints == ("a:1", "b:2") and r.api_keys == ("k1", "k2")
    assert r.tokenizer_overrides == {"m": "/t"} and not r.disagg.enabled
    assert r.disagg.placement.mode is Placement.JOINT and r.disagg.placement.network_gbps == 25
    assert r.max_request_bytes == 2 << 20 and r.cors.allowed_origins == ("https://a.example",)
    assert r.trace_exporter is Exporter.CONSOLE and r.hash_seed == "7" and r.etcd_ttl_s == 4
    k = kvmanager_args(
        ["--cpu-bytes", "1GiB", "--disk-dir", "/d", "--shm-dir", "", "--no-cpu-arena",
         "--cpu-populate", "off", "--data-plane-max-streams", "3", "--etcd", ""],
        {},
    )  # fmt: skip
    assert k.store.cpu_bytes == 1 << 30 and k.store.disk_dir == Path("/d")
    assert k.shm.dir is None and not k.store.cpu_arena and k.store.cpu_populate is Populate.OFF
    assert k.peer.max_streams == 3 and k.etcd_endpoints == ()
    w = worker_args(
        ["--model", "/m", "--role", "decode", "--compute-cpus", "0-2", "--no-prefix-caching",
         "--kv-events-config", '{"topic": "t"}', "--kvmanager", "127.0.0.1:5"],
        {},
    )  # fmt: skip
    assert w.role is Role.DECODE and w.engine.compute_cpus == (0, 1, 2)
    assert not w.engine.enable_prefix_caching and w.engine.kv_events_config == {"topic": "t"}
    assert w.engine.kv_transfer_config is not None  # from --kvmanager


def test_precedence_defaults_file_environment_flags(tmp_path):
    config = tmp_path / "router.yaml"
    config.write_text(
        "etcd_ttl_s: 3\nmax_retries: 4\npolicy: from-file\n"
        "disagg:\n  threshold_tokens: 64\n  placement:\n    mode: joint\n"
        "api_keys: [a, b]\n"
    )
    env = {"KVMESH_ROUTER_MAX_RETRIES": "5", "KVMESH_ROUTER_POLICY": "from-env",
           "KVMESH_ROUTER_NO_SUCH": "x", "KVMESH_WORKER_PORT": "9"}  # fmt: skip
    r = router_args(["--config", str(config), "--policy", "from-flag"], env)
    assert r.etcd_ttl_s == 3  # file over default
    assert r.max_retries == 5  # environment over file
    assert r.policy == "from-flag"  # flag over environment
    assert r.disagg.threshold_tokens == 64 and r.disagg.placement.mode is Placement.JOINT
    assert r.disagg.prefill_timeout_s == RouterConfig().disagg.prefill_timeout_s
    assert r.api_keys == ("a", "b") and r.port == 0  # another service's variable: ignored
    assert not router_args([], {"KVMESH_ROUTER_PEER_HINTS": "false"}).peer_hints
    assert router_args(["--peer-hints"], {"KVMESH_ROUTER_PEER_HINTS": "0"}).peer_hints


@pytest.mark.parametrize(
    ("argv", "env", "file", "says"),
    [
        (["--peer-hint-min-blocks", "0"], {}, None, "--peer-hint-min-blocks is 0"),
        (["--disagg-placement", "sideways"], {}, None, "invalid choice: 'sideways'"),
        (["--port", "x"], {}, None, "--port"),
        (["--allowed-origins", "nope"], {}, None, "is not an origin"),
        ([], {"KVMESH_ROUTER_PORT": "x"}, None, "KVMESH_ROUTER_PORT='x'"),
        ([], {}, "prot: 1\n", "unknown setting 'prot'"),
        ([], {}, "peer_hints: 3\n", "want true or false"),
    ],
    ids=["check", "choice", "type", "origin", "env", "file-key", "file-type"],
)
def test_bad_values_are_usage_errors_saying_where(tmp_path, capsys, argv, env, file, says):
    if file is not None:
        (tmp_path / "c.yaml").write_text(file)
        argv = [*argv, "--config", str(tmp_path / "c.yaml")]
    with pytest.raises(SystemExit) as info:
        router_args(argv, env)
    assert info.value.code == 2
    assert says in capsys.readouterr().err


def test_a_field_without_a_doc_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Bad:
        undocumented: int = 0

    with pytest.raises(TypeError, match=r"Bad\.undocumented"):
        options(Bad)
