"""A request resumed after its worker failed mid-stream, or resumed by the client through
this router after its router failed (``GenerateRequest.resume``; docs/failover.md): what its next
attempt sends, and how that attempt's messages continue the stream the client has. Whether to
resume is ``core/lifecycle.py``'s decision, stop strings across the seam ``core/seam.py``'s;
this converts between them and the messages. Nothing here runs for a request that was never
resumed, and for a resumed one only its first characters pass through the seam.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kvmesh.discovery.keys import WorkerId
from kvmesh.v1 import common_pb2, router_pb2, worker_pb2

from .core.seam import Seam
from .core.types import RouteRequest
from .core.workers import ModelSummary
from .prompt import PromptBuilder, PromptInput

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Replay:
    """A request's output so far, across its resumed attempts."""

    prompt_tokens: int  # the client's prompt
    resumes: int = 0
    tokens: int = 0  # sent by the attempts before the current one
    token_ids: list[int] = field(default_factory=list)  # ... their ids
    text: str = ""  # ... their text
    recomputed: int = 0  # tokens resumed attempts computed again (as far as reported)
    ttft_s: float = 0.0  # the first attempt's time to first token (a client resume: its own)
    seam: Seam | None = None  # stop strings across the last seam; None: none asked
    client_resumes: int = 0  # of these resumes, the client's (through another router)

    @classmethod
    def from_client(cls, prompt_tokens: int, resume: router_pb2.Resume) -> Replay:
        """A request the client resumes after its router failed mid-stream
        (``GenerateRequest.resume``): the output so far is what the client has, and this is
        one more resume."""
        resumes = resume.resumes + 1
        return cls(
            prompt_tokens,
            resumes=resumes,
            tokens=len(resume.token_ids),
            token_ids=list(resume.token_ids),
            text=resume.text,
            ttft_s=resume.time_to_first_token_s,
            client_resumes=resumes,
        )

    def record(self, sent: Sequence[router_pb2.GenerateResponse], resumes: int) -> list[int]:
        """Takes in what the client got from the attempt that failed (one message per chunk),
        the request's ``resumes``-th resume by this router; returns its token ids."""
        ids = [t for out in sent for t in out.token_ids]
        self.token_ids.extend(ids)
        self.text += "".join(out.text for out in sent)
        self.tokens += len(ids)
        self.resumes = self.client_resumes + resumes
        return ids

    def watch_seam(self, stops: tuple[str, ...], pending: str) -> None:
        """Stop strings across the seam: ``pending`` is the held-back text (``held_back``)."""
        tail = self.text[-max(len(s) for s in stops) :]
        self.seam = Seam(stops, tail, pending)

    def go_on(
        self,
        prompt_tokens: int,
        worker_id: WorkerId,
        msg: worker_pb2.WorkerGenerateResponse,
        out: router_pb2.GenerateResponse,
        streamed: int,
    ) -> tuple[bool, int]:
        """A resumed attempt's message ``msg`` as the client's stream (``out``, rewritten): its
        text across the seam (the held-back text first, stop strings that span it) and the
        final usage counted as if uninterrupted. ``prompt_tokens``: the attempt's own prompt;
        ``streamed``: the tokens it sent before ``msg``. Returns (a stop string across the seam
        ended the request: ``out`` is now its final message, the tokens this attempt computed
        again as its final message reports them: 0 before it)."""
        stop = None
        seam = self.seam
        if seam is not None and not seam.done:
            out.text, stop = seam.feed(msg.text, final=msg.HasField("finished"))
            if stop is not None:
                out.finished.CopyFrom(
                    common_pb2.Finished(reason=common_pb2.FINISH_REASON_STOP, stop_reason=stop)
                )
                out.finished.usage.worker_id = worker_id
        if not out.HasField("finished"):
            return False, 0
        u = out.finished.usage
        recomputed = 0
        if stop is None:
            recomputed = max(prompt_tokens - u.cached_prompt_tokens, 0)
            self.recomputed += recomputed
            u.completion_tokens += self.tokens
        else:
            u.completion_tokens = self.tokens + streamed + len(msg.token_ids)
        u.prompt_tokens = self.prompt_tokens
        u.resumes = self.resumes
        u.resume_recomputed_tokens = self.recomputed
        return stop is not None, recomputed


def resumed_sampling(
    sampling: common_pb2.SamplingParams, sent_tokens: int
) -> common_pb2.SamplingParams | None:
    """The next attempt's sampling after ``sent_tokens`` more were sent: the rest of
    ``max_tokens`` and ``min_tokens``, the same seed and everything else, no
    ``prompt_logprobs`` (the client has them). None: nothing is left to generate."""
    left = sampling.max_tokens - sent_tokens
    if left <= 0:
        return None
    resumed = common_pb2.SamplingParams()
    resumed.CopyFrom(sampling)
    resumed.max_tokens = left
    resumed.min_tokens = max(sampling.min_tokens - sent_tokens, 0)
    resumed.ClearField("prompt_logprobs")
    return resumed


async def resumed_route(
    prompts: PromptBuilder, model: ModelSummary, route: RouteRequest, sent: Sequence[int]
) -> RouteRequest:
    """The next attempt's request: the prompt plus the tokens ``sent``, hashed (the session's
    chain reused), to route as any request."""
    prompt_ids = [*route.prompt_token_ids, *sent]
    prompt = await prompts.build(
        model.name,
        model.model_path,
        model.block_size,
        route.session_id,
        PromptInput(token_ids=prompt_ids),
        lambda _ids: None,  # the same length the request was admitted with
        route.cache_salt,
    )
    return replace(
        route,
        prompt_token_ids=tuple(prompt_ids),
        prompt_tokens=len(prompt_ids),
        block_hashes=prompt.hashed.hashes,
    )


async def held_back(
    prompts: PromptBuilder, model: ModelSummary, replay: Replay, request_id: str
) -> str:
    """The text of tokens the client has whose text it does not: vLLM holds back the end of
    its output while it could be the start of a stop string. The tokens' full text less what
    was sent; "" when that cannot be told (no tokenizer: the seam then checks only the text
    sent)."""
    try:
        full = await prompts.decode(model.name, model.model_path, replay.token_ids)
    except Exception as exc:  # a tokenizer trouble costs only the held-back text
        log.warning("request %s: cannot decode its output to resume it: %s", request_id, exc)
        return ""
    full = full.rstrip("\ufffd")  # an unfinished character: the next worker sends it whole
    if not full.startswith(replay.text):
        log.info("request %s: its output text is not its tokens' decoding", request_id)
        return ""
    return full[len(replay.text) :]
