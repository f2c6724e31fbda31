from kvmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TIER_UNSPECIFIED: _ClassVar[KvTier]
    KV_TIER_GPU: _ClassVar[KvTier]
    KV_TIER_CPU: _ClassVar[KvTier]
    KV_TIER_DISK: _ClassVar[KvTier]
KV_TIER_UNSPECIFIED: KvTier
KV_TIER_GPU: KvTier
KV_TIER_CPU: KvTier
KV_TIER_DISK: KvTier

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "kv_source", "cache_salt", "priority", "data_parallel_rank", "store_prefix_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    STORE_PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    kv_source: KvSource
    cache_salt: str
    priority: int
    data_parallel_rank: int
    store_prefix_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., kv_source: _Optional[_Union[KvSource, _Mapping]] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., data_parallel_rank: _Optional[int] = ..., store_prefix_blocks: _Optional[int] = ...) -> None: ...

class KvSource(_message.Message):
    __slots__ = ("kvmanager_id", "blocks", "handoff_wait_s", "max_fetch_s")
    KVMANAGER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_FETCH_S_FIELD_NUMBER: _ClassVar[int]
    kvmanager_id: str
    blocks: int
    handoff_wait_s: float
    max_fetch_s: float
    def __init__(self, kvmanager_id: _Optional[str] = ..., blocks: _Optional[int] = ..., handoff_wait_s: _Optional[float] = ..., max_fetch_s: _Optional[float] = ...) -> None: ...

class WorkerGenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finished", "logprobs", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finished: _common_pb2.Finished
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finished: _Optional[_Union[_common_pb2.Finished, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class WorkerStreamIn(_message.Message):
    __slots__ = ("call", "generate", "abort", "timeout_s", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CALL_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    call: int
    generate: WorkerGenerateRequest
    abort: bool
    timeout_s: float
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, call: _Optional[int] = ..., generate: _Optional[_Union[WorkerGenerateRequest, _Mapping]] = ..., abort: bool = ..., timeout_s: _Optional[float] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class WorkerStreamOut(_message.Message):
    __slots__ = ("outputs", "output_calls", "ends")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_CALLS_FIELD_NUMBER: _ClassVar[int]
    ENDS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[WorkerGenerateResponse]
    output_calls: _containers.RepeatedScalarFieldContainer[int]
    ends: _containers.RepeatedCompositeFieldContainer[WorkerStreamEnd]
    def __init__(self, outputs: _Optional[_Iterable[_Union[WorkerGenerateResponse, _Mapping]]] = ..., output_calls: _Optional[_Iterable[int]] = ..., ends: _Optional[_Iterable[_Union[WorkerStreamEnd, _Mapping]]] = ...) -> None: ...

class WorkerStreamEnd(_message.Message):
    __slots__ = ("call", "code", "message", "field")
    CALL_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    call: int
    code: int
    message: str
    field: str
    def __init__(self, call: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., field: _Optional[str] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchLoadRequest(_message.Message):
    __slots__ = ("min_interval_s", "data_parallel_rank")
    MIN_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    min_interval_s: float
    data_parallel_rank: int
    def __init__(self, min_interval_s: _Optional[float] = ..., data_parallel_rank: _Optional[int] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("worker_id", "running_requests", "waiting_requests", "kv_cache_usage", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "in_flight_requests", "prefill_computed_tokens", "prefill_seconds", "generation_tokens", "spec_drafts", "spec_draft_tokens", "spec_accepted_tokens", "spec_accepted_tokens_per_position", "decode_tokens", "decode_seconds")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    running_requests: int
    waiting_requests: int
    kv_cache_usage: float
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    in_flight_requests: int
    prefill_computed_tokens: int
    prefill_seconds: float
    generation_tokens: int
    spec_drafts: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_accepted_tokens_per_position: _containers.RepeatedScalarFieldContainer[int]
    decode_tokens: int
    decode_seconds: float
    def __init__(self, worker_id: _Optional[str] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., prefix_cache_queried_tokens: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., in_flight_requests: _Optional[int] = ..., prefill_computed_tokens: _Optional[int] = ..., prefill_seconds: _Optional[float] = ..., generation_tokens: _Optional[int] = ..., spec_drafts: _Optional[int] = ..., spec_draft_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., spec_accepted_tokens_per_position: _Optional[_Iterable[int]] = ..., decode_tokens: _Optional[int] = ..., decode_seconds: _Optional[float] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "model", "max_model_len", "block_size", "vocab_size", "role", "data_parallel_size")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    max_model_len: int
    block_size: int
    vocab_size: int
    role: _common_pb2.WorkerRole
    data_parallel_size: int
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., data_parallel_size: _Optional[int] = ...) -> None: ...

class WatchKvEventsRequest(_message.Message):
    __slots__ = ("epoch", "from_seq", "data_parallel_rank")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    from_seq: int
    data_parallel_rank: int
    def __init__(self, epoch: _Optional[str] = ..., from_seq: _Optional[int] = ..., data_parallel_rank: _Optional[int] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_hash", "tier", "block_size")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_hash: int
    tier: KvTier
    block_size: int
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., parent_hash: _Optional[int] = ..., tier: _Optional[_Union[KvTier, str]] = ..., block_size: _Optional[int] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "tier")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    tier: KvTier
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., tier: _Optional[_Union[KvTier, str]] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ("tier",)
    TIER_FIELD_NUMBER: _ClassVar[int]
    tier: KvTier
    def __init__(self, tier: _Optional[_Union[KvTier, str]] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlockStored
    removed: BlockRemoved
    cleared: AllBlocksCleared
    def __init__(self, stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("worker_id", "epoch", "seq", "events", "snapshot")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: str
    seq: int
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    snapshot: bool
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[str] = ..., seq: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ..., snapshot: bool = ...) -> None: ...
