"""n > 1 and prompt batches at the OpenAI front door (``choices``, pure): the router requests a
request becomes (ids, choice indexes, seeds), n / best_of / batch parsing, and the merge of the
choices' streams into one answer (indexes, finish per choice, usage counting each prompt once),
which the official openai SDK's types must parse."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from kvmesh.v1 import common_pb2, router_pb2
from services.router.http import parsing
from services.router.http.choices import Choices, SubRequest, count, merge_usage, plan
from services.router.http.errors import BadRequest
from services.router.http.extensions import Extensions

EXT = Extensions()
USER = [{"role": "user", "content": "hi"}]


def chat(**body: Any) -> parsing.ParsedRequest:
    return parsing.parse_chat({"model": "tiny", "messages": USER, **body}, EXT, "chatcmpl-x", 64)


def completion(**body: Any) -> parsing.ParsedRequest:
    return parsing.parse_completion({"model": "tiny", **body}, EXT, "cmpl-x", 64)


# ---- plan ------------------------------------------------------------------------------------
def test_one_choice_is_the_request_itself():
    parsed = chat()
    (sub,) = plan(parsed)
    assert sub.generate is parsed.generate and sub.index == 0
    assert count(parsed) == 1


def test_n_choices_share_the_prompt_with_seed_plus_j():
    parsed = chat(n=3, seed=41)
    subs = plan(parsed)
    assert [(s.index, s.prompt, s.sample) for s in subs] == [(0, 0, 0), (1, 0, 1), (2, 0, 2)]
    assert [s.generate.request_id for s in subs] == ["chatcmpl-x-0", "chatcmpl-x-1", "chatcmpl-x-2"]
    assert [s.generate.sampling.seed for s in subs] == [41, 42, 43]
    assert all(s.generate.chat == parsed.generate.chat for s in subs)
    assert parsed.generate.request_id == "chatcmpl-x"  # the template is not changed


def test_seed_wraps_inside_int64_and_no_seed_stays_unset():
    subs = plan(chat(n=2, seed=2**63 - 1))
    assert subs[1].generate.sampling.seed == -(2**63)
    assert not any(s.generate.sampling.HasField("seed") for s in plan(chat(n=2)))


def test_batch_times_n_indexes_prompt_major():
    parsed = completion(prompt=["a", [5, 6], "c"], n=2)
    subs = plan(parsed)
    assert count(parsed) == 6
    assert [(s.index, s.prompt, s.sample) for s in subs] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 1, 0),
        (3, 1, 1),
        (4, 2, 0),
        (5, 2, 1),
    ]
    inputs = [s.generate.WhichOneof("input") for s in subs]
    assert inputs == ["text", "text", "token_ids", "token_ids", "text", "text"]
    assert list(subs[3].generate.token_ids.ids) == [5, 6] and subs[5].generate.text == "c"


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        pytest.param([1, 2, 3], 1, id="ids-are-one-prompt"),
        pytest.param(["a"], 1, id="batch-of-one"),
        pytest.param([[1], [2]], 2, id="id-lists"),
        pytest.param(["a", [2]], 2, id="mixed"),
    ],
)
def test_batch_shapes(prompt: Any, prompts: int):
    parsed = completion(prompt=prompt)
    assert count(parsed) == prompts and len(parsed.batch) == (prompts if prompts > 1 else 0)


def test_with_model_names_every_prompt():
    parsed = parsing.with_model(
        parsing.parse_completion({"prompt": ["a", "b"]}, EXT, "cmpl-x", 64), "tiny"
    )
    assert [g.model for g in parsed.batch] == ["tiny", "tiny"]
    assert {s.generate.model for s in plan(parsed)} == {"tiny"}


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        pytest.param({"n": 0}, "n", r"\[1, 128\]", id="n0"),
        pytest.param({"n": 129}, "n", r"\[1, 128\]", id="n129"),
        pytest.param({"n": "2"}, "n", "integer", id="n-str"),
        pytest.param({"n": 2, "best_of": 1}, "best_of", ">= n = 2", id="best-of-below-n"),
        pytest.param({"best_of": 3}, "best_of", "vLLM V1", id="best-of-above-n"),
        pytest.param({"prompt": ["a", ""]}, "prompt[1]", "empty", id="empty-in-batch"),
        pytest.param({"prompt": ["a", [1, -1]]}, "prompt[1]", "must be", id="bad-ids-in-batch"),
        pytest.param({"prompt": ["a"] * 9, "n": 128}, "prompt", "at most 1024", id="too-many"),
        # echo puts each prompt first: one prompt per request (its text is what echo repeats)
        pytest.param({"prompt": ["a", "b"], "echo": True}, "echo", "list of prompts", id="echo"),
    ],
)
def test_bad_choices(body: dict[str, Any], param: str, says: str):
    with pytest.raises(BadRequest, match=says) as err:
        completion(**{"prompt": "x", **body})
    assert err.value.param == param


def test_logprobs_reach_every_prompt_of_a_batch():
    req = completion(prompt=["a", [5, 6]], logprobs=2)
    assert [r.sampling.logprobs for r in req.batch] == [2, 2]
    assert req.logprobs.top == 2


def test_best_of_equal_to_n_selects_nothing_and_is_accepted():
    assert completion(prompt="x", n=2, best_of=2).n == 2
    assert chat(n=3).n == 3


# ---- merge -----------------------------------------------------------------------------------
def usage(prompt: int, cached: int, completion: int, worker: str, ttft: float = 0.1):
    return common_pb2.Usage(
        prompt_tokens=prompt,
        cached_prompt_tokens=cached,
        cached_gpu_tokens=cached,
        completion_tokens=completion,
        worker_id=worker,
        time_to_first_token_s=ttft,
    )


def test_usage_counts_each_prompt_once_and_adds_completions():
    subs = plan(completion(prompt=["a", "b"], n=2))
    got = merge_usage(
        subs,
        {
            0: usage(10, 0, 3, "w1", 0.5),
            1: usage(10, 8, 4, "w1"),  # a sibling: its prompt hit the first one's KV
            2: usage(20, 16, 5, "w2", 0.2),
            3: usage(20, 16, 6, "w2"),
        },
    )
    assert (got.prompt_tokens, got.cached_prompt_tokens, got.completion_tokens) == (30, 16, 18)
    assert got.cached_gpu_tokens == 16 and got.worker_id == "w1,w2"
    assert got.time_to_first_token_s == pytest.approx(0.2)


def text_msg(rid: str, text: str) -> router_pb2.GenerateResponse:
    return router_pb2.GenerateResponse(request_id=rid, text=text, token_ids=[7])


def finished_msg(sub: SubRequest, reason: int, u: common_pb2.Usage) -> router_pb2.GenerateResponse:
    msg = router_pb2.GenerateResponse(request_id=sub.generate.request_id)
    msg.finished.reason = reason
    msg.finished.usage.CopyFrom(u)
    return msg


STOP, LENGTH = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH


def test_streamed_choices_interleave_and_finish_each():
    parsed = chat(n=2, stream=True, stream_options={"include_usage": True})
    subs = plan(parsed)
    merged = Choices(parsed, subs, created=5)
    a, b = subs
    payloads = []
    payloads += merged.feed((0, text_msg(a.generate.request_id, "Hel")))
    payloads += merged.feed((1, text_msg(b.generate.request_id, "Yo")))
    payloads += merged.feed((0, finished_msg(a, STOP, usage(9, 0, 1, "w1"))))
    assert not merged.finished
    payloads += merged.feed((1, text_msg(b.generate.request_id, "!")))
    payloads += merged.feed((1, finished_msg(b, LENGTH, usage(9, 8, 2, "w1"))))
    assert merged.finished
    chunks = [ChatCompletionChunk.model_validate(p) for p in payloads]
    assert {c.id for c in chunks} == {"chatcmpl-x"}
    by_index: dict[int, str] = {0: "", 1: ""}
    finish: dict[int, list[str]] = {0: [], 1: []}
    roles = []
    for c in chunks[:-1]:
        (choice,) = c.choices
        by_index[choice.index] += choice.delta.content or ""
        if choice.delta.role:
            roles.append(choice.index)
        if choice.finish_reason:
            finish[choice.index].append(choice.finish_reason)
    assert by_index == {0: "Hel", 1: "Yo!"} and roles == [0, 1]
    assert finish == {0: ["stop"], 1: ["length"]}
    # Each choice's finish chunk names its own request; the usage chunk comes once, at the end.
    ends = [p for p in payloads if "kvmesh" in p]
    assert [e["kvmesh"]["request_id"] for e in ends] == ["chatcmpl-x-0", "chatcmpl-x-1"]
    tail = chunks[-1]
    assert tail.choices == [] and tail.usage is not None
    assert (tail.usage.prompt_tokens, tail.usage.completion_tokens) == (9, 3)
    assert sum(1 for c in chunks if c.usage is not None) == 1


def test_collected_batch_answer():
    parsed = completion(prompt=["a", "b"], n=2)
    subs = plan(parsed)
    merged = Choices(parsed, subs, created=5)
    for sub in reversed(subs):  # any order
        merged.feed((sub.index, text_msg(sub.generate.request_id, f"t{sub.index}")))
        u = usage(4 + sub.prompt, 2 * sub.sample, 1, f"w{sub.prompt}")
        merged.feed((sub.index, finished_msg(sub, STOP, u)))
    body = merged.response()
    got = Completion.model_validate(body)
    assert [(c.index, c.text) for c in got.choices] == [(i, f"t{i}") for i in range(4)]
    assert got.usage is not None
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (9, 4)
    assert got.usage.prompt_tokens_details is not None
    assert got.usage.prompt_tokens_details.cached_tokens == 0  # the first of each prompt
    per_choice = body["kvmesh"]["choices"]
    assert [c["request_id"] for c in per_choice] == [f"cmpl-x-{i}" for i in range(4)]
    assert [c["cached_tokens"] for c in per_choice] == [0, 2, 0, 2]  # the siblings' cache hits
    assert body["kvmesh"]["worker_id"] == "w0,w1"  # in choice order


def test_chat_answer_parses_and_unfinished_raises():
    parsed = chat(n=2)
    subs = plan(parsed)
    merged = Choices(parsed, subs, created=5)
    merged.feed((1, finished_msg(subs[1], STOP, usage(3, 0, 0, "w"))))
    with pytest.raises(RuntimeError):
        merged.response()
    merged.feed((0, text_msg("x", "hi")))
    merged.feed((0, finished_msg(subs[0], STOP, usage(3, 0, 1, "w"))))
    got = ChatCompletion.model_validate(merged.response())
    assert [(c.index, c.message.content) for c in got.choices] == [(0, "hi"), (1, "")]
