"""What a resumed attempt sends and how its messages continue the client's stream
(services/router/resume.py): the sampling that is left, the usage as if uninterrupted."""

from __future__ import annotations

from kvmesh.discovery.keys import WorkerId
from kvmesh.v1 import common_pb2, router_pb2, worker_pb2
from services.router.resume import Replay, resumed_sampling


def sampling(**kw: object) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=100, **kw)


def test_the_rest_of_max_and_min_tokens_with_the_same_seed_and_sampling() -> None:
    s = sampling(
        min_tokens=30, seed=7, temperature=0.8, stop=["END"], logprobs=2, prompt_logprobs=1
    )
    r = resumed_sampling(s, 40)
    assert r is not None
    assert (r.max_tokens, r.min_tokens) == (60, 0)
    assert (r.seed, r.temperature, list(r.stop), r.logprobs) == (7, s.temperature, ["END"], 2)
    assert not r.HasField("prompt_logprobs")  # the client has them from the first attempt
    fewer = resumed_sampling(sampling(min_tokens=30), 10)
    assert fewer is not None and fewer.min_tokens == 20


def test_nothing_left_to_generate() -> None:
    assert resumed_sampling(sampling(), 100) is None


def chunk(ids: list[int], text: str) -> router_pb2.GenerateResponse:
    return router_pb2.GenerateResponse(token_ids=ids, text=text)


def test_the_final_usage_counts_as_if_uninterrupted() -> None:
    replay = Replay(prompt_tokens=50)
    assert replay.record([chunk([1, 2], "ab"), chunk([3], "c")], resumes=1) == [1, 2, 3]
    msg = worker_pb2.WorkerGenerateResponse(token_ids=[4], text="d")
    msg.finished.usage.prompt_tokens = 53  # the prompt plus the 3 replayed tokens
    msg.finished.usage.cached_prompt_tokens = 48
    msg.finished.usage.completion_tokens = 1
    out = router_pb2.GenerateResponse(token_ids=[4], text="d")
    out.finished.CopyFrom(msg.finished)
    stopped, recomputed = replay.go_on(53, WorkerId("w2"), msg, out, streamed=0)
    assert (stopped, recomputed) == (False, 5)
    u = out.finished.usage
    assert (u.prompt_tokens, u.completion_tokens, u.resumes, u.resume_recomputed_tokens) == (
        50,
        4,
        1,
        5,
    )


def test_a_stop_string_across_the_seam_is_the_final_message() -> None:
    replay = Replay(prompt_tokens=50)
    replay.record([chunk([1, 2], "x E")], resumes=1)
    replay.watch_seam(("END",), pending="")
    msg = worker_pb2.WorkerGenerateResponse(token_ids=[3], text="ND y")
    out = router_pb2.GenerateResponse(token_ids=[3], text="ND y")
    stopped, _ = replay.go_on(52, WorkerId("w2"), msg, out, streamed=0)
    assert stopped and out.text == ""
    f = out.finished
    assert (f.reason, f.stop_reason, f.usage.worker_id) == (
        common_pb2.FINISH_REASON_STOP,
        "END",
        "w2",
    )
    assert (f.usage.prompt_tokens, f.usage.completion_tokens, f.usage.resumes) == (50, 3, 1)


def test_a_client_resume_is_one_more_resume_over_the_tokens_it_has() -> None:
    replay = Replay.from_client(50, router_pb2.Resume(token_ids=[1, 2, 3], text="abc", resumes=1))
    assert (replay.tokens, replay.token_ids, replay.text, replay.resumes) == (
        3,
        [1, 2, 3],
        "abc",
        2,
    )
    # ... and a worker failing after it is resumed by the router on top of the client's
    replay.record([chunk([4], "d")], resumes=1)
    assert (replay.tokens, replay.resumes) == (4, 3)
