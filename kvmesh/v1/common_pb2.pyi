from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_BOTH: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_BOTH: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "structured_output", "logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    structured_output: StructuredOutput
    logprobs: int
    prompt_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: bool = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "cached_prompt_tokens", "completion_tokens", "worker_id", "time_to_first_token_s", "cached_gpu_tokens", "cached_cpu_tokens", "cached_disk_tokens", "cached_peer_tokens", "queue_time_s", "prefill_time_s", "decode_time_s", "resumes", "resume_recomputed_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    CACHED_GPU_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_CPU_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_DISK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PEER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    RESUMES_FIELD_NUMBER: _ClassVar[int]
    RESUME_RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    worker_id: str
    time_to_first_token_s: float
    cached_gpu_tokens: int
    cached_cpu_tokens: int
    cached_disk_tokens: int
    cached_peer_tokens: int
    queue_time_s: float
    prefill_time_s: float
    decode_time_s: float
    resumes: int
    resume_recomputed_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., worker_id: _Optional[str] = ..., time_to_first_token_s: _Optional[float] = ..., cached_gpu_tokens: _Optional[int] = ..., cached_cpu_tokens: _Optional[int] = ..., cached_disk_tokens: _Optional[int] = ..., cached_peer_tokens: _Optional[int] = ..., queue_time_s: _Optional[float] = ..., prefill_time_s: _Optional[float] = ..., decode_time_s: _Optional[float] = ..., resumes: _Optional[int] = ..., resume_recomputed_tokens: _Optional[int] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("reason", "stop_reason", "usage")
    REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    reason: FinishReason
    stop_reason: str
    usage: Usage
    def __init__(self, reason: _Optional[_Union[FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: StructuredOutputChoice
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: bool = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[StructuredOutputChoice, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class StructuredOutputChoice(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token", "rank", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: str
    rank: int
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[str] = ..., rank: _Optional[int] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[str] = ...) -> None: ...
