"""The client's failover decision (kvmesh/client.py, docs/failover.md): after a Generate
stream broke without its final message, retry it on the next router, resume it there with the
tokens received, or fail; and the router addresses it is given."""

from __future__ import annotations

import grpc
import pytest

from kvmesh.client import (
    Move,
    default_attempts,
    make_request,
    next_move,
    resumable,
    router_targets,
)
from kvmesh.v1 import router_pb2

U = grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    ("code", "received", "attempts", "can_resume", "move"),
    [
        (U, 0, 1, True, Move.RETRY),  # broke before the first token: the same request again
        (U, 0, 1, False, Move.RETRY),  # ... whatever the request
        (U, 12, 1, True, Move.RESUME),  # after tokens: resumed with them
        (U, 12, 1, False, Move.FAIL),  # ... unless a replay cannot restore it
        (U, 12, 3, True, Move.FAIL),  # max_attempts (3) used up
        (grpc.StatusCode.DEADLINE_EXCEEDED, 0, 1, True, Move.FAIL),  # the request's own end
        (grpc.StatusCode.INVALID_ARGUMENT, 0, 1, True, Move.FAIL),
        (grpc.StatusCode.CANCELLED, 5, 1, True, Move.FAIL),
    ],
    ids=[
        "before-first-token",
        "before-first-token-not-resumable",
        "mid-stream",
        "mid-stream-not-resumable",
        "attempts-used-up",
        "deadline",
        "invalid-argument",
        "cancelled",
    ],
)
def test_next_move(
    code: grpc.StatusCode, received: int, attempts: int, can_resume: bool, move: Move
) -> None:
    assert next_move(code, received, attempts, 3, can_resume) is move


def test_structured_outputs_and_forced_tool_choices_are_not_resumable() -> None:
    assert resumable(make_request("hi", chat=True))
    structured = make_request("hi")
    structured.sampling.structured_output.json_object = True
    assert not resumable(structured)
    forced = make_request("hi", chat=True)
    forced.chat.tool_choice.mode = router_pb2.TOOL_CHOICE_MODE_REQUIRED
    assert not resumable(forced)


@pytest.mark.parametrize(
    ("given", "targets"),
    [
        ("a:1", ["a:1"]),
        ("a:1, b:2,", ["a:1", "b:2"]),
        (["a:1", " b:2 "], ["a:1", "b:2"]),
        ("dns:///routers.kvmesh:50051", ["dns:///routers.kvmesh:50051"]),
    ],
    ids=["one", "comma-separated", "list", "dns-name"],
)
def test_router_targets(given: str | list[str], targets: list[str]) -> None:
    assert router_targets(given) == targets


def test_no_router_address_is_an_error() -> None:
    with pytest.raises(ValueError, match="no router address"):
        router_targets(" , ")


def test_one_plain_router_address_has_nothing_to_fail_over_to() -> None:
    assert default_attempts(["a:1"]) == 1  # its own errors reach the caller as they are
    assert default_attempts(["a:1", "b:2"]) == 3
    assert default_attempts(["dns:///routers:50051"]) == 3
