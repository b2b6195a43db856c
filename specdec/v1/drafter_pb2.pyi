from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpeculateRequest(_message.Message):
    __slots__ = ("open", "outcome")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    open: _common_pb2.OpenSessionRequest
    outcome: StepOutcome
    def __init__(self, open: _Optional[_Union[_common_pb2.OpenSessionRequest, _Mapping]] = ..., outcome: _Optional[_Union[StepOutcome, _Mapping]] = ...) -> None: ...

class StepOutcome(_message.Message):
    __slots__ = ("committed_len", "token_ids", "num_speculative_tokens", "overlap", "features", "row_argmax", "verified_ids", "verified_parents")
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    ROW_ARGMAX_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_IDS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_PARENTS_FIELD_NUMBER: _ClassVar[int]
    committed_len: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_speculative_tokens: int
    overlap: bool
    features: FeatureChunk
    row_argmax: _containers.RepeatedScalarFieldContainer[int]
    verified_ids: _containers.RepeatedScalarFieldContainer[int]
    verified_parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, committed_len: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_speculative_tokens: _Optional[int] = ..., overlap: _Optional[bool] = ..., features: _Optional[_Union[FeatureChunk, _Mapping]] = ..., row_argmax: _Optional[_Iterable[int]] = ..., verified_ids: _Optional[_Iterable[int]] = ..., verified_parents: _Optional[_Iterable[int]] = ...) -> None: ...

class FeatureChunk(_message.Message):
    __slots__ = ("first_position", "width", "bfloat16")
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    BFLOAT16_FIELD_NUMBER: _ClassVar[int]
    first_position: int
    width: int
    bfloat16: bytes
    def __init__(self, first_position: _Optional[int] = ..., width: _Optional[int] = ..., bfloat16: _Optional[bytes] = ...) -> None: ...

class DraftBlock(_message.Message):
    __slots__ = ("anchor_len", "assumed_ids", "draft_token_ids", "draft_distributions", "draft_time_ns", "parent_indices")
    ANCHOR_LEN_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    PARENT_INDICES_FIELD_NUMBER: _ClassVar[int]
    anchor_len: int
    assumed_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_distributions: _containers.RepeatedCompositeFieldContainer[_common_pb2.DraftDistribution]
    draft_time_ns: int
    parent_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, anchor_len: _Optional[int] = ..., assumed_ids: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_distributions: _Optional[_Iterable[_Union[_common_pb2.DraftDistribution, _Mapping]]] = ..., draft_time_ns: _Optional[int] = ..., parent_indices: _Optional[_Iterable[int]] = ...) -> None: ...
