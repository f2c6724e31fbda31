"""Penalties, logit_bias and min_tokens: the shared checks (kvmesh.sampling), the proto round
trip, the OpenAI fields (http/params.py) and the vLLM parameters the worker builds from them."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvmesh.errors import InvalidArgument
from kvmesh.sampling import Sampling, check_sampling, sampling_from_pb
from kvmesh.v1 import common_pb2
from services.router.http import parsing
from services.router.http.errors import BadRequest
from services.router.http.extensions import Extensions

EXT = Extensions()
USER = [{"role": "user", "content": "hi"}]
VOCAB = 1024


@pytest.mark.parametrize(
    ("sampling", "field", "says"),
    [
        pytest.param(Sampling(1, presence_penalty=2.5), "presence_penalty", r"\[-2, 2\]", id="pp"),
        pytest.param(Sampling(1, presence_penalty=-2.01), "presence_penalty", "-2.01", id="pp-"),
        pytest.param(Sampling(1, frequency_penalty=3), "frequency_penalty", r"\[-2, 2\]", id="fp"),
        pytest.param(
            Sampling(1, frequency_penalty=math.nan), "frequency_penalty", "nan", id="fp-nan"
        ),
        pytest.param(Sampling(1, repetition_penalty=0.0), "repetition_penalty", "> 0", id="rp0"),
        pytest.param(
            Sampling(1, repetition_penalty=math.inf), "repetition_penalty", "finite", id="rp-inf"
        ),
        pytest.param(
            Sampling(1, logit_bias=((5, 100.5),)), "logit_bias", r"\[5\] must be in", id="bias"
        ),
        pytest.param(Sampling(1, logit_bias=((5, -101),)), "logit_bias", "-101", id="bias-neg"),
        pytest.param(
            Sampling(1, logit_bias=((VOCAB, 1.0),)), "logit_bias", "outside the vocab", id="key"
        ),
        pytest.param(
            Sampling(1, logit_bias=tuple((t, 1.0) for t in range(1025))),
            "logit_bias",
            "at most 1024",
            id="many",
        ),
        pytest.param(Sampling(4, min_tokens=5), "min_tokens", r"\[0, max_tokens = 4\]", id="min"),
        pytest.param(Sampling(4, min_tokens=-1), "min_tokens", "-1", id="min-neg"),
    ],
)
def test_out_of_range_names_the_field(sampling: Sampling, field: str, says: str):
    with pytest.raises(InvalidArgument, match=says) as err:
        check_sampling(sampling, VOCAB)
    assert err.value.field == f"sampling.{field}"


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(1, presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1e-3),
        Sampling(1, repetition_penalty=100.0, logit_bias=((0, -100.0), (VOCAB - 1, 100.0))),
        Sampling(4, min_tokens=4),
        Sampling(4, min_tokens=0),
    ],
    ids=["penalty-edges", "bias-edges", "min-is-max", "min-0"],
)
def test_edges_are_accepted(sampling: Sampling):
    check_sampling(sampling, VOCAB)


def test_logit_bias_keys_unchecked_without_a_vocabulary():
    check_sampling(Sampling(1, logit_bias=((10**6, 1.0),)), vocab_size=0)


def test_proto_round_trip():
    pb = common_pb2.SamplingParams(
        max_tokens=8,
        presence_penalty=0.5,
        frequency_penalty=-1.5,
        repetition_penalty=1.25,
        logit_bias={7: 2.5, 3: -100.0},
        min_tokens=2,
    )
    got = sampling_from_pb(pb)
    assert (got.presence_penalty, got.frequency_penalty, got.repetition_penalty) == (
        0.5,
        -1.5,
        1.25,
    )
    assert got.logit_bias == ((3, -100.0), (7, 2.5))  # by token id
    assert got.min_tokens == 2
    unset = sampling_from_pb(common_pb2.SamplingParams(max_tokens=8))
    assert unset.presence_penalty is None and unset.repetition_penalty is None
    assert unset.logit_bias == () and unset.min_tokens == 0


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_openai_fields_reach_the_request(kind: str):
    body: dict[str, Any] = {
        "presence_penalty": 1,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "logit_bias": {"42": 100, " 7 ": -3.5},
        "min_tokens": 3,
        "max_tokens": 9,
    }
    if kind == "chat":
        parsed = parsing.parse_chat({**body, "messages": USER}, EXT, "rid", 64)
    else:
        parsed = parsing.parse_completion({**body, "prompt": "x"}, EXT, "rid", 64)
    s = parsed.generate.sampling
    assert s.presence_penalty == 1.0 and s.frequency_penalty == -0.5
    assert s.repetition_penalty == pytest.approx(1.1)
    assert dict(s.logit_bias) == {42: 100.0, 7: -3.5}
    assert s.min_tokens == 3


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        pytest.param({"logit_bias": [1, 2]}, "logit_bias", "an object", id="bias-list"),
        pytest.param({"logit_bias": {"a": 1}}, "logit_bias", "token ids", id="bias-key"),
        pytest.param({"logit_bias": {"-1": 1}}, "logit_bias", "token ids", id="bias-neg-key"),
        pytest.param({"logit_bias": {"1": "x"}}, "logit_bias", "a number", id="bias-value"),
        pytest.param({"logit_bias": {"1": True}}, "logit_bias", "a number", id="bias-bool"),
        pytest.param({"min_tokens": -1}, "min_tokens", ">= 0", id="min-neg"),
        pytest.param({"min_tokens": 1.5}, "min_tokens", "integer", id="min-float"),
        pytest.param({"repetition_penalty": "2"}, "repetition_penalty", "number", id="rp-str"),
    ],
)
def test_openai_bad_types(extra: dict[str, Any], param: str, says: str):
    with pytest.raises(BadRequest, match=says) as err:
        parsing.parse_chat({"messages": USER, **extra}, EXT, "rid", 64)
    assert err.value.param == param


@pytest.mark.parametrize(
    "field", ["presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"]
)
def test_router_field_maps_to_the_openai_param(field: str):
    parsed = parsing.parse_chat({"messages": USER}, EXT, "rid", 64)
    exc = parsing.router_error(InvalidArgument("bad", f"sampling.{field}"), parsed)
    assert isinstance(exc, BadRequest) and exc.param == field
    exc = parsing.router_error(InvalidArgument("bad", "sampling.min_tokens"), parsed)
    assert isinstance(exc, BadRequest) and exc.param == "min_tokens"


def test_vllm_sampling_params():
    from services.worker.engine import sampling_params

    p = sampling_params(
        Sampling(
            8,
            presence_penalty=0.5,
            frequency_penalty=-1.0,
            repetition_penalty=1.5,
            logit_bias=((3, 100.0),),
            min_tokens=2,
        )
    )
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1.0, 1.5)
    assert p.logit_bias == {3: 100.0} and p.min_tokens == 2
    default = sampling_params(Sampling(8))
    assert (default.presence_penalty, default.repetition_penalty, default.min_tokens) == (
        0.0,
        1.0,
        0,
    )
    assert not default.logit_bias


SIM_FAST = {"vocab_size": 1000, "speedup": 50.0}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 0.5),
        ("frequency_penalty", -1.0),
        ("repetition_penalty", 1.2),
        ("logit_bias", ((3, 5.0),)),
    ],
)
async def test_simulated_engine_refuses_what_it_cannot_simulate(field: str, value: object):
    from services.worker.core import GenerateRequest
    from services.worker.sim.engine import SimEngineConfig, SimulatedEngine
    from services.worker.sim.model import SimWorkerConfig

    engine = SimulatedEngine(
        SimEngineConfig(worker=SimWorkerConfig(capacity_blocks=64), **SIM_FAST)
    )
    try:
        request = GenerateRequest("r", tuple(range(40)), Sampling(4, **{field: value}))
        with pytest.raises(InvalidArgument, match="simulated engine does not support") as err:
            [d async for d in engine.generate(request)]
        assert err.value.field == f"sampling.{field}"
        # The neutral values are the defaults, not a request to simulate anything.
        neutral = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
        if field in neutral:
            ok = GenerateRequest("ok", tuple(range(40)), Sampling(4, **{field: neutral[field]}))
            assert [d async for d in engine.generate(ok)][-1].completion_tokens == 4
    finally:
        await engine.close()


async def test_simulated_engine_honours_min_tokens():
    from services.worker.core import FinishReason, GenerateRequest
    from services.worker.sim.engine import SimEngineConfig, SimulatedEngine, fake_token_ids
    from services.worker.sim.model import SimWorkerConfig

    cfg = SimEngineConfig(
        worker=SimWorkerConfig(capacity_blocks=64), eos_after_tokens=2, **SIM_FAST
    )
    engine = SimulatedEngine(cfg)
    try:

        async def run(rid: str, s: Sampling) -> tuple[list[int], FinishReason]:
            out = [d async for d in engine.generate(GenerateRequest(rid, tuple(range(40)), s))]
            assert out[-1].finish is not None
            return [t for d in out for t in d.token_ids], out[-1].finish.reason

        # The simulated end of sequence waits for min_tokens.
        assert len((await run("a", Sampling(8)))[0]) == 2
        tokens, reason = await run("b", Sampling(8, min_tokens=5))
        assert len(tokens) == 5 and reason is FinishReason.STOP
        # A stop token id among the first min_tokens outputs is not generated there.
        made_up = fake_token_ids("c", 8, 1000)
        stop = made_up[1]
        tokens, reason = await run("c", Sampling(8, ignore_eos=True, stop_token_ids=(stop,)))
        assert len(tokens) == made_up.index(stop) + 1
        later = await run("c2", Sampling(8, ignore_eos=True, min_tokens=4, stop_token_ids=(stop,)))
        assert stop not in later[0][:4]
    finally:
        await engine.close()
