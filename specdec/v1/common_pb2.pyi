from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerificationRule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERIFICATION_RULE_UNSPECIFIED: _ClassVar[VerificationRule]
    VERIFICATION_RULE_REJECTION: _ClassVar[VerificationRule]
    VERIFICATION_RULE_COUPLED: _ClassVar[VerificationRule]

class SpeculationMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATION_MODE_UNSPECIFIED: _ClassVar[SpeculationMode]
    SPECULATION_MODE_FIXED: _ClassVar[SpeculationMode]
    SPECULATION_MODE_ADAPTIVE: _ClassVar[SpeculationMode]
VERIFICATION_RULE_UNSPECIFIED: VerificationRule
VERIFICATION_RULE_REJECTION: VerificationRule
VERIFICATION_RULE_COUPLED: VerificationRule
SPECULATION_MODE_UNSPECIFIED: SpeculationMode
SPECULATION_MODE_FIXED: SpeculationMode
SPECULATION_MODE_ADAPTIVE: SpeculationMode

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "rule")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    rule: VerificationRule
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., rule: _Optional[_Union[VerificationRule, str]] = ...) -> None: ...

class DraftDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("session_id", "prompt_token_ids", "sampling", "drafter", "lookahead")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    drafter: str
    lookahead: LookaheadParams
    def __init__(self, session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., drafter: _Optional[str] = ..., lookahead: _Optional[_Union[LookaheadParams, _Mapping]] = ...) -> None: ...

class LookaheadParams(_message.Message):
    __slots__ = ("window", "ngram", "candidates")
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    NGRAM_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    window: int
    ngram: int
    candidates: int
    def __init__(self, window: _Optional[int] = ..., ngram: _Optional[int] = ..., candidates: _Optional[int] = ...) -> None: ...

class WorkerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("active_sessions", "model", "vocab_size", "context_length", "drafters")
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    active_sessions: int
    model: str
    vocab_size: int
    context_length: int
    drafters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, active_sessions: _Optional[int] = ..., model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., context_length: _Optional[int] = ..., drafters: _Optional[_Iterable[str]] = ...) -> None: ...

class SpeculationPolicy(_message.Message):
    __slots__ = ("mode", "num_speculative_tokens", "max_speculative_tokens", "overlap")
    MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    mode: SpeculationMode
    num_speculative_tokens: int
    max_speculative_tokens: int
    overlap: bool
    def __init__(self, mode: _Optional[_Union[SpeculationMode, str]] = ..., num_speculative_tokens: _Optional[int] = ..., max_speculative_tokens: _Optional[int] = ..., overlap: _Optional[bool] = ...) -> None: ...
