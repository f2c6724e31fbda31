"""Speculative decoding as worker configuration: the --spec-* flags and their checks (a bad
setting is exit 2 with one line naming the flag to fix), vLLM's speculative_config built from
them, the model checks (mtp needs MTP layers, a draft model needs the target's vocabulary),
`kvmesh up` mixing speculating and plain workers, and the acceptance counters from the engine's
load to the load stream, the router's snapshot and /metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.errors import InvalidArgument
from services.router.pool import load_from_pb
from services.worker.config import SpeculativeConfig
from services.worker.core import EngineLoad, SpecDecodeCounts
from services.worker.main import parse_args
from services.worker.metrics import WorkerMetrics
from services.worker.servicer import load_to_pb
from services.worker.speculative import check_models, mtp_layer_count, vllm_speculative_config


def model(tmp_path: Path, name: str, **config: object) -> str:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"vocab_size": 1024, **config}))
    return str(path)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        pytest.param(["--spec-method", "medusa"], "argument --spec-method: invalid choice: 'medusa'", id="unknown-method"),
        pytest.param(["--spec-method", "draft_model"], "--spec-method draft_model needs --spec-draft-model PATH", id="draft-no-path"),
        pytest.param(["--spec-method", "eagle3"], "--spec-method eagle3 needs --spec-draft-model PATH (the EAGLE head)", id="eagle-no-head"),
        pytest.param(["--spec-num-tokens", "2"], "--spec-num-tokens needs --spec-method", id="no-method"),
        pytest.param(["--spec-method", "ngram", "--spec-num-tokens", "-1"], "--spec-num-tokens is -1", id="negative"),
        pytest.param(["--spec-method", "ngram", "--spec-draft-model", "x"], "--spec-draft-model is for draft_model, eagle and eagle3, not ngram", id="draft-on-ngram"),
        pytest.param(["--spec-method", "mtp", "--spec-prompt-lookup-max", "3"], "are for --spec-method ngram, not mtp", id="lookup-on-mtp"),
        pytest.param(["--spec-method", "ngram", "--spec-prompt-lookup-min", "5", "--spec-prompt-lookup-max", "2"], "--spec-prompt-lookup-min 5 is above --spec-prompt-lookup-max 2", id="min-above-max"),
        pytest.param(["--spec-method", "ngram", "--spec-extra", '{"method": "x"}'], "--spec-extra sets ['method']", id="extra-clash"),
        pytest.param(["--spec-method", "mtp"], "--spec-method mtp: model", id="mtp-without-layers"),
        pytest.param(["--spec-method", "draft_model", "--spec-draft-model", "/nonexistent"], "--spec-draft-model '/nonexistent' is not a Hugging Face model directory", id="draft-missing"),
        pytest.param(["--spec-method", "ngram", "--engine", "simulated"], "--spec-method needs --engine vllm", id="simulated"),
    ],
)  # fmt: skip
def test_bad_settings_exit_2_with_one_line_naming_the_flag(tmp_path, capsys, argv, says):
    with pytest.raises(SystemExit) as exited:
        parse_args(["--model", model(tmp_path, "target"), *argv], environ={})
    assert exited.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("kvmesh worker: error: ") and says in last, last


def test_mtp_on_a_model_with_mtp_layers_defaults_to_their_count(tmp_path):
    target = model(tmp_path, "mimo", num_nextn_predict_layers=2)
    config = parse_args(["--model", target, "--spec-method", "mtp"], environ={})
    spec = config.engine.speculative
    assert check_models(spec, target) == 2
    assert vllm_speculative_config(spec, 2) == {"method": "mtp", "num_speculative_tokens": 2}
    nested = {"text_config": {"mtp_num_hidden_layers": 1}}
    assert mtp_layer_count(nested) == 1 and mtp_layer_count({"num_nextn_predict_layers": 0}) == 0


def test_draft_model_with_another_vocabulary_is_refused(tmp_path):
    target, draft = model(tmp_path, "target"), model(tmp_path, "draft", vocab_size=32000)
    spec = SpeculativeConfig(method="draft_model", draft_model=draft)
    with pytest.raises(InvalidArgument, match="vocabulary of 32000 tokens, --model 1024"):
        check_models(spec, target)


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        pytest.param(SpeculativeConfig(), None, id="off"),
        pytest.param(SpeculativeConfig(method="ngram"), {"method": "ngram", "num_speculative_tokens": 3}, id="ngram-defaults"),
        pytest.param(SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=3), {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 3, "prompt_lookup_max": 3}, id="ngram-lookup"),
        pytest.param(SpeculativeConfig(method="draft_model", draft_model="/d", extra={"draft_tensor_parallel_size": 1}), {"method": "draft_model", "num_speculative_tokens": 3, "model": "/d", "draft_tensor_parallel_size": 1}, id="draft-extra"),
        pytest.param(SpeculativeConfig(method="eagle", num_speculative_tokens=2, draft_model="/e"), {"method": "eagle", "num_speculative_tokens": 2, "model": "/e"}, id="eagle"),
    ],
)  # fmt: skip
def test_vllm_speculative_config(spec, want):
    assert vllm_speculative_config(spec) == want


def test_flags_environment_and_none(tmp_path):
    target = model(tmp_path, "target")
    env = {"KVMESH_WORKER_SPEC_METHOD": "ngram", "KVMESH_WORKER_SPEC_NUM_TOKENS": "5"}
    spec = parse_args(["--model", target], environ=env).engine.speculative
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 5)
    off = parse_args(["--model", target, "--spec-method", "none"], environ={}).engine.speculative
    assert not off.enabled


def test_kvmesh_up_mixes_speculating_and_plain_workers(tmp_path):
    from kvmesh.cli import _mesh_spec
    from kvmesh.cli import parse_args as cli_args
    from kvmesh.launcher import Mesh

    target, draft = model(tmp_path, "target"), model(tmp_path, "draft")
    argv = ["up", "--model", target, "--etcd", "127.0.0.1:2379", "--workers", "3"]
    spec_flags = ["--spec-method", "draft_model", "--spec-draft-model", draft]
    a = cli_args([*argv, *spec_flags, "--spec-num-tokens", "2", "--spec-workers", "2"])
    mesh = Mesh(_mesh_spec(a))
    want = ["--spec-method", "draft_model", "--spec-num-tokens", "2", "--spec-draft-model", draft]
    assert [mesh.worker_args(i, "both") for i in range(3)] == [want, want, []]
    assert parse_args(["--model", target, *want], environ={}).engine.speculative.enabled
    every = Mesh(_mesh_spec(cli_args([*argv, "--spec-method", "ngram"])))
    assert [every.worker_args(i, "both") for i in range(3)] == [["--spec-method", "ngram"]] * 3


def test_kvmesh_up_checks_the_models_before_starting(tmp_path, capsys):
    from kvmesh.cli import _mesh_spec
    from kvmesh.cli import parse_args as cli_args

    a = cli_args(["up", "--model", model(tmp_path, "t"), "--etcd", "x:1", "--spec-method", "mtp"])
    with pytest.raises(SystemExit) as exited:
        _mesh_spec(a)
    assert exited.value.code == 2
    assert "--spec-method mtp: model" in capsys.readouterr().err


def test_kvmesh_up_takes_the_built_in_eagle_head_and_mtp_model(tmp_path, monkeypatch):
    """tiny-eagle and tiny-mtp are names kvmesh up resolves (built on first use) and passes to
    the workers as directories that pass the model checks."""
    from kvmesh.cli import _mesh_spec
    from kvmesh.cli import parse_args as cli_args
    from kvmesh.launcher import Mesh

    monkeypatch.setenv("KVMESH_HOME", str(tmp_path))
    base = ["up", "--etcd", "x:1", "--workers", "1"]
    eagle = Mesh(_mesh_spec(cli_args([*base, "--model", "tiny", "--spec-method", "eagle",
                                      "--spec-draft-model", "tiny-eagle"])))  # fmt: skip
    args = eagle.worker_args(0, "both")
    head = Path(args[args.index("--spec-draft-model") + 1])
    assert head == tmp_path / "models" / "tiny-eagle-1" and (head / "model.safetensors").is_file()
    mtp = _mesh_spec(cli_args([*base, "--model", "tiny-mtp", "--spec-method", "mtp"]))
    assert Mesh(mtp).worker_args(0, "both") == ["--spec-method", "mtp"]


SPEC = SpecDecodeCounts(
    drafts=10, draft_tokens=30, accepted_tokens=12, accepted_per_position=(7, 4, 1)
)
LOAD = EngineLoad(running_requests=2, generation_tokens=500, spec=SPEC)


def test_acceptance_by_position():
    assert SPEC.acceptance_rate == pytest.approx(0.4)
    assert SPEC.acceptance_by_position() == pytest.approx((0.7, 0.4, 0.1))
    assert (
        SpecDecodeCounts().acceptance_rate is None
        and SpecDecodeCounts().acceptance_by_position() == ()
    )


def test_acceptance_rides_the_load_stream_to_the_router():
    msg = load_to_pb(LOAD, in_flight=2, worker_id="w")
    assert (msg.spec_drafts, msg.spec_draft_tokens, msg.spec_accepted_tokens) == (10, 30, 12)
    assert list(msg.spec_accepted_tokens_per_position) == [7, 4, 1]
    snap = load_from_pb(msg)
    # The router sees emitted tokens (500 in 2 requests' steps), not steps, and the drafts.
    assert (snap.generation_tokens, snap.spec_draft_tokens, snap.spec_accepted_tokens) == (
        500,
        30,
        12,
    )
    assert snap.running_requests == 2 and snap.in_flight_requests == 2


def samples(metrics: WorkerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client import generate_latest

    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_metrics_export_vllms_spec_decode_counters_only_when_speculating():
    m = WorkerMetrics(model="tiny", spec_positions=3)
    lv = (("engine", "0"), ("model_name", "tiny"))
    assert samples(m)[("vllm:spec_decode_num_drafts_total", lv)] == 0  # exported from the start
    m.refresh(LOAD, 2, False, None, None)
    got = samples(m)
    assert got[("vllm:spec_decode_num_drafts_total", lv)] == 10
    assert got[("vllm:spec_decode_num_draft_tokens_total", lv)] == 30
    assert got[("vllm:spec_decode_num_accepted_tokens_total", lv)] == 12
    per_pos = [
        got[("vllm:spec_decode_num_accepted_tokens_per_pos_total", (*lv, ("position", str(i))))]
        for i in range(3)
    ]
    assert per_pos == [7, 4, 1]
    assert got[("kvmesh_worker_engine_generation_tokens_total", ())] == 500
    plain = samples(WorkerMetrics(model="tiny"))
    assert not any(name.startswith("vllm:spec_decode") for name, _ in plain)
