from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicateRequest(_message.Message):
    __slots__ = ("hello", "snapshot", "record", "live")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    hello: ReplicaHello
    snapshot: ReplicaSnapshot
    record: ReplicatedRecord
    live: ReplicaLive
    def __init__(self, hello: _Optional[_Union[ReplicaHello, _Mapping]] = ..., snapshot: _Optional[_Union[ReplicaSnapshot, _Mapping]] = ..., record: _Optional[_Union[ReplicatedRecord, _Mapping]] = ..., live: _Optional[_Union[ReplicaLive, _Mapping]] = ...) -> None: ...

class ReplicaHello(_message.Message):
    __slots__ = ("source", "epoch", "lease", "mac")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    source: str
    epoch: str
    lease: int
    mac: bytes
    def __init__(self, source: _Optional[str] = ..., epoch: _Optional[str] = ..., lease: _Optional[int] = ..., mac: _Optional[bytes] = ...) -> None: ...

class ReplicaSnapshot(_message.Message):
    __slots__ = ("index", "chunk", "last", "mac")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    index: int
    chunk: bytes
    last: bool
    mac: bytes
    def __init__(self, index: _Optional[int] = ..., chunk: _Optional[bytes] = ..., last: _Optional[bool] = ..., mac: _Optional[bytes] = ...) -> None: ...

class ReplicatedRecord(_message.Message):
    __slots__ = ("index", "record", "pool_id", "token", "mac")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    index: int
    record: bytes
    pool_id: str
    token: int
    mac: bytes
    def __init__(self, index: _Optional[int] = ..., record: _Optional[bytes] = ..., pool_id: _Optional[str] = ..., token: _Optional[int] = ..., mac: _Optional[bytes] = ...) -> None: ...

class ReplicaLive(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicateResponse(_message.Message):
    __slots__ = ("index", "has_state")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    HAS_STATE_FIELD_NUMBER: _ClassVar[int]
    index: int
    has_state: bool
    def __init__(self, index: _Optional[int] = ..., has_state: _Optional[bool] = ...) -> None: ...
