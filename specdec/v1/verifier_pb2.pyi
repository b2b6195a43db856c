from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "sync", "draft_token_ids", "draft_distributions")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sync: _common_pb2.SequenceSync
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_distributions: _containers.RepeatedCompositeFieldContainer[_common_pb2.DraftDistribution]
    def __init__(self, session_id: _Optional[str] = ..., sync: _Optional[_Union[_common_pb2.SequenceSync, _Mapping]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_distributions: _Optional[_Iterable[_Union[_common_pb2.DraftDistribution, _Mapping]]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("token_ids", "num_accepted", "committed_len", "verify_time_ns")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    VERIFY_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_accepted: int
    committed_len: int
    verify_time_ns: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., num_accepted: _Optional[int] = ..., committed_len: _Optional[int] = ..., verify_time_ns: _Optional[int] = ...) -> None: ...
