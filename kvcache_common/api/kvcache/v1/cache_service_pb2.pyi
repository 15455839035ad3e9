from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LayerKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LAYER_KIND_UNSPECIFIED: _ClassVar[LayerKind]
    LAYER_KIND_FULL_ATTENTION: _ClassVar[LayerKind]
    LAYER_KIND_SLIDING_WINDOW: _ClassVar[LayerKind]
    LAYER_KIND_CHUNKED_LOCAL_ATTENTION: _ClassVar[LayerKind]
    LAYER_KIND_MAMBA: _ClassVar[LayerKind]
    LAYER_KIND_CROSS_ATTENTION: _ClassVar[LayerKind]
    LAYER_KIND_RSWA: _ClassVar[LayerKind]
    LAYER_KIND_CIRCULAR_BUFFER: _ClassVar[LayerKind]

class MambaCacheMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MAMBA_CACHE_MODE_UNSPECIFIED: _ClassVar[MambaCacheMode]
    MAMBA_CACHE_MODE_NONE: _ClassVar[MambaCacheMode]
    MAMBA_CACHE_MODE_ALIGN: _ClassVar[MambaCacheMode]

class HashAlgo(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HASH_ALGO_UNSPECIFIED: _ClassVar[HashAlgo]
    HASH_ALGO_SHA256: _ClassVar[HashAlgo]
    HASH_ALGO_SHA256_CBOR: _ClassVar[HashAlgo]

class MissReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MISS_REASON_UNSPECIFIED: _ClassVar[MissReason]
    MISS_REASON_NONE: _ClassVar[MissReason]
    MISS_REASON_NEVER_CACHED: _ClassVar[MissReason]
    MISS_REASON_EVICTED: _ClassVar[MissReason]
    MISS_REASON_DIFFERENT_SALT_OR_LORA: _ClassVar[MissReason]
    MISS_REASON_CUT_TO_ALIGNMENT: _ClassVar[MissReason]
    MISS_REASON_OUTSIDE_SLIDING_WINDOW: _ClassVar[MissReason]
    MISS_REASON_NO_MAMBA_CHECKPOINT: _ClassVar[MissReason]
    MISS_REASON_HASH_RECIPE_MISMATCH: _ClassVar[MissReason]
LAYER_KIND_UNSPECIFIED: LayerKind
LAYER_KIND_FULL_ATTENTION: LayerKind
LAYER_KIND_SLIDING_WINDOW: LayerKind
LAYER_KIND_CHUNKED_LOCAL_ATTENTION: LayerKind
LAYER_KIND_MAMBA: LayerKind
LAYER_KIND_CROSS_ATTENTION: LayerKind
LAYER_KIND_RSWA: LayerKind
LAYER_KIND_CIRCULAR_BUFFER: LayerKind
MAMBA_CACHE_MODE_UNSPECIFIED: MambaCacheMode
MAMBA_CACHE_MODE_NONE: MambaCacheMode
MAMBA_CACHE_MODE_ALIGN: MambaCacheMode
HASH_ALGO_UNSPECIFIED: HashAlgo
HASH_ALGO_SHA256: HashAlgo
HASH_ALGO_SHA256_CBOR: HashAlgo
MISS_REASON_UNSPECIFIED: MissReason
MISS_REASON_NONE: MissReason
MISS_REASON_NEVER_CACHED: MissReason
MISS_REASON_EVICTED: MissReason
MISS_REASON_DIFFERENT_SALT_OR_LORA: MissReason
MISS_REASON_CUT_TO_ALIGNMENT: MissReason
MISS_REASON_OUTSIDE_SLIDING_WINDOW: MissReason
MISS_REASON_NO_MAMBA_CHECKPOINT: MissReason
MISS_REASON_HASH_RECIPE_MISMATCH: MissReason

class MambaState(_message.Message):
    __slots__ = ("shape", "dtype")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class LayerSpec(_message.Message):
    __slots__ = ("name", "kind", "block_size", "num_kv_heads", "head_size", "head_size_v", "dtype", "sliding_window", "attention_chunk_size", "mamba_states", "mamba_cache_mode", "mamba_type", "page_size_padded", "rswa_window")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_V_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAMBA_STATES_FIELD_NUMBER: _ClassVar[int]
    MAMBA_CACHE_MODE_FIELD_NUMBER: _ClassVar[int]
    MAMBA_TYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_PADDED_FIELD_NUMBER: _ClassVar[int]
    RSWA_WINDOW_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: LayerKind
    block_size: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    dtype: str
    sliding_window: int
    attention_chunk_size: int
    mamba_states: _containers.RepeatedCompositeFieldContainer[MambaState]
    mamba_cache_mode: MambaCacheMode
    mamba_type: str
    page_size_padded: int
    rswa_window: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[LayerKind, str]] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., head_size_v: _Optional[int] = ..., dtype: _Optional[str] = ..., sliding_window: _Optional[int] = ..., attention_chunk_size: _Optional[int] = ..., mamba_states: _Optional[_Iterable[_Union[MambaState, _Mapping]]] = ..., mamba_cache_mode: _Optional[_Union[MambaCacheMode, str]] = ..., mamba_type: _Optional[str] = ..., page_size_padded: _Optional[int] = ..., rswa_window: _Optional[int] = ...) -> None: ...

class PoolOptions(_message.Message):
    __slots__ = ("max_model_len", "enable_caching", "hash_algo", "scheduler_block_size", "hash_block_size", "watermark", "max_in_flight_tokens", "enable_events", "vocab_size", "hybrid", "skip_capacity_check", "session_block_quota", "prefix_cache_retention_interval", "enable_mamba_shared_prefix_checkpoint", "max_pinned_blocks", "session_pinned_block_quota", "use_eagle", "host_tier_blocks", "num_hash_lookahead_tokens")
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    ENABLE_CACHING_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGO_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENABLE_EVENTS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HYBRID_FIELD_NUMBER: _ClassVar[int]
    SKIP_CAPACITY_CHECK_FIELD_NUMBER: _ClassVar[int]
    SESSION_BLOCK_QUOTA_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_RETENTION_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    ENABLE_MAMBA_SHARED_PREFIX_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    MAX_PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SESSION_PINNED_BLOCK_QUOTA_FIELD_NUMBER: _ClassVar[int]
    USE_EAGLE_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HASH_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_model_len: int
    enable_caching: bool
    hash_algo: HashAlgo
    scheduler_block_size: int
    hash_block_size: int
    watermark: float
    max_in_flight_tokens: int
    enable_events: bool
    vocab_size: int
    hybrid: bool
    skip_capacity_check: bool
    session_block_quota: int
    prefix_cache_retention_interval: int
    enable_mamba_shared_prefix_checkpoint: bool
    max_pinned_blocks: int
    session_pinned_block_quota: int
    use_eagle: bool
    host_tier_blocks: int
    num_hash_lookahead_tokens: int
    def __init__(self, max_model_len: _Optional[int] = ..., enable_caching: _Optional[bool] = ..., hash_algo: _Optional[_Union[HashAlgo, str]] = ..., scheduler_block_size: _Optional[int] = ..., hash_block_size: _Optional[int] = ..., watermark: _Optional[float] = ..., max_in_flight_tokens: _Optional[int] = ..., enable_events: _Optional[bool] = ..., vocab_size: _Optional[int] = ..., hybrid: _Optional[bool] = ..., skip_capacity_check: _Optional[bool] = ..., session_block_quota: _Optional[int] = ..., prefix_cache_retention_interval: _Optional[int] = ..., enable_mamba_shared_prefix_checkpoint: _Optional[bool] = ..., max_pinned_blocks: _Optional[int] = ..., session_pinned_block_quota: _Optional[int] = ..., use_eagle: _Optional[bool] = ..., host_tier_blocks: _Optional[int] = ..., num_hash_lookahead_tokens: _Optional[int] = ...) -> None: ...

class RegisterPoolRequest(_message.Message):
    __slots__ = ("pool_id", "layers", "available_memory_bytes", "num_blocks", "options", "session_id", "sequence")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    layers: _containers.RepeatedCompositeFieldContainer[LayerSpec]
    available_memory_bytes: int
    num_blocks: int
    options: PoolOptions
    session_id: str
    sequence: int
    def __init__(self, pool_id: _Optional[str] = ..., layers: _Optional[_Iterable[_Union[LayerSpec, _Mapping]]] = ..., available_memory_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., options: _Optional[_Union[PoolOptions, _Mapping]] = ..., session_id: _Optional[str] = ..., sequence: _Optional[int] = ...) -> None: ...

class KVCacheGroup(_message.Message):
    __slots__ = ("index", "layer_names", "kind", "block_size", "sliding_window", "attention_chunk_size", "page_size_bytes", "mamba_cache_mode", "rswa_window")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LAYER_NAMES_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAMBA_CACHE_MODE_FIELD_NUMBER: _ClassVar[int]
    RSWA_WINDOW_FIELD_NUMBER: _ClassVar[int]
    index: int
    layer_names: _containers.RepeatedScalarFieldContainer[str]
    kind: LayerKind
    block_size: int
    sliding_window: int
    attention_chunk_size: int
    page_size_bytes: int
    mamba_cache_mode: MambaCacheMode
    rswa_window: int
    def __init__(self, index: _Optional[int] = ..., layer_names: _Optional[_Iterable[str]] = ..., kind: _Optional[_Union[LayerKind, str]] = ..., block_size: _Optional[int] = ..., sliding_window: _Optional[int] = ..., attention_chunk_size: _Optional[int] = ..., page_size_bytes: _Optional[int] = ..., mamba_cache_mode: _Optional[_Union[MambaCacheMode, str]] = ..., rswa_window: _Optional[int] = ...) -> None: ...

class PoolConfig(_message.Message):
    __slots__ = ("pool_id", "num_blocks", "groups", "page_size_bytes", "scheduler_block_size", "hash_block_size", "options", "layers", "layer_page_size_bytes", "hash_recipe", "incarnation")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    LAYER_PAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HASH_RECIPE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    num_blocks: int
    groups: _containers.RepeatedCompositeFieldContainer[KVCacheGroup]
    page_size_bytes: int
    scheduler_block_size: int
    hash_block_size: int
    options: PoolOptions
    layers: _containers.RepeatedCompositeFieldContainer[LayerSpec]
    layer_page_size_bytes: int
    hash_recipe: HashRecipe
    incarnation: int
    def __init__(self, pool_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[KVCacheGroup, _Mapping]]] = ..., page_size_bytes: _Optional[int] = ..., scheduler_block_size: _Optional[int] = ..., hash_block_size: _Optional[int] = ..., options: _Optional[_Union[PoolOptions, _Mapping]] = ..., layers: _Optional[_Iterable[_Union[LayerSpec, _Mapping]]] = ..., layer_page_size_bytes: _Optional[int] = ..., hash_recipe: _Optional[_Union[HashRecipe, _Mapping]] = ..., incarnation: _Optional[int] = ...) -> None: ...

class HashRecipe(_message.Message):
    __slots__ = ("hash_algo", "none_hash_seed", "none_hash", "hash_block_size", "num_hash_lookahead_tokens")
    HASH_ALGO_FIELD_NUMBER: _ClassVar[int]
    NONE_HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    NONE_HASH_FIELD_NUMBER: _ClassVar[int]
    HASH_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_HASH_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    hash_algo: HashAlgo
    none_hash_seed: str
    none_hash: bytes
    hash_block_size: int
    num_hash_lookahead_tokens: int
    def __init__(self, hash_algo: _Optional[_Union[HashAlgo, str]] = ..., none_hash_seed: _Optional[str] = ..., none_hash: _Optional[bytes] = ..., hash_block_size: _Optional[int] = ..., num_hash_lookahead_tokens: _Optional[int] = ...) -> None: ...

class MultiModalItem(_message.Message):
    __slots__ = ("identifier", "offset", "length")
    IDENTIFIER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    identifier: str
    offset: int
    length: int
    def __init__(self, identifier: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class RegisterPoolResponse(_message.Message):
    __slots__ = ("config", "created")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    config: PoolConfig
    created: bool
    def __init__(self, config: _Optional[_Union[PoolConfig, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class GetPoolRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class GetPoolResponse(_message.Message):
    __slots__ = ("config",)
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    config: PoolConfig
    def __init__(self, config: _Optional[_Union[PoolConfig, _Mapping]] = ...) -> None: ...

class ListPoolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPoolsResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolConfig]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolConfig, _Mapping]]] = ...) -> None: ...

class DeletePoolRequest(_message.Message):
    __slots__ = ("pool_id", "session_id", "sequence")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    session_id: str
    sequence: int
    def __init__(self, pool_id: _Optional[str] = ..., session_id: _Optional[str] = ..., sequence: _Optional[int] = ...) -> None: ...

class DeletePoolResponse(_message.Message):
    __slots__ = ("num_requests_dropped",)
    NUM_REQUESTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    num_requests_dropped: int
    def __init__(self, num_requests_dropped: _Optional[int] = ...) -> None: ...

class AddRequestOp(_message.Message):
    __slots__ = ("request_id", "token_ids", "block_hashes", "cache_salt", "lora_name", "lora_path", "hash_recipe", "eviction_class", "mm_items", "prompt_embeds_digests", "lora_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    HASH_RECIPE_FIELD_NUMBER: _ClassVar[int]
    EVICTION_CLASS_FIELD_NUMBER: _ClassVar[int]
    MM_ITEMS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_EMBEDS_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    cache_salt: str
    lora_name: str
    lora_path: str
    hash_recipe: HashRecipe
    eviction_class: int
    mm_items: _containers.RepeatedCompositeFieldContainer[MultiModalItem]
    prompt_embeds_digests: _containers.RepeatedScalarFieldContainer[bytes]
    lora_id: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., cache_salt: _Optional[str] = ..., lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., hash_recipe: _Optional[_Union[HashRecipe, _Mapping]] = ..., eviction_class: _Optional[int] = ..., mm_items: _Optional[_Iterable[_Union[MultiModalItem, _Mapping]]] = ..., prompt_embeds_digests: _Optional[_Iterable[bytes]] = ..., lora_id: _Optional[int] = ...) -> None: ...

class LookupOp(_message.Message):
    __slots__ = ("request_id", "explain")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EXPLAIN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    explain: bool
    def __init__(self, request_id: _Optional[str] = ..., explain: _Optional[bool] = ...) -> None: ...

class AllocateOp(_message.Message):
    __slots__ = ("request_id", "num_new_tokens", "num_lookahead_tokens", "full_sequence_must_fit", "skip_lookup", "delay_cache_blocks", "skip_block_table", "append_token_ids", "num_placeholder_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FULL_SEQUENCE_MUST_FIT_FIELD_NUMBER: _ClassVar[int]
    SKIP_LOOKUP_FIELD_NUMBER: _ClassVar[int]
    DELAY_CACHE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SKIP_BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PLACEHOLDER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_new_tokens: int
    num_lookahead_tokens: int
    full_sequence_must_fit: bool
    skip_lookup: bool
    delay_cache_blocks: bool
    skip_block_table: bool
    append_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_placeholder_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., num_new_tokens: _Optional[int] = ..., num_lookahead_tokens: _Optional[int] = ..., full_sequence_must_fit: _Optional[bool] = ..., skip_lookup: _Optional[bool] = ..., delay_cache_blocks: _Optional[bool] = ..., skip_block_table: _Optional[bool] = ..., append_token_ids: _Optional[_Iterable[int]] = ..., num_placeholder_tokens: _Optional[int] = ...) -> None: ...

class AppendTokensOp(_message.Message):
    __slots__ = ("request_id", "token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class FreeOp(_message.Message):
    __slots__ = ("request_id", "evict_first", "tail_first_across_groups")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIRST_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIRST_ACROSS_GROUPS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    evict_first: bool
    tail_first_across_groups: bool
    def __init__(self, request_id: _Optional[str] = ..., evict_first: _Optional[bool] = ..., tail_first_across_groups: _Optional[bool] = ...) -> None: ...

class PreemptOp(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class NewStepOp(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DecodeOp(_message.Message):
    __slots__ = ("request_ids", "token_ids", "placeholders")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PLACEHOLDERS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    placeholders: bool
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., placeholders: _Optional[bool] = ...) -> None: ...

class FillPlaceholdersOp(_message.Message):
    __slots__ = ("request_ids", "token_ids")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Op(_message.Message):
    __slots__ = ("add_request", "lookup", "allocate", "append_tokens", "free", "preempt", "new_step", "decode", "fill_placeholders", "reset_host_tier")
    ADD_REQUEST_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    PREEMPT_FIELD_NUMBER: _ClassVar[int]
    NEW_STEP_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    FILL_PLACEHOLDERS_FIELD_NUMBER: _ClassVar[int]
    RESET_HOST_TIER_FIELD_NUMBER: _ClassVar[int]
    add_request: AddRequestOp
    lookup: LookupOp
    allocate: AllocateOp
    append_tokens: AppendTokensOp
    free: FreeOp
    preempt: PreemptOp
    new_step: NewStepOp
    decode: DecodeOp
    fill_placeholders: FillPlaceholdersOp
    reset_host_tier: ResetHostTierOp
    def __init__(self, add_request: _Optional[_Union[AddRequestOp, _Mapping]] = ..., lookup: _Optional[_Union[LookupOp, _Mapping]] = ..., allocate: _Optional[_Union[AllocateOp, _Mapping]] = ..., append_tokens: _Optional[_Union[AppendTokensOp, _Mapping]] = ..., free: _Optional[_Union[FreeOp, _Mapping]] = ..., preempt: _Optional[_Union[PreemptOp, _Mapping]] = ..., new_step: _Optional[_Union[NewStepOp, _Mapping]] = ..., decode: _Optional[_Union[DecodeOp, _Mapping]] = ..., fill_placeholders: _Optional[_Union[FillPlaceholdersOp, _Mapping]] = ..., reset_host_tier: _Optional[_Union[ResetHostTierOp, _Mapping]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("pool_id", "begin_step", "ops", "session_id", "sequence")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    BEGIN_STEP_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    begin_step: bool
    ops: _containers.RepeatedCompositeFieldContainer[Op]
    session_id: str
    sequence: int
    def __init__(self, pool_id: _Optional[str] = ..., begin_step: _Optional[bool] = ..., ops: _Optional[_Iterable[_Union[Op, _Mapping]]] = ..., session_id: _Optional[str] = ..., sequence: _Optional[int] = ...) -> None: ...

class BlockTable(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AddRequestResult(_message.Message):
    __slots__ = ("num_tokens", "num_block_hashes")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    num_block_hashes: int
    def __init__(self, num_tokens: _Optional[int] = ..., num_block_hashes: _Optional[int] = ...) -> None: ...

class LookupResult(_message.Message):
    __slots__ = ("hit_tokens", "block_ids", "shared_prefix_boundary", "groups")
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SHARED_PREFIX_BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    hit_tokens: int
    block_ids: _containers.RepeatedCompositeFieldContainer[BlockTable]
    shared_prefix_boundary: int
    groups: _containers.RepeatedCompositeFieldContainer[GroupResidency]
    def __init__(self, hit_tokens: _Optional[int] = ..., block_ids: _Optional[_Iterable[_Union[BlockTable, _Mapping]]] = ..., shared_prefix_boundary: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[GroupResidency, _Mapping]]] = ...) -> None: ...

class AllocateResult(_message.Message):
    __slots__ = ("ok", "new_block_ids", "block_ids", "num_computed_tokens", "hit_tokens_used", "block_copies")
    OK_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_USED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COPIES_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    new_block_ids: _containers.RepeatedCompositeFieldContainer[BlockTable]
    block_ids: _containers.RepeatedCompositeFieldContainer[BlockTable]
    num_computed_tokens: int
    hit_tokens_used: int
    block_copies: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    def __init__(self, ok: _Optional[bool] = ..., new_block_ids: _Optional[_Iterable[_Union[BlockTable, _Mapping]]] = ..., block_ids: _Optional[_Iterable[_Union[BlockTable, _Mapping]]] = ..., num_computed_tokens: _Optional[int] = ..., hit_tokens_used: _Optional[int] = ..., block_copies: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("group", "src_block_id", "dst_block_id")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    group: int
    src_block_id: int
    dst_block_id: int
    def __init__(self, group: _Optional[int] = ..., src_block_id: _Optional[int] = ..., dst_block_id: _Optional[int] = ...) -> None: ...

class AppendTokensResult(_message.Message):
    __slots__ = ("num_tokens", "num_block_hashes")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    num_block_hashes: int
    def __init__(self, num_tokens: _Optional[int] = ..., num_block_hashes: _Optional[int] = ...) -> None: ...

class FreeResult(_message.Message):
    __slots__ = ("num_free_blocks",)
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_free_blocks: int
    def __init__(self, num_free_blocks: _Optional[int] = ...) -> None: ...

class PreemptResult(_message.Message):
    __slots__ = ("num_free_blocks",)
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_free_blocks: int
    def __init__(self, num_free_blocks: _Optional[int] = ...) -> None: ...

class NewStepResult(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DecodeResult(_message.Message):
    __slots__ = ("ok", "grown", "new_block_counts", "new_block_ids", "block_copies")
    OK_FIELD_NUMBER: _ClassVar[int]
    GROWN_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_COUNTS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COPIES_FIELD_NUMBER: _ClassVar[int]
    ok: _containers.RepeatedScalarFieldContainer[bool]
    grown: _containers.RepeatedScalarFieldContainer[int]
    new_block_counts: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_copies: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    def __init__(self, ok: _Optional[_Iterable[bool]] = ..., grown: _Optional[_Iterable[int]] = ..., new_block_counts: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., block_copies: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ...) -> None: ...

class ResetHostTierOp(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetHostTierResult(_message.Message):
    __slots__ = ("num_dropped",)
    NUM_DROPPED_FIELD_NUMBER: _ClassVar[int]
    num_dropped: int
    def __init__(self, num_dropped: _Optional[int] = ...) -> None: ...

class TierCopy(_message.Message):
    __slots__ = ("group", "block_id", "host_slot")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_SLOT_FIELD_NUMBER: _ClassVar[int]
    group: int
    block_id: int
    host_slot: int
    def __init__(self, group: _Optional[int] = ..., block_id: _Optional[int] = ..., host_slot: _Optional[int] = ...) -> None: ...

class FillPlaceholdersResult(_message.Message):
    __slots__ = ("num_filled",)
    NUM_FILLED_FIELD_NUMBER: _ClassVar[int]
    num_filled: int
    def __init__(self, num_filled: _Optional[int] = ...) -> None: ...

class OpResult(_message.Message):
    __slots__ = ("add_request", "lookup", "allocate", "append_tokens", "free", "preempt", "new_step", "decode", "fill_placeholders", "reset_host_tier")
    ADD_REQUEST_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    PREEMPT_FIELD_NUMBER: _ClassVar[int]
    NEW_STEP_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    FILL_PLACEHOLDERS_FIELD_NUMBER: _ClassVar[int]
    RESET_HOST_TIER_FIELD_NUMBER: _ClassVar[int]
    add_request: AddRequestResult
    lookup: LookupResult
    allocate: AllocateResult
    append_tokens: AppendTokensResult
    free: FreeResult
    preempt: PreemptResult
    new_step: NewStepResult
    decode: DecodeResult
    fill_placeholders: FillPlaceholdersResult
    reset_host_tier: ResetHostTierResult
    def __init__(self, add_request: _Optional[_Union[AddRequestResult, _Mapping]] = ..., lookup: _Optional[_Union[LookupResult, _Mapping]] = ..., allocate: _Optional[_Union[AllocateResult, _Mapping]] = ..., append_tokens: _Optional[_Union[AppendTokensResult, _Mapping]] = ..., free: _Optional[_Union[FreeResult, _Mapping]] = ..., preempt: _Optional[_Union[PreemptResult, _Mapping]] = ..., new_step: _Optional[_Union[NewStepResult, _Mapping]] = ..., decode: _Optional[_Union[DecodeResult, _Mapping]] = ..., fill_placeholders: _Optional[_Union[FillPlaceholdersResult, _Mapping]] = ..., reset_host_tier: _Optional[_Union[ResetHostTierResult, _Mapping]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("results", "num_free_blocks", "demotions", "promotions")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[OpResult]
    num_free_blocks: int
    demotions: _containers.RepeatedCompositeFieldContainer[TierCopy]
    promotions: _containers.RepeatedCompositeFieldContainer[TierCopy]
    def __init__(self, results: _Optional[_Iterable[_Union[OpResult, _Mapping]]] = ..., num_free_blocks: _Optional[int] = ..., demotions: _Optional[_Iterable[_Union[TierCopy, _Mapping]]] = ..., promotions: _Optional[_Iterable[_Union[TierCopy, _Mapping]]] = ...) -> None: ...

class PeekPrefixRequest(_message.Message):
    __slots__ = ("pool_ids", "token_ids", "block_hashes", "cache_salt", "lora_name", "lora_path", "hash_recipe", "explain", "mm_items", "prompt_embeds_digests")
    POOL_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    HASH_RECIPE_FIELD_NUMBER: _ClassVar[int]
    EXPLAIN_FIELD_NUMBER: _ClassVar[int]
    MM_ITEMS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_EMBEDS_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    pool_ids: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    cache_salt: str
    lora_name: str
    lora_path: str
    hash_recipe: HashRecipe
    explain: bool
    mm_items: _containers.RepeatedCompositeFieldContainer[MultiModalItem]
    prompt_embeds_digests: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, pool_ids: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., cache_salt: _Optional[str] = ..., lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., hash_recipe: _Optional[_Union[HashRecipe, _Mapping]] = ..., explain: _Optional[bool] = ..., mm_items: _Optional[_Iterable[_Union[MultiModalItem, _Mapping]]] = ..., prompt_embeds_digests: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GroupResidency(_message.Message):
    __slots__ = ("group_idx", "kind", "tokens", "blocks", "checkpoint_tokens", "miss_reason", "evicted_removals_ago", "host_tokens")
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MISS_REASON_FIELD_NUMBER: _ClassVar[int]
    EVICTED_REMOVALS_AGO_FIELD_NUMBER: _ClassVar[int]
    HOST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    group_idx: int
    kind: LayerKind
    tokens: int
    blocks: int
    checkpoint_tokens: _containers.RepeatedScalarFieldContainer[int]
    miss_reason: MissReason
    evicted_removals_ago: int
    host_tokens: int
    def __init__(self, group_idx: _Optional[int] = ..., kind: _Optional[_Union[LayerKind, str]] = ..., tokens: _Optional[int] = ..., blocks: _Optional[int] = ..., checkpoint_tokens: _Optional[_Iterable[int]] = ..., miss_reason: _Optional[_Union[MissReason, str]] = ..., evicted_removals_ago: _Optional[int] = ..., host_tokens: _Optional[int] = ...) -> None: ...

class PoolHit(_message.Message):
    __slots__ = ("pool_id", "hit_tokens", "groups", "pinned_tokens", "host_hit_tokens")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    PINNED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    hit_tokens: int
    groups: _containers.RepeatedCompositeFieldContainer[GroupResidency]
    pinned_tokens: int
    host_hit_tokens: int
    def __init__(self, pool_id: _Optional[str] = ..., hit_tokens: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[GroupResidency, _Mapping]]] = ..., pinned_tokens: _Optional[int] = ..., host_hit_tokens: _Optional[int] = ...) -> None: ...

class PeekPrefixResponse(_message.Message):
    __slots__ = ("hits",)
    HITS_FIELD_NUMBER: _ClassVar[int]
    hits: _containers.RepeatedCompositeFieldContainer[PoolHit]
    def __init__(self, hits: _Optional[_Iterable[_Union[PoolHit, _Mapping]]] = ...) -> None: ...

class GetRequestRequest(_message.Message):
    __slots__ = ("pool_id", "request_id")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    request_id: str
    def __init__(self, pool_id: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class GetRequestResponse(_message.Message):
    __slots__ = ("block_ids", "num_computed_tokens", "num_tokens", "num_block_hashes", "status", "num_preemptions", "num_placeholder_tokens")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_PLACEHOLDER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedCompositeFieldContainer[BlockTable]
    num_computed_tokens: int
    num_tokens: int
    num_block_hashes: int
    status: str
    num_preemptions: int
    num_placeholder_tokens: int
    def __init__(self, block_ids: _Optional[_Iterable[_Union[BlockTable, _Mapping]]] = ..., num_computed_tokens: _Optional[int] = ..., num_tokens: _Optional[int] = ..., num_block_hashes: _Optional[int] = ..., status: _Optional[str] = ..., num_preemptions: _Optional[int] = ..., num_placeholder_tokens: _Optional[int] = ...) -> None: ...

class GetPoolStatsRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class GroupStats(_message.Message):
    __slots__ = ("index", "num_cached_blocks")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    index: int
    num_cached_blocks: int
    def __init__(self, index: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ...) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("num_blocks", "num_free_blocks", "num_cached_blocks", "usage", "num_requests", "prefix_cache_queries", "prefix_cache_hits", "evictions", "allocation_failures", "preemptions", "groups", "last_event_sequence", "num_pinned_blocks", "max_pinned_blocks", "num_pins", "pin_refusals", "pinned_blocks", "tenant_pinned_blocks", "host_tier_blocks", "host_tier_used_blocks", "host_demotions", "host_promotions", "host_evictions")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_FAILURES_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PINS_FIELD_NUMBER: _ClassVar[int]
    PIN_REFUSALS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TENANT_PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    HOST_PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    HOST_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    usage: float
    num_requests: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    evictions: int
    allocation_failures: int
    preemptions: int
    groups: _containers.RepeatedCompositeFieldContainer[GroupStats]
    last_event_sequence: int
    num_pinned_blocks: int
    max_pinned_blocks: int
    num_pins: int
    pin_refusals: int
    pinned_blocks: _containers.RepeatedCompositeFieldContainer[PinnedBlocks]
    tenant_pinned_blocks: int
    host_tier_blocks: int
    host_tier_used_blocks: int
    host_demotions: int
    host_promotions: int
    host_evictions: int
    def __init__(self, num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., usage: _Optional[float] = ..., num_requests: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., evictions: _Optional[int] = ..., allocation_failures: _Optional[int] = ..., preemptions: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[GroupStats, _Mapping]]] = ..., last_event_sequence: _Optional[int] = ..., num_pinned_blocks: _Optional[int] = ..., max_pinned_blocks: _Optional[int] = ..., num_pins: _Optional[int] = ..., pin_refusals: _Optional[int] = ..., pinned_blocks: _Optional[_Iterable[_Union[PinnedBlocks, _Mapping]]] = ..., tenant_pinned_blocks: _Optional[int] = ..., host_tier_blocks: _Optional[int] = ..., host_tier_used_blocks: _Optional[int] = ..., host_demotions: _Optional[int] = ..., host_promotions: _Optional[int] = ..., host_evictions: _Optional[int] = ...) -> None: ...

class PinnedBlocks(_message.Message):
    __slots__ = ("session_id_prefix", "blocks")
    SESSION_ID_PREFIX_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    session_id_prefix: str
    blocks: int
    def __init__(self, session_id_prefix: _Optional[str] = ..., blocks: _Optional[int] = ...) -> None: ...

class GetPoolStatsResponse(_message.Message):
    __slots__ = ("stats",)
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: PoolStats
    def __init__(self, stats: _Optional[_Union[PoolStats, _Mapping]] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ("pool_id", "session_id", "sequence", "block_ids")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    session_id: str
    sequence: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pool_id: _Optional[str] = ..., session_id: _Optional[str] = ..., sequence: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("reset",)
    RESET_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    def __init__(self, reset: _Optional[bool] = ...) -> None: ...

class SubscribeEventsRequest(_message.Message):
    __slots__ = ("pool_id", "from_sequence", "incarnation")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    from_sequence: int
    incarnation: int
    def __init__(self, pool_id: _Optional[str] = ..., from_sequence: _Optional[int] = ..., incarnation: _Optional[int] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_name", "group_idx", "kind", "sliding_window", "medium", "prefix_lengths", "start_token", "session_id", "lookahead_token_ids", "lora_id")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_block_hash: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    lora_name: str
    group_idx: int
    kind: LayerKind
    sliding_window: int
    medium: str
    prefix_lengths: _containers.RepeatedScalarFieldContainer[int]
    start_token: int
    session_id: str
    lookahead_token_ids: _containers.RepeatedCompositeFieldContainer[LookaheadTokens]
    lora_id: int
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., parent_block_hash: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., lora_name: _Optional[str] = ..., group_idx: _Optional[int] = ..., kind: _Optional[_Union[LayerKind, str]] = ..., sliding_window: _Optional[int] = ..., medium: _Optional[str] = ..., prefix_lengths: _Optional[_Iterable[int]] = ..., start_token: _Optional[int] = ..., session_id: _Optional[str] = ..., lookahead_token_ids: _Optional[_Iterable[_Union[LookaheadTokens, _Mapping]]] = ..., lora_id: _Optional[int] = ...) -> None: ...

class LookaheadTokens(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "group_idx", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    group_idx: int
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., group_idx: _Optional[int] = ..., medium: _Optional[str] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("sequence", "incarnation", "block_stored", "block_removed", "all_blocks_cleared")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_BLOCKS_CLEARED_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    incarnation: int
    block_stored: BlockStored
    block_removed: BlockRemoved
    all_blocks_cleared: AllBlocksCleared
    def __init__(self, sequence: _Optional[int] = ..., incarnation: _Optional[int] = ..., block_stored: _Optional[_Union[BlockStored, _Mapping]] = ..., block_removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., all_blocks_cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class SubscribeEventsResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("client_name", "session_id", "evict_first_on_end")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIRST_ON_END_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    session_id: str
    evict_first_on_end: bool
    def __init__(self, client_name: _Optional[str] = ..., session_id: _Optional[str] = ..., evict_first_on_end: _Optional[bool] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "lease_ttl_seconds")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lease_ttl_seconds: float
    def __init__(self, session_id: _Optional[str] = ..., lease_ttl_seconds: _Optional[float] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("lease_ttl_seconds",)
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_seconds: float
    def __init__(self, lease_ttl_seconds: _Optional[float] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id", "evict_first")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIRST_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    evict_first: bool
    def __init__(self, session_id: _Optional[str] = ..., evict_first: _Optional[bool] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("num_requests_freed",)
    NUM_REQUESTS_FREED_FIELD_NUMBER: _ClassVar[int]
    num_requests_freed: int
    def __init__(self, num_requests_freed: _Optional[int] = ...) -> None: ...

class GetPrefixSnapshotRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class GroupPrefixes(_message.Message):
    __slots__ = ("group_idx", "kind", "block_size", "block_hashes")
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    group_idx: int
    kind: LayerKind
    block_size: int
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, group_idx: _Optional[int] = ..., kind: _Optional[_Union[LayerKind, str]] = ..., block_size: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class GetPrefixSnapshotResponse(_message.Message):
    __slots__ = ("sequence", "groups", "incarnation")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    groups: _containers.RepeatedCompositeFieldContainer[GroupPrefixes]
    incarnation: int
    def __init__(self, sequence: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[GroupPrefixes, _Mapping]]] = ..., incarnation: _Optional[int] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionPoolUsage(_message.Message):
    __slots__ = ("pool_id", "num_requests", "request_ids", "blocks_held", "block_quota")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_HELD_FIELD_NUMBER: _ClassVar[int]
    BLOCK_QUOTA_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    num_requests: int
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    blocks_held: int
    block_quota: int
    def __init__(self, pool_id: _Optional[str] = ..., num_requests: _Optional[int] = ..., request_ids: _Optional[_Iterable[str]] = ..., blocks_held: _Optional[int] = ..., block_quota: _Optional[int] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id_prefix", "client_name", "lease_remaining_seconds", "last_sequence", "expiring", "pools")
    SESSION_ID_PREFIX_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    EXPIRING_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    session_id_prefix: str
    client_name: str
    lease_remaining_seconds: float
    last_sequence: int
    expiring: bool
    pools: _containers.RepeatedCompositeFieldContainer[SessionPoolUsage]
    def __init__(self, session_id_prefix: _Optional[str] = ..., client_name: _Optional[str] = ..., lease_remaining_seconds: _Optional[float] = ..., last_sequence: _Optional[int] = ..., expiring: _Optional[bool] = ..., pools: _Optional[_Iterable[_Union[SessionPoolUsage, _Mapping]]] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ...) -> None: ...

class PinPrefixRequest(_message.Message):
    __slots__ = ("pool_id", "pin_id", "token_ids", "block_hashes", "cache_salt", "lora_name", "lora_path", "ttl_seconds", "session_id", "outlive_session", "mm_items", "prompt_embeds_digests")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OUTLIVE_SESSION_FIELD_NUMBER: _ClassVar[int]
    MM_ITEMS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_EMBEDS_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    pin_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    cache_salt: str
    lora_name: str
    lora_path: str
    ttl_seconds: float
    session_id: str
    outlive_session: bool
    mm_items: _containers.RepeatedCompositeFieldContainer[MultiModalItem]
    prompt_embeds_digests: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, pool_id: _Optional[str] = ..., pin_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., cache_salt: _Optional[str] = ..., lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., ttl_seconds: _Optional[float] = ..., session_id: _Optional[str] = ..., outlive_session: _Optional[bool] = ..., mm_items: _Optional[_Iterable[_Union[MultiModalItem, _Mapping]]] = ..., prompt_embeds_digests: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PinInfo(_message.Message):
    __slots__ = ("pin_id", "prefix_tokens", "hit_tokens", "num_blocks", "growing", "expires_at_unix_seconds")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GROWING_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    pin_id: str
    prefix_tokens: int
    hit_tokens: int
    num_blocks: int
    growing: bool
    expires_at_unix_seconds: float
    def __init__(self, pin_id: _Optional[str] = ..., prefix_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., growing: _Optional[bool] = ..., expires_at_unix_seconds: _Optional[float] = ...) -> None: ...

class PinPrefixResponse(_message.Message):
    __slots__ = ("pin",)
    PIN_FIELD_NUMBER: _ClassVar[int]
    pin: PinInfo
    def __init__(self, pin: _Optional[_Union[PinInfo, _Mapping]] = ...) -> None: ...

class RenewPinRequest(_message.Message):
    __slots__ = ("pool_id", "pin_id", "ttl_seconds")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    pin_id: str
    ttl_seconds: float
    def __init__(self, pool_id: _Optional[str] = ..., pin_id: _Optional[str] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class RenewPinResponse(_message.Message):
    __slots__ = ("pin",)
    PIN_FIELD_NUMBER: _ClassVar[int]
    pin: PinInfo
    def __init__(self, pin: _Optional[_Union[PinInfo, _Mapping]] = ...) -> None: ...

class DropPinRequest(_message.Message):
    __slots__ = ("pool_id", "pin_id")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    pin_id: str
    def __init__(self, pool_id: _Optional[str] = ..., pin_id: _Optional[str] = ...) -> None: ...

class DropPinResponse(_message.Message):
    __slots__ = ("pin",)
    PIN_FIELD_NUMBER: _ClassVar[int]
    pin: PinInfo
    def __init__(self, pin: _Optional[_Union[PinInfo, _Mapping]] = ...) -> None: ...
