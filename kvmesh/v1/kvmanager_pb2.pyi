from kvmesh.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefetchSessionRequest(_message.Message):
    __slots__ = ("session_id", "tenant")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class PrefetchSessionResponse(_message.Message):
    __slots__ = ("retained_blocks", "in_cpu_blocks", "promoted_blocks", "on_disk_blocks", "missing_blocks")
    RETAINED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    IN_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ON_DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MISSING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    retained_blocks: int
    in_cpu_blocks: int
    promoted_blocks: int
    on_disk_blocks: int
    missing_blocks: int
    def __init__(self, retained_blocks: _Optional[int] = ..., in_cpu_blocks: _Optional[int] = ..., promoted_blocks: _Optional[int] = ..., on_disk_blocks: _Optional[int] = ..., missing_blocks: _Optional[int] = ...) -> None: ...

class RetainSessionRequest(_message.Message):
    __slots__ = ("layout_key", "session_id", "tenant", "block_hashes", "ttl_s")
    LAYOUT_KEY_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    layout_key: str
    session_id: str
    tenant: str
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    ttl_s: float
    def __init__(self, layout_key: _Optional[str] = ..., session_id: _Optional[str] = ..., tenant: _Optional[str] = ..., block_hashes: _Optional[_Iterable[int]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class RetainSessionResponse(_message.Message):
    __slots__ = ("retained_blocks", "held_blocks", "renewed", "previous_blocks", "previous_held_blocks", "released_sessions", "truncated")
    RETAINED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RENEWED_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    retained_blocks: int
    held_blocks: int
    renewed: bool
    previous_blocks: int
    previous_held_blocks: int
    released_sessions: int
    truncated: bool
    def __init__(self, retained_blocks: _Optional[int] = ..., held_blocks: _Optional[int] = ..., renewed: bool = ..., previous_blocks: _Optional[int] = ..., previous_held_blocks: _Optional[int] = ..., released_sessions: _Optional[int] = ..., truncated: bool = ...) -> None: ...

class ReleaseSessionRequest(_message.Message):
    __slots__ = ("session_id", "tenant")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class ReleaseSessionResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: bool = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("model", "block_size", "num_layers", "num_kv_heads", "head_size", "dtype", "tp_rank", "tp_size", "device")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    model: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    tp_rank: int
    tp_size: int
    device: str
    def __init__(self, model: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., dtype: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., device: _Optional[str] = ...) -> None: ...

class KvManagerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierUsage(_message.Message):
    __slots__ = ("tier", "capacity_bytes", "used_bytes", "blocks")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tier: _worker_pb2.KvTier
    capacity_bytes: int
    used_bytes: int
    blocks: int
    def __init__(self, tier: _Optional[_Union[_worker_pb2.KvTier, str]] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ...) -> None: ...

class KvManagerInfo(_message.Message):
    __slots__ = ("kvmanager_id", "node", "tiers", "data_plane_address", "epoch", "version")
    KVMANAGER_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    kvmanager_id: str
    node: str
    tiers: _containers.RepeatedCompositeFieldContainer[TierUsage]
    data_plane_address: str
    epoch: str
    version: str
    def __init__(self, kvmanager_id: _Optional[str] = ..., node: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TierUsage, _Mapping]]] = ..., data_plane_address: _Optional[str] = ..., epoch: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("layout", "block_hashes")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    layout: KvLayout
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layout: _Optional[_Union[KvLayout, _Mapping]] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("tiers",)
    TIERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedScalarFieldContainer[_worker_pb2.KvTier]
    def __init__(self, tiers: _Optional[_Iterable[_Union[_worker_pb2.KvTier, str]]] = ...) -> None: ...

class KvBlock(_message.Message):
    __slots__ = ("block_hash", "parent_hash", "data", "shm")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    block_hash: int
    parent_hash: int
    data: bytes
    shm: ShmRegion
    def __init__(self, block_hash: _Optional[int] = ..., parent_hash: _Optional[int] = ..., data: _Optional[bytes] = ..., shm: _Optional[_Union[ShmRegion, _Mapping]] = ...) -> None: ...

class ShmRegion(_message.Message):
    __slots__ = ("shm_id", "offset", "length")
    SHM_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    shm_id: int
    offset: int
    length: int
    def __init__(self, shm_id: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class AttachShmRequest(_message.Message):
    __slots__ = ("name", "size_bytes", "token")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    size_bytes: int
    token: bytes
    def __init__(self, name: _Optional[str] = ..., size_bytes: _Optional[int] = ..., token: _Optional[bytes] = ...) -> None: ...

class AttachShmResponse(_message.Message):
    __slots__ = ("shm_id",)
    SHM_ID_FIELD_NUMBER: _ClassVar[int]
    shm_id: int
    def __init__(self, shm_id: _Optional[int] = ...) -> None: ...

class DetachShmRequest(_message.Message):
    __slots__ = ("shm_id",)
    SHM_ID_FIELD_NUMBER: _ClassVar[int]
    shm_id: int
    def __init__(self, shm_id: _Optional[int] = ...) -> None: ...

class DetachShmResponse(_message.Message):
    __slots__ = ("detached",)
    DETACHED_FIELD_NUMBER: _ClassVar[int]
    detached: bool
    def __init__(self, detached: bool = ...) -> None: ...

class PutBlocksRequest(_message.Message):
    __slots__ = ("layout", "blocks")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    layout: KvLayout
    blocks: _containers.RepeatedCompositeFieldContainer[KvBlock]
    def __init__(self, layout: _Optional[_Union[KvLayout, _Mapping]] = ..., blocks: _Optional[_Iterable[_Union[KvBlock, _Mapping]]] = ...) -> None: ...

class PutBlocksResponse(_message.Message):
    __slots__ = ("stored", "already_held")
    STORED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_HELD_FIELD_NUMBER: _ClassVar[int]
    stored: int
    already_held: int
    def __init__(self, stored: _Optional[int] = ..., already_held: _Optional[int] = ...) -> None: ...

class GetBlocksRequest(_message.Message):
    __slots__ = ("layout", "block_hashes", "shm")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    layout: KvLayout
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    shm: ShmRegion
    def __init__(self, layout: _Optional[_Union[KvLayout, _Mapping]] = ..., block_hashes: _Optional[_Iterable[int]] = ..., shm: _Optional[_Union[ShmRegion, _Mapping]] = ...) -> None: ...

class GetBlocksResponse(_message.Message):
    __slots__ = ("block", "tier", "missing", "blocks", "tiers")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    block: KvBlock
    tier: _worker_pb2.KvTier
    missing: int
    blocks: _containers.RepeatedCompositeFieldContainer[KvBlock]
    tiers: _containers.RepeatedScalarFieldContainer[_worker_pb2.KvTier]
    def __init__(self, block: _Optional[_Union[KvBlock, _Mapping]] = ..., tier: _Optional[_Union[_worker_pb2.KvTier, str]] = ..., missing: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[KvBlock, _Mapping]]] = ..., tiers: _Optional[_Iterable[_Union[_worker_pb2.KvTier, str]]] = ...) -> None: ...

class KvManagerWatchKvEventsRequest(_message.Message):
    __slots__ = ("layout", "layout_key", "epoch", "from_seq")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_KEY_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    layout: KvLayout
    layout_key: str
    epoch: str
    from_seq: int
    def __init__(self, layout: _Optional[_Union[KvLayout, _Mapping]] = ..., layout_key: _Optional[str] = ..., epoch: _Optional[str] = ..., from_seq: _Optional[int] = ...) -> None: ...

class OpenFetchRequest(_message.Message):
    __slots__ = ("layout", "layout_key", "block_hashes", "ttl_s")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_KEY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    layout: KvLayout
    layout_key: str
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    ttl_s: float
    def __init__(self, layout: _Optional[_Union[KvLayout, _Mapping]] = ..., layout_key: _Optional[str] = ..., block_hashes: _Optional[_Iterable[int]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class OpenFetchResponse(_message.Message):
    __slots__ = ("data_plane_address", "token", "block_hashes", "parent_hash", "layout_key", "ttl_s", "data_plane_tls", "data_plane_auth_only")
    DATA_PLANE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_KEY_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_TLS_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_AUTH_ONLY_FIELD_NUMBER: _ClassVar[int]
    data_plane_address: str
    token: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_hash: int
    layout_key: str
    ttl_s: float
    data_plane_tls: bool
    data_plane_auth_only: bool
    def __init__(self, data_plane_address: _Optional[str] = ..., token: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[int]] = ..., parent_hash: _Optional[int] = ..., layout_key: _Optional[str] = ..., ttl_s: _Optional[float] = ..., data_plane_tls: bool = ..., data_plane_auth_only: bool = ...) -> None: ...

class FetchFromPeerRequest(_message.Message):
    __slots__ = ("layout", "block_hashes", "peer_kvmanager_id", "peer_address")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PEER_KVMANAGER_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    layout: KvLayout
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    peer_kvmanager_id: str
    peer_address: str
    def __init__(self, layout: _Optional[_Union[KvLayout, _Mapping]] = ..., block_hashes: _Optional[_Iterable[int]] = ..., peer_kvmanager_id: _Optional[str] = ..., peer_address: _Optional[str] = ...) -> None: ...

class FetchFromPeerResponse(_message.Message):
    __slots__ = ("fetched", "already_held", "bytes", "seconds", "peer_missing", "prefix_blocks")
    FETCHED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_HELD_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    PEER_MISSING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    fetched: int
    already_held: int
    bytes: int
    seconds: float
    peer_missing: int
    prefix_blocks: int
    def __init__(self, fetched: _Optional[int] = ..., already_held: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., peer_missing: _Optional[int] = ..., prefix_blocks: _Optional[int] = ...) -> None: ...
