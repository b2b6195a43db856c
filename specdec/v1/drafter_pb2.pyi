from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftRequest(_message.Message):
    __slots__ = ("session_id", "sync", "num_speculative_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sync: _common_pb2.SequenceSync
    num_speculative_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., sync: _Optional[_Union[_common_pb2.SequenceSync, _Mapping]] = ..., num_speculative_tokens: _Optional[int] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("draft_token_ids", "draft_distributions", "draft_time_ns")
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_distributions: _containers.RepeatedCompositeFieldContainer[_common_pb2.DraftDistribution]
    draft_time_ns: int
    def __init__(self, draft_token_ids: _Optional[_Iterable[int]] = ..., draft_distributions: _Optional[_Iterable[_Union[_common_pb2.DraftDistribution, _Mapping]]] = ..., draft_time_ns: _Optional[int] = ...) -> None: ...
