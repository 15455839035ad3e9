from kvcache_common.api.kvcache.v1 import cache_service_pb2 as _cache_service_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WalRecord(_message.Message):
    __slots__ = ("register_pool", "delete_pool", "step", "reset_prefix_cache", "open_session", "close_session", "expire_session", "adopt_pool", "pin_prefix", "renew_pin", "drop_pin", "expire_pin", "tenant")
    REGISTER_POOL_FIELD_NUMBER: _ClassVar[int]
    DELETE_POOL_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RESET_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSION_FIELD_NUMBER: _ClassVar[int]
    CLOSE_SESSION_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_SESSION_FIELD_NUMBER: _ClassVar[int]
    ADOPT_POOL_FIELD_NUMBER: _ClassVar[int]
    PIN_PREFIX_FIELD_NUMBER: _ClassVar[int]
    RENEW_PIN_FIELD_NUMBER: _ClassVar[int]
    DROP_PIN_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_PIN_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    register_pool: _cache_service_pb2.RegisterPoolRequest
    delete_pool: _cache_service_pb2.DeletePoolRequest
    step: _cache_service_pb2.StepRequest
    reset_prefix_cache: _cache_service_pb2.ResetPrefixCacheRequest
    open_session: OpenSession
    close_session: _cache_service_pb2.CloseSessionRequest
    expire_session: ExpireSession
    adopt_pool: AdoptPool
    pin_prefix: PinPrefix
    renew_pin: RenewPin
    drop_pin: _cache_service_pb2.DropPinRequest
    expire_pin: ExpirePin
    tenant: TenantContext
    def __init__(self, register_pool: _Optional[_Union[_cache_service_pb2.RegisterPoolRequest, _Mapping]] = ..., delete_pool: _Optional[_Union[_cache_service_pb2.DeletePoolRequest, _Mapping]] = ..., step: _Optional[_Union[_cache_service_pb2.StepRequest, _Mapping]] = ..., reset_prefix_cache: _Optional[_Union[_cache_service_pb2.ResetPrefixCacheRequest, _Mapping]] = ..., open_session: _Optional[_Union[OpenSession, _Mapping]] = ..., close_session: _Optional[_Union[_cache_service_pb2.CloseSessionRequest, _Mapping]] = ..., expire_session: _Optional[_Union[ExpireSession, _Mapping]] = ..., adopt_pool: _Optional[_Union[AdoptPool, _Mapping]] = ..., pin_prefix: _Optional[_Union[PinPrefix, _Mapping]] = ..., renew_pin: _Optional[_Union[RenewPin, _Mapping]] = ..., drop_pin: _Optional[_Union[_cache_service_pb2.DropPinRequest, _Mapping]] = ..., expire_pin: _Optional[_Union[ExpirePin, _Mapping]] = ..., tenant: _Optional[_Union[TenantContext, _Mapping]] = ...) -> None: ...

class TenantContext(_message.Message):
    __slots__ = ("name", "max_pools", "max_blocks", "admin")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_POOLS_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    name: str
    max_pools: int
    max_blocks: int
    admin: bool
    def __init__(self, name: _Optional[str] = ..., max_pools: _Optional[int] = ..., max_blocks: _Optional[int] = ..., admin: _Optional[bool] = ...) -> None: ...

class OpenSession(_message.Message):
    __slots__ = ("session_id", "client_name", "evict_first_on_end")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIRST_ON_END_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    client_name: str
    evict_first_on_end: bool
    def __init__(self, session_id: _Optional[str] = ..., client_name: _Optional[str] = ..., evict_first_on_end: _Optional[bool] = ...) -> None: ...

class ExpireSession(_message.Message):
    __slots__ = ("session_id", "max_requests")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    max_requests: int
    def __init__(self, session_id: _Optional[str] = ..., max_requests: _Optional[int] = ...) -> None: ...

class ExpireSessionResult(_message.Message):
    __slots__ = ("num_requests_freed", "num_requests_left")
    NUM_REQUESTS_FREED_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_LEFT_FIELD_NUMBER: _ClassVar[int]
    num_requests_freed: int
    num_requests_left: int
    def __init__(self, num_requests_freed: _Optional[int] = ..., num_requests_left: _Optional[int] = ...) -> None: ...

class AdoptPool(_message.Message):
    __slots__ = ("pool_id", "from_member", "state")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_MEMBER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    from_member: str
    state: bytes
    def __init__(self, pool_id: _Optional[str] = ..., from_member: _Optional[str] = ..., state: _Optional[bytes] = ...) -> None: ...

class AdoptPoolResult(_message.Message):
    __slots__ = ("session_ids",)
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class PinPrefix(_message.Message):
    __slots__ = ("request", "expires_at")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    request: _cache_service_pb2.PinPrefixRequest
    expires_at: float
    def __init__(self, request: _Optional[_Union[_cache_service_pb2.PinPrefixRequest, _Mapping]] = ..., expires_at: _Optional[float] = ...) -> None: ...

class RenewPin(_message.Message):
    __slots__ = ("request", "expires_at")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    request: _cache_service_pb2.RenewPinRequest
    expires_at: float
    def __init__(self, request: _Optional[_Union[_cache_service_pb2.RenewPinRequest, _Mapping]] = ..., expires_at: _Optional[float] = ...) -> None: ...

class ExpirePin(_message.Message):
    __slots__ = ("pool_id", "pin_id", "expires_at")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    pin_id: str
    expires_at: float
    def __init__(self, pool_id: _Optional[str] = ..., pin_id: _Optional[str] = ..., expires_at: _Optional[float] = ...) -> None: ...
