"""The usage line ``kvmesh generate`` prints (kvmesh/client.py): a resumed request says so."""

from __future__ import annotations

from kvmesh.client import Completion, usage_line
from kvmesh.v1 import common_pb2


def done(**usage: object) -> Completion:
    return Completion(
        finish_reason="FINISH_REASON_LENGTH",
        usage=common_pb2.Usage(prompt_tokens=10, completion_tokens=4, worker_id="w2", **usage),
    )


def test_an_uninterrupted_request_says_nothing_of_resumes() -> None:
    line = usage_line(done())
    assert line.startswith("[usage] prompt_tokens=10 ") and "finish=length" in line
    assert "resumed" not in line


def test_a_resumed_request_says_how_often_and_what_it_cost() -> None:
    line = usage_line(done(resumes=1, resume_recomputed_tokens=37))
    assert line.endswith("worker=w2 finish=length resumed=1 recomputed=37")


def test_a_request_that_failed_over_to_another_router_says_so() -> None:
    c = done(resumes=1)
    c.failovers = 1
    assert usage_line(c).endswith("resumed=1 recomputed=0 router_failovers=1")
