"""Log probabilities through the worker and the router, pure parts: the sampling fields and
their bounds, vLLM's per-position logprob dicts (the token first, then the top-n, in one dict)
as our entries and their protobuf, the prefill half of a disaggregated request asking for none,
and the simulated engine refusing them (it has no probabilities to give)."""

from __future__ import annotations

import pytest
from vllm.logprobs import Logprob

from kvmesh import errors
from kvmesh.sampling import Sampling, check_sampling, sampling_from_pb
from kvmesh.v1 import common_pb2
from services.router.prefill import one_token
from services.worker.core import GenerateRequest, OutputDelta, TokenLogprob, TopLogprob
from services.worker.engine import sampling_params, token_logprobs
from services.worker.servicer import response_to_pb
from services.worker.sim.engine import SimEngineConfig, SimulatedEngine
from services.worker.sim.model import SimWorkerConfig


def test_fields_travel_from_the_proto():
    pb = common_pb2.SamplingParams(max_tokens=4, logprobs=0, prompt_logprobs=3)
    s = sampling_from_pb(pb)
    assert (s.logprobs, s.prompt_logprobs) == (0, 3)
    none = sampling_from_pb(common_pb2.SamplingParams(max_tokens=4))
    assert (none.logprobs, none.prompt_logprobs) == (None, None)


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        pytest.param(Sampling(max_tokens=1, logprobs=21), "sampling.logprobs", id="logprobs"),
        pytest.param(
            Sampling(max_tokens=1, prompt_logprobs=99), "sampling.prompt_logprobs", id="prompt"
        ),
    ],
)
def test_bounded_by_the_engines_max_logprobs(sampling: Sampling, field: str):
    check_sampling(sampling)  # no bound known (the router): not checked
    with pytest.raises(errors.InvalidArgument) as bad:
        check_sampling(sampling, max_logprobs=20)
    assert bad.value.field == field and "at most 20" in str(bad.value)
    check_sampling(Sampling(max_tokens=1, logprobs=20, prompt_logprobs=20), max_logprobs=20)


def test_vllm_sampling_params_ask_for_them_only_when_set():
    on = sampling_params(Sampling(max_tokens=2, logprobs=3, prompt_logprobs=0))
    assert (on.logprobs, on.prompt_logprobs) == (3, 0)
    off = sampling_params(Sampling(max_tokens=2))
    assert (off.logprobs, off.prompt_logprobs) == (None, None)


def lp(logprob: float, rank: int, token: str) -> Logprob:
    return Logprob(logprob=logprob, rank=rank, decoded_token=token)


def test_vllm_positions_become_entries_with_the_top_n_in_rank_order():
    positions = [
        # sampled token 5 is rank 3: vLLM's dict holds it first, then ranks 1 and 2
        {5: lp(-2.0, 3, "c"), 1: lp(-0.1, 1, "a"), 2: lp(-1.0, 2, "b")},
        # sampled token 1 is the most likely: one dict entry for it (rank 1), then rank 2
        {1: lp(-0.2, 1, "a"), 4: lp(-1.7, 2, "d")},
        None,  # a prompt's first token
    ]
    got = token_logprobs([5, 1, 9], positions, 2)
    assert got == (
        TokenLogprob(5, -2.0, "c", 3, (TopLogprob(1, -0.1, "a"), TopLogprob(2, -1.0, "b"))),
        TokenLogprob(1, -0.2, "a", 1, (TopLogprob(1, -0.2, "a"), TopLogprob(4, -1.7, "d"))),
        TokenLogprob(9, None, "", 0),
    )
    own_only = token_logprobs([5], positions[:1], 0)
    assert own_only == (TokenLogprob(5, -2.0, "c", 3),)


def test_the_worker_message_carries_them_only_when_asked():
    entries = (TokenLogprob(5, -2.0, "c", 3, (TopLogprob(1, -0.1, "a"),)),)
    prompt = (TokenLogprob(9, None, "<s>", 0),)
    delta = OutputDelta("r", (5,), "c", 1, 0, 1, logprobs=entries, prompt_logprobs=prompt)
    msg = response_to_pb(delta, "w")
    (e,) = msg.logprobs
    assert (e.token_id, e.logprob, e.token, e.rank) == (5, -2.0, "c", 3)
    assert [(t.token_id, t.token) for t in e.top] == [(1, "a")]
    (p,) = msg.prompt_logprobs
    assert (p.token_id, p.token, p.HasField("logprob")) == (9, "<s>", False)
    plain = response_to_pb(OutputDelta("r", (5,), "c", 1, 0, 1), "w")
    assert not plain.logprobs and not plain.prompt_logprobs


def test_the_prefill_half_asks_for_no_logprobs():
    prefill = one_token(common_pb2.SamplingParams(max_tokens=9, logprobs=2, prompt_logprobs=1))
    assert prefill.max_tokens == 1
    assert not prefill.HasField("logprobs") and not prefill.HasField("prompt_logprobs")


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
async def test_the_simulated_engine_refuses_them(name: str):
    engine = SimulatedEngine(
        SimEngineConfig(worker=SimWorkerConfig(capacity_blocks=64), vocab_size=100)
    )
    try:
        request = GenerateRequest("r", (1, 2, 3), Sampling(max_tokens=2, **{name: 1}))
        with pytest.raises(errors.InvalidArgument) as bad:
            async for _ in engine.generate(request):
                pass
        assert bad.value.field == f"sampling.{name}"
        assert "simulated engine" in str(bad.value)
    finally:
        await engine.close()
