"""Log probabilities and echo at the OpenAI front door, pure: request fields -> SamplingParams
(and the 400s vLLM's server gives, naming the parameter), router TokenLogprob entries -> the
OpenAI chat and completions shapes, streamed chunk by chunk and whole."""

from __future__ import annotations

from typing import Any

import pytest

from kvmesh import errors
from kvmesh.v1 import common_pb2, router_pb2
from services.router.http import parsing, rendering
from services.router.http.errors import BadRequest, error_body
from services.router.http.extensions import Extensions
from services.router.http.parsing import Kind

EXT = Extensions()
USER = [{"role": "user", "content": "hi"}]


def parse(kind: Kind, **body: Any) -> parsing.ParsedRequest:
    if kind is Kind.CHAT:
        return parsing.parse_chat({"messages": USER, **body}, EXT, "rid", 16)
    return parsing.parse_completion({"prompt": "x", **body}, EXT, "rid", 16)


def fields(s: common_pb2.SamplingParams) -> tuple[int | None, int | None]:
    return (
        s.logprobs if s.HasField("logprobs") else None,
        s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
    )


# ---- requests --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "body", "want"),
    [
        pytest.param(Kind.CHAT, {}, (None, None), id="chat-none"),
        pytest.param(Kind.CHAT, {"logprobs": False}, (None, None), id="chat-false"),
        pytest.param(Kind.CHAT, {"logprobs": False, "top_logprobs": 0}, (None, None), id="top0"),
        pytest.param(Kind.CHAT, {"logprobs": True}, (0, None), id="chat-own-only"),
        pytest.param(Kind.CHAT, {"logprobs": True, "top_logprobs": 3}, (3, None), id="chat-top3"),
        pytest.param(Kind.CHAT, {"prompt_logprobs": 2}, (None, 2), id="chat-prompt-ext"),
        pytest.param(Kind.COMPLETION, {}, (None, None), id="cmpl-none"),
        pytest.param(Kind.COMPLETION, {"logprobs": 0}, (0, None), id="cmpl-0"),
        pytest.param(Kind.COMPLETION, {"logprobs": 5}, (5, None), id="cmpl-5"),
        pytest.param(Kind.COMPLETION, {"logprobs": 12}, (12, None), id="cmpl-past-legacy-5"),
        pytest.param(Kind.COMPLETION, {"echo": True}, (None, None), id="echo-text-prompt"),
        pytest.param(Kind.COMPLETION, {"echo": True, "logprobs": 2}, (2, 2), id="echo-logprobs"),
        pytest.param(
            Kind.COMPLETION,
            {"echo": True, "logprobs": 2, "prompt_logprobs": 1},
            (2, 1),
            id="explicit-prompt-logprobs-win",
        ),
        pytest.param(
            Kind.COMPLETION, {"echo": True, "prompt": [5, 6, 7]}, (None, 0), id="echo-token-ids"
        ),
        pytest.param(
            Kind.COMPLETION,
            {"prompt_logprobs": 0, "stream": True},
            (None, None),
            id="prompt0-stream-nothing",
        ),
    ],
)
def test_requests_set_sampling(kind: Kind, body: dict[str, Any], want: tuple[Any, Any]):
    assert fields(parse(kind, **body).generate.sampling) == want


@pytest.mark.parametrize(
    ("kind", "body", "param", "says"),
    [
        pytest.param(Kind.CHAT, {"top_logprobs": 2}, "top_logprobs", "logprobs set", id="no-lp"),
        pytest.param(
            Kind.CHAT,
            {"logprobs": False, "top_logprobs": 2},
            "top_logprobs",
            "logprobs set to true",
            id="lp-false",
        ),
        pytest.param(
            Kind.CHAT, {"logprobs": True, "top_logprobs": -1}, "top_logprobs", ">= 0", id="neg"
        ),
        pytest.param(
            Kind.CHAT,
            {"logprobs": True, "top_logprobs": "3"},
            "top_logprobs",
            "integer",
            id="str",
        ),
        pytest.param(Kind.CHAT, {"logprobs": "yes"}, "logprobs", "true or false", id="lp-str"),
        pytest.param(Kind.COMPLETION, {"logprobs": True}, "logprobs", "integer", id="cmpl-bool"),
        pytest.param(Kind.COMPLETION, {"logprobs": -2}, "logprobs", ">= 0", id="cmpl-neg"),
        pytest.param(Kind.COMPLETION, {"logprobs": 2**40}, "logprobs", "too large", id="huge"),
        pytest.param(Kind.COMPLETION, {"echo": "yes"}, "echo", "true or false", id="echo-str"),
        pytest.param(
            Kind.COMPLETION,
            {"prompt_logprobs": 1, "stream": True},
            "prompt_logprobs",
            "stream",
            id="prompt-stream",
        ),
        pytest.param(
            Kind.CHAT, {"prompt_logprobs": -1}, "prompt_logprobs", ">= 0", id="prompt-neg"
        ),
        pytest.param(Kind.CHAT, {"echo": True}, "echo", "chat", id="chat-echo"),
        pytest.param(
            Kind.COMPLETION,
            {"logprobs": 1, "logprob_token_ids": [3]},
            "logprob_token_ids",
            "not supported",
            id="logprob-token-ids",
        ),
        pytest.param(
            Kind.CHAT,
            {"return_tokens_as_token_ids": True},
            "return_tokens_as_token_ids",
            "not supported",
            id="as-token-ids",
        ),
    ],
)
def test_bad_values_are_400_naming_the_param(
    kind: Kind, body: dict[str, Any], param: str, says: str
):
    with pytest.raises(BadRequest) as bad:
        parse(kind, **body)
    assert bad.value.param == param
    assert says in str(bad.value)
    status, shape = error_body(bad.value)
    assert (status, shape["error"]["param"]) == (400, param)


@pytest.mark.parametrize(
    ("kind", "body", "field", "param"),
    [
        pytest.param(Kind.CHAT, {"logprobs": True}, "sampling.logprobs", "top_logprobs", id="c"),
        pytest.param(Kind.COMPLETION, {"logprobs": 9}, "sampling.logprobs", "logprobs", id="p"),
        pytest.param(
            Kind.COMPLETION,
            {"logprobs": 9, "echo": True},
            "sampling.prompt_logprobs",
            "logprobs",
            id="echo",
        ),
        pytest.param(
            Kind.COMPLETION,
            {"prompt_logprobs": 30},
            "sampling.prompt_logprobs",
            "prompt_logprobs",
            id="ext",
        ),
    ],
)
def test_worker_bounds_name_the_openai_param(
    kind: Kind, body: dict[str, Any], field: str, param: str
):
    """The worker bounds them by its engine's max_logprobs; its error names the field."""
    exc = parsing.router_error(errors.InvalidArgument("too many", field), parse(kind, **body))
    assert isinstance(exc, BadRequest) and exc.param == param


# ---- responses -------------------------------------------------------------------------------
def entry(
    token_id: int, token: str, logprob: float | None, rank: int, top: list[tuple[int, str, float]]
) -> common_pb2.TokenLogprob:
    e = common_pb2.TokenLogprob(
        token_id=token_id,
        token=token,
        rank=rank,
        top=[common_pb2.TopLogprob(token_id=i, token=t, logprob=lp) for i, t, lp in top],
    )
    if logprob is not None:
        e.logprob = logprob
    return e


A = entry(7, "He", -0.5, 1, [(7, "He", -0.5), (8, "Ha", -1.5)])
B = entry(9, "llo", -2.0, 3, [(10, "y", -0.25), (11, "é", float("-inf"))])
PROMPT = [entry(1, "<s>", None, 0, []), entry(2, " x", -3.0, 2, [(3, " y", -1.0), (2, " x", -3.0)])]


def stream_of(
    *parts: tuple[str, list[common_pb2.TokenLogprob]],
    prompt: list[common_pb2.TokenLogprob] | None = None,
) -> list[router_pb2.GenerateResponse]:
    msgs = []
    for i, (text, lps) in enumerate(parts):
        m = router_pb2.GenerateResponse(
            request_id="rid", text=text, token_ids=[e.token_id for e in lps], logprobs=lps
        )
        if i == 0 and prompt:
            m.prompt_logprobs.extend(prompt)
        msgs.append(m)
    last = router_pb2.GenerateResponse(request_id="rid")
    last.finished.reason = common_pb2.FINISH_REASON_LENGTH
    last.finished.usage.CopyFrom(common_pb2.Usage(prompt_tokens=2, completion_tokens=2))
    return [*msgs, last]


def run(request: parsing.ParsedRequest, msgs: list[router_pb2.GenerateResponse]):
    tr = rendering.ResponseTranslator(request, created=1)
    payloads = [p for m in msgs for p in tr.feed(m)]
    return payloads, tr.response()


def test_chat_logprobs_streamed_and_whole():
    req = parse(Kind.CHAT, logprobs=True, top_logprobs=2, stream=True)
    payloads, whole = run(req, stream_of(("He", [A]), ("llo", [B])))
    per_chunk = [p["choices"][0]["logprobs"] for p in payloads if p["choices"]]
    assert per_chunk[0] is None  # the role chunk
    assert per_chunk[-1] is None  # the finish chunk
    content = [e for lp in per_chunk if lp for e in lp["content"]]
    assert content == [
        {
            "token": "He",
            "logprob": -0.5,
            "bytes": [72, 101],
            "top_logprobs": [
                {"token": "He", "logprob": -0.5, "bytes": [72, 101]},
                {"token": "Ha", "logprob": -1.5, "bytes": [72, 97]},
            ],
        },
        {
            "token": "llo",
            "logprob": -2.0,
            "bytes": [108, 108, 111],
            "top_logprobs": [
                {"token": "y", "logprob": -0.25, "bytes": [121]},
                {"token": "é", "logprob": -9999.0, "bytes": [195, 169]},  # -inf as OpenAI sends
            ],
        },
    ]
    assert whole["choices"][0]["logprobs"] == {"content": content}
    assert "prompt_logprobs" not in whole


def test_chat_logprobs_of_a_token_without_text_get_a_chunk_of_their_own():
    """A token whose text is held back (part of a multi-byte character) still streams its
    logprob, in an empty delta, as vLLM does."""
    req = parse(Kind.CHAT, logprobs=True, stream=True)
    payloads, _ = run(req, stream_of(("", [A])))
    (chunk,) = [p for p in payloads if p["choices"] and p["choices"][0]["logprobs"]]
    assert chunk["choices"][0]["delta"] == {}
    assert chunk["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []


def test_chat_without_logprobs_shows_none():
    payloads, whole = run(parse(Kind.CHAT), stream_of(("He", [])))
    assert all(p["choices"][0]["logprobs"] is None for p in payloads if p["choices"])
    assert whole["choices"][0]["logprobs"] is None


def test_completion_logprobs_offsets_run_across_chunks():
    req = parse(Kind.COMPLETION, logprobs=1, stream=True)
    payloads, whole = run(req, stream_of(("He", [A]), ("llo", [B])))
    chunks = [p["choices"][0]["logprobs"] for p in payloads if p["choices"][0]["logprobs"]]
    assert chunks == [
        {
            "tokens": ["He"],
            "token_logprobs": [-0.5],
            "top_logprobs": [{"He": -0.5}],
            "text_offset": [0],
        },
        {
            "tokens": ["llo"],
            "token_logprobs": [-2.0],
            "top_logprobs": [{"llo": -2.0, "y": -0.25}],  # the token and the 1 most likely
            "text_offset": [2],
        },
    ]
    assert whole["choices"][0]["logprobs"] == {
        "tokens": ["He", "llo"],
        "token_logprobs": [-0.5, -2.0],
        "top_logprobs": [{"He": -0.5}, {"llo": -2.0, "y": -0.25}],
        "text_offset": [0, 2],
    }
    assert whole["choices"][0]["text"] == "Hello"


def test_echo_of_a_text_prompt_without_logprobs():
    req = parse(Kind.COMPLETION, prompt="Say:", echo=True, stream=True)
    payloads, whole = run(req, stream_of(("He", []), ("llo", [])))
    assert [p["choices"][0]["text"] for p in payloads][:2] == ["Say:He", "llo"]
    assert whole["choices"][0]["text"] == "Say:Hello"
    assert whole["choices"][0]["logprobs"] is None
    assert "prompt_logprobs" not in whole["choices"][0]


def test_echo_with_logprobs_puts_the_prompt_tokens_first():
    req = parse(Kind.COMPLETION, prompt=[1, 2], echo=True, logprobs=1)
    assert fields(req.generate.sampling) == (1, 1)
    _, whole = run(req, stream_of(("He", [A]), ("llo", [B]), prompt=PROMPT))
    choice = whole["choices"][0]
    assert choice["text"] == "<s> xHello"  # a token-id prompt: its tokens' strings
    assert choice["logprobs"] == {
        "tokens": ["<s>", " x", "He", "llo"],
        "token_logprobs": [None, -3.0, -0.5, -2.0],
        "top_logprobs": [None, {" x": -3.0, " y": -1.0}, {"He": -0.5}, {"llo": -2.0, "y": -0.25}],
        "text_offset": [0, 3, 5, 7],
    }
    # vLLM's prompt_logprobs beside it: id -> {logprob, rank, decoded_token}, the prompt's first.
    assert choice["prompt_logprobs"] == [
        None,
        {
            "2": {"logprob": -3.0, "rank": 2, "decoded_token": " x"},
            "3": {"logprob": -1.0, "rank": 1, "decoded_token": " y"},
        },
    ]


def test_echo_streamed_equals_whole():
    msgs = stream_of(("He", [A]), ("llo", [B]), prompt=PROMPT)
    streamed, _ = run(parse(Kind.COMPLETION, prompt="ab", echo=True, logprobs=1, stream=True), msgs)
    _, whole = run(parse(Kind.COMPLETION, prompt="ab", echo=True, logprobs=1), msgs)
    assert "".join(p["choices"][0]["text"] for p in streamed) == whole["choices"][0]["text"]
    assert whole["choices"][0]["text"] == "abHello"  # a text prompt: as sent
    got = [p["choices"][0]["logprobs"] for p in streamed if p["choices"][0]["logprobs"]]
    assert [t for lp in got for t in lp["tokens"]] == whole["choices"][0]["logprobs"]["tokens"]
    assert [o for lp in got for o in lp["text_offset"]] == [0, 3, 5, 7]


def test_chat_prompt_logprobs_extension_sits_on_the_answer():
    req = parse(Kind.CHAT, prompt_logprobs=1)
    _, whole = run(req, stream_of(("He", []), prompt=PROMPT))
    assert whole["prompt_logprobs"][0] is None and "2" in whole["prompt_logprobs"][1]
    assert whole["choices"][0]["logprobs"] is None
