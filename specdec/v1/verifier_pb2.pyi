from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SessionRequest(_message.Message):
    __slots__ = ("session", "drafter_address", "max_new_tokens", "speculation", "stop_token_ids", "drafter_server_name", "fallback_drafters")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_SERVER_NAME_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    session: _common_pb2.OpenSessionRequest
    drafter_address: str
    max_new_tokens: int
    speculation: _common_pb2.SpeculationPolicy
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    drafter_server_name: str
    fallback_drafters: _containers.RepeatedCompositeFieldContainer[DrafterEndpoint]
    def __init__(self, session: _Optional[_Union[_common_pb2.OpenSessionRequest, _Mapping]] = ..., drafter_address: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., speculation: _Optional[_Union[_common_pb2.SpeculationPolicy, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., drafter_server_name: _Optional[str] = ..., fallback_drafters: _Optional[_Iterable[_Union[DrafterEndpoint, _Mapping]]] = ...) -> None: ...

class DrafterEndpoint(_message.Message):
    __slots__ = ("address", "server_name")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SERVER_NAME_FIELD_NUMBER: _ClassVar[int]
    address: str
    server_name: str
    def __init__(self, address: _Optional[str] = ..., server_name: _Optional[str] = ...) -> None: ...

class StepCommit(_message.Message):
    __slots__ = ("token_ids", "num_draft_tokens", "num_accepted", "committed_len", "verify_time_ns", "draft_wait_ns", "predrafted", "finished")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    VERIFY_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_WAIT_NS_FIELD_NUMBER: _ClassVar[int]
    PREDRAFTED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: int
    num_accepted: int
    committed_len: int
    verify_time_ns: int
    draft_wait_ns: int
    predrafted: bool
    finished: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted: _Optional[int] = ..., committed_len: _Optional[int] = ..., verify_time_ns: _Optional[int] = ..., draft_wait_ns: _Optional[int] = ..., predrafted: _Optional[bool] = ..., finished: _Optional[bool] = ...) -> None: ...
