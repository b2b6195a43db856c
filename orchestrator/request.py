"""A generation request as the loop sees it, validated once at the edge."""
from __future__ import annotations

from dataclasses import dataclass, field

from specdec.core.errors import InvalidRequest
from specdec.core.sampling import SamplingParams, VerificationRule
from specdec.core.sessions import SessionRecord
from specdec.core.speculation import SpeculationMode, SpeculationPolicy
from specdec.core.steps import LookaheadParams


DEFAULT_STORE_RETRY_S = 5.0  # a store restart


@dataclass(frozen=True)
class OrchestratorConfig:
    """Limits and defaults of one orchestrator. Built once, passed explicitly."""

    max_new_tokens_limit: int = 2048
    default_max_new_tokens: int = 128
    default_drafter: str = "model"
    default_policy: SpeculationPolicy = field(default_factory=SpeculationPolicy)
    max_concurrent_requests: int = 64
    max_waiting_requests: int = 256  # in line for a running slot (FIFO); past that, RESOURCE_EXHAUSTED
    max_stop_sequences: int = 8
    max_stop_length: int = 64  # bytes of UTF-8
    max_prompt_token_ids: int = 1 << 18  # checked before the ids are copied out of the message
    max_prompt_bytes: int = 1 << 20  # checked before the prompt is tokenized
    max_drafter_name_chars: int = 64
    session_ttl_s: float = 3600.0
    # A running session that committed nothing for this long has lost its orchestrator: another may resume it.
    resume_lease_s: float = 10.0
    # A store call that fails (Redis restarting, failing over) is tried again this long before the
    # stream fails. None: the store's own failover time (roles.start_orchestrator reads a Redis
    # store's from it), else DEFAULT_STORE_RETRY_S.
    store_retry_s: float | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """Either ``prompt_text`` or ``prompt_ids`` (exactly one is set)."""

    prompt_text: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed_given: bool = False  # False: the server picked sampling.seed
    stop: tuple[str, ...] = ()
    drafter: str = ""
    policy: SpeculationPolicy = field(default_factory=SpeculationPolicy)
    lookahead: LookaheadParams = field(default_factory=LookaheadParams)  # drafter `lookahead` only
    owner: str = ""  # who made the request (specdec.rpc.auth.principal of its API key); "" without keys

    def validate(self, config: OrchestratorConfig) -> None:
        if (self.prompt_text is None) == (self.prompt_ids is None):
            raise InvalidRequest("send the prompt as text or as token ids (exactly one)")
        if self.prompt_text is not None and not self.prompt_text:
            raise InvalidRequest("prompt is empty: send some text")
        if self.prompt_text is not None and (len(self.prompt_text) > config.max_prompt_bytes
                                             or len(self.prompt_text.encode("utf-8", "surrogatepass")) > config.max_prompt_bytes):
            raise InvalidRequest(f"prompt text is over {config.max_prompt_bytes} bytes, this server's limit: send a shorter prompt")
        if len(self.drafter) > config.max_drafter_name_chars:
            raise InvalidRequest(f"drafter name is over {config.max_drafter_name_chars} characters: name a drafter this server serves")
        if self.prompt_ids is not None and not self.prompt_ids:
            raise InvalidRequest("prompt is empty: send at least one token id")
        if self.prompt_ids is not None and len(self.prompt_ids) > config.max_prompt_token_ids:
            raise InvalidRequest(f"the prompt has {len(self.prompt_ids)} token ids; this server takes at most "
                                 f"{config.max_prompt_token_ids}: send a shorter prompt")
        if not 1 <= self.max_new_tokens <= config.max_new_tokens_limit:
            raise InvalidRequest(f"max_new_tokens must be in [1, {config.max_new_tokens_limit}], got {self.max_new_tokens}")
        if len(self.stop) > config.max_stop_sequences:
            raise InvalidRequest(f"at most {config.max_stop_sequences} stop sequences, got {len(self.stop)}")
        for s in self.stop:
            size = len(s.encode("utf-8", "surrogatepass")) if len(s) <= config.max_stop_length else len(s)
            if not 1 <= size <= config.max_stop_length:
                raise InvalidRequest(f"each stop sequence must be 1 to {config.max_stop_length} bytes of UTF-8, got {size}")


def params_json(request: GenerationRequest, drafter: str) -> dict:
    """What a session's record keeps of its request: enough to continue it anywhere (request_from_record)."""
    s = request.sampling
    return {
        "owner": request.owner,
        "max_new_tokens": request.max_new_tokens,
        "sampling": {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "rule": s.rule.value},
        "seed_given": request.seed_given,
        "stop": list(request.stop),
        "drafter": drafter,
        "lookahead": [request.lookahead.window, request.lookahead.ngram, request.lookahead.candidates],
        "speculation": {
            "mode": request.policy.mode.value,
            "num_speculative_tokens": request.policy.num_speculative_tokens,
            "max_speculative_tokens": request.policy.max_speculative_tokens,
            "overlap": request.policy.overlap,
        },
    }


def request_from_record(record: SessionRecord) -> GenerationRequest:
    """The request a session was started with, rebuilt from its record (the prompt as token ids)."""
    p = record.params
    try:
        s, spec = p["sampling"], p["speculation"]
        sampling = SamplingParams(float(s["temperature"]), int(s["top_k"]), float(s["top_p"]), record.seed,
                                  VerificationRule(s["rule"]))
        policy = SpeculationPolicy(SpeculationMode(spec["mode"]), int(spec["num_speculative_tokens"]),
                                   int(spec["max_speculative_tokens"]), overlap=bool(spec["overlap"]))
        return GenerationRequest(prompt_ids=tuple(record.prompt_ids), max_new_tokens=int(p["max_new_tokens"]), sampling=sampling,
                                 seed_given=bool(p["seed_given"]), stop=tuple(p["stop"]), drafter=str(p["drafter"]),
                                 policy=policy, owner=str(p.get("owner", "")),
                                 lookahead=LookaheadParams(*(int(x) for x in p.get("lookahead", (0, 0, 0)))))
    except (KeyError, TypeError, ValueError, InvalidRequest) as exc:
        from specdec.core.errors import CorruptRecord

        raise CorruptRecord(f"the session's record cannot be continued: its parameters are incomplete ({exc})") from None
