"""OpenAI-style JSON <-> the loop's dataclasses: the HTTP API's edge, as convert.py is gRPC's.

Only the JSON's shape is checked here (types, text that is valid Unicode, what OpenAI's API has
that specdec does not do); every limit and value is checked where the gRPC API's are, by
GenerationRequest.validate, SamplingParams and SpeculationPolicy, so the two APIs cannot drift apart. Field names follow OpenAI's API; the
extras (``top_k``, ``rule``, ``drafter``, ``speculation``) take the gRPC API's names and values.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from specdec.core.errors import InvalidRequest
from specdec.core.sampling import SamplingParams, VerificationRule
from specdec.core.sessions import SpecCounters
from specdec.core.speculation import SpeculationMode, SpeculationPolicy
from specdec.orchestrator.loop import Chunk, FinishReason
from specdec.orchestrator.request import GenerationRequest, OrchestratorConfig

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; send 0 for greedy
_MODES = {"fixed": SpeculationMode.FIXED, "adaptive": SpeculationMode.ADAPTIVE,
          "SPECULATION_MODE_FIXED": SpeculationMode.FIXED, "SPECULATION_MODE_ADAPTIVE": SpeculationMode.ADAPTIVE}
_RULES = {"coupled": VerificationRule.COUPLED, "rejection": VerificationRule.REJECTION,
          "VERIFICATION_RULE_COUPLED": VerificationRule.COUPLED, "VERIFICATION_RULE_REJECTION": VerificationRule.REJECTION}
# OpenAI parameters specdec does not do, and the value that means "not used". Anything else is a 400:
# penalties and logit biases would change the target's distribution, which specdec keeps exactly.
_UNSUPPORTED = {"best_of": (None, 1), "echo": (None, False), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
                "suffix": (None, ""), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
                "logit_bias": (None,), "tools": (None,), "functions": (None,), "tool_choice": (None, "none"),
                "response_format": (None, {"type": "text"})}
_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ApiRequest:
    """One request to /v1/completions or /v1/chat/completions, its JSON checked for shape."""

    generation: GenerationRequest  # for chat: no prompt yet (the template makes it, off the event loop)
    model: str | None
    stream: bool
    include_usage: bool
    messages: tuple[dict, ...] | None = None  # chat only


class InvalidText(InvalidRequest):
    """A string of the body that is not valid Unicode; ``field`` names it as a JSON path (``messages[0].content``)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def check_text(body, bytes_escaped: bool = False) -> None:
    """InvalidText for the first string of ``body`` (a value or a key, at any depth) that is not
    valid Unicode: a lone surrogate, which JSON's ``\\ud800`` escapes can spell, and which no
    tokenizer takes and no reply can carry as UTF-8. ``bytes_escaped``: the body's bytes were not
    UTF-8 and were decoded with ``surrogateescape``, so U+DC80-U+DCFF stand for those bytes."""
    stack = [(body, "")]
    while stack:  # no recursion: JSON nests as deep as the body allows
        value, path = stack.pop()
        if isinstance(value, str):
            _check_string(value, path or "the body", bytes_escaped)
        elif isinstance(value, dict):
            for key in value:
                _check_string(key, f"a key of {path or 'the body'}", bytes_escaped)
            stack.extend((item, f"{path}.{key}" if path else key) for key, item in reversed(value.items())
                         if isinstance(item, (str, dict, list)))
        elif isinstance(value, list):  # a prompt of token ids is a long list of ints: only text and containers are kept
            stack.extend((item, f"{path}[{i}]") for i, item in reversed(list(enumerate(value)))
                         if isinstance(item, (str, dict, list)))


def _check_string(text: str, field: str, bytes_escaped: bool) -> None:
    if text.isascii():
        return
    field = field if len(field) <= 200 else field[:199] + "…"  # a client's keys: echoed, so bounded
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = ord(text[exc.start])
        if bytes_escaped and 0xDC80 <= char <= 0xDCFF:
            raise InvalidText(f"{field} is not valid UTF-8: it holds a byte that is not UTF-8 (0x{char - 0xDC00:02x}) at "
                              f"character {exc.start}; send UTF-8 text", field) from None
        raise InvalidText(f"{field} is not valid Unicode: it holds a lone surrogate at character {exc.start}; "
                          "send UTF-8 text", field) from None


def _field(body: dict, name: str, types: tuple[type, ...], what: str):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        raise InvalidRequest(f"{name} must be {what}, got {type(value).__name__}")
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = _field(body, name, (int, float), "a number")
    return default if value is None else float(value)


def _int(body: dict, name: str, default: int) -> int:
    value = _field(body, name, (int,), "an integer")
    return default if value is None else value


def _check_unsupported(body: dict) -> None:
    n = _int(body, "n", 1)
    if n != 1:
        raise InvalidRequest(f"n must be 1 (one completion per request), got {n}: send n requests instead")
    for name, unused in _UNSUPPORTED.items():
        value = body.get(name)
        if value not in unused and value not in ([], {}):
            raise InvalidRequest(f"{name} is not supported by this server: leave it out")


def _prompt(value) -> tuple[str | None, tuple[int, ...] | None]:
    """``prompt``: text, token ids, or a list of one of those."""
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        if len(value) != 1:
            raise InvalidRequest(f"prompt holds {len(value)} prompts; send one prompt per request")
        value = value[0]
    if isinstance(value, str):
        return value, None
    if isinstance(value, list):  # its length is checked by GenerationRequest.validate (the body's size bounds it)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise InvalidRequest("prompt must be a string or a list of token ids (integers)")
        return None, tuple(value)
    raise InvalidRequest("prompt is missing: send a string or a list of token ids")


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise InvalidRequest("stop must be a string or a list of strings")
    return tuple(stop)  # how many and how long: GenerationRequest.validate


def _policy(value, default: SpeculationPolicy) -> SpeculationPolicy:
    """``speculation``: as the gRPC API's SpeculationPolicy (unset fields: the server's default)."""
    if value is None:
        return default
    if not isinstance(value, dict):
        raise InvalidRequest("speculation must be an object: {mode, num_speculative_tokens, max_speculative_tokens, overlap}")
    mode = value.get("mode")
    if mode is not None and mode not in _MODES:
        raise InvalidRequest(f"speculation.mode must be \"fixed\" or \"adaptive\", got {str(mode)[:40]!r}")
    k = _int(value, "num_speculative_tokens", default.num_speculative_tokens)
    k_max = _int(value, "max_speculative_tokens", 0) or max(default.max_speculative_tokens, k)
    overlap = _field(value, "overlap", (bool,), "true or false")
    return SpeculationPolicy(_MODES.get(mode, default.mode), k, k_max, default.draft_cost_ratio,
                             default.overlap if overlap is None else overlap)


def _messages(value, config: OrchestratorConfig) -> tuple[dict, ...]:
    """Chat messages as a chat template takes them: role and text content (text parts joined)."""
    if not isinstance(value, list) or not value:
        raise InvalidRequest("messages must be a non-empty list of {role, content}")
    out, size = [], 0
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise InvalidRequest(f"messages[{i}] must be an object with a role in {list(_ROLES)}")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise InvalidRequest(f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string or a list of text parts")
        size += len(content.encode("utf-8", "surrogatepass"))
        if size > config.max_prompt_bytes:  # before the template runs, as text is before tokenizing
            raise InvalidRequest(f"the messages are over {config.max_prompt_bytes} bytes, this server's limit: send shorter ones")
        out.append({"role": m["role"], "content": content})
    return tuple(out)


def request_from_json(body, config: OrchestratorConfig, chat: bool) -> ApiRequest:
    """A completions (``chat`` False) or chat completions body -> the request the loop runs."""
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    check_text(body)  # before any field is read, echoed or tokenized
    _check_unsupported(body)
    model = _field(body, "model", (str,), "a string")
    _field(body, "user", (str,), "a string")  # accepted, not used
    stream = bool(_field(body, "stream", (bool,), "true or false"))
    options = _field(body, "stream_options", (dict,), "an object") or {}
    include_usage = bool(_field(options, "include_usage", (bool,), "true or false"))
    max_tokens = _field(body, "max_completion_tokens", (int,), "an integer")
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", config.default_max_new_tokens)
    seed = _field(body, "seed", (int,), "an integer")
    rule = body.get("rule")
    if rule is not None and rule not in _RULES:
        raise InvalidRequest(f"rule must be \"coupled\" or \"rejection\", got {str(rule)[:40]!r}")
    top_k = _int(body, "top_k", 0)
    sampling = SamplingParams(temperature=_number(body, "temperature", DEFAULT_TEMPERATURE), top_k=0 if top_k == -1 else top_k,
                              top_p=_number(body, "top_p", 1.0), seed=secrets.randbits(63) if seed is None else seed,
                              rule=_RULES.get(rule, VerificationRule.COUPLED))
    text = ids = messages = None
    if chat:
        messages = _messages(body.get("messages"), config)
    else:
        text, ids = _prompt(body.get("prompt"))
    generation = GenerationRequest(prompt_text=text, prompt_ids=ids, max_new_tokens=max_tokens, sampling=sampling,
                                   seed_given=seed is not None, stop=_stop(body),
                                   drafter=_field(body, "drafter", (str,), "a string") or "",
                                   policy=_policy(body.get("speculation"), config.default_policy))
    return ApiRequest(generation, model, stream, include_usage, messages)


# ----------------------------------------------------------------------------- responses
@dataclass
class PositionStats:
    """Draft tokens proposed and accepted at each position of a block (0 = first), over the steps a
    stream saw (after a resume: the steps since; the totals cover the whole session)."""

    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def add(self, chunk: Chunk) -> None:
        for i in range(chunk.num_draft_tokens):
            if i == len(self.proposed):
                self.proposed.append(0)
                self.accepted.append(0)
            self.proposed[i] += 1
            self.accepted[i] += i < chunk.num_accepted


def spec_decode_json(c: SpecCounters, positions: PositionStats, drafter: str, last_k: int) -> dict:
    """The ``spec_decode`` field (docs/http-api.md): a request's speculation, as vLLM's per-request metrics give it."""
    return {
        "drafter": drafter,
        "num_drafts": c.drafts,
        "draft_tokens": c.draft_tokens,
        "accepted_tokens": c.accepted_tokens,
        "acceptance_rate": round(c.acceptance_rate, 6),
        "mean_accepted_length": round(c.mean_accepted_length, 6),
        "verify_steps": c.verify_steps,
        "accepted_by_position": list(positions.accepted),
        "acceptance_by_position": [round(a / p, 6) for a, p in zip(positions.accepted, positions.proposed)],
        "predrafted_steps": c.predrafted_steps,
        "last_num_speculative_tokens": last_k,
        "verify_time_ms": round(c.verify_time_ns / 1e6, 3),
        "draft_wait_time_ms": round(c.draft_wait_ns / 1e6, 3),
    }


def finish_reason(reason: FinishReason | None) -> str | None:
    """OpenAI's words: a full context is a length limit too."""
    if reason is None:
        return None
    return "stop" if reason is FinishReason.STOP else "length"


def usage_json(last: Chunk) -> dict:
    return {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
            "total_tokens": last.prompt_tokens + last.completion_tokens}


@dataclass
class ResponseShape:
    """How one endpoint's objects look: completions or chat, for one model and session."""

    chat: bool
    model: str
    session_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.session_id

    def _envelope(self, stream: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if stream and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "session_id": self.session_id}

    def whole(self, last: Chunk, token_ids: tuple[int, ...], text: str, stats: dict) -> dict:
        """A unary response."""
        choice: dict = {"index": 0, "finish_reason": finish_reason(last.finish_reason), "token_ids": list(token_ids)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice.update(text=text, logprobs=None)
        return {**self._envelope(False), "choices": [choice], "usage": usage_json(last), "seed": last.seed, "spec_decode": stats}

    def chunk(self, chunk: Chunk, first: bool, stats: dict | None) -> dict:
        """One streamed chunk; the one that finishes carries the stats."""
        choice: dict = {"index": 0, "finish_reason": finish_reason(chunk.finish_reason), "token_ids": list(chunk.token_ids)}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": chunk.text} if first else {"content": chunk.text}
        else:
            choice.update(text=chunk.text, logprobs=None)
        out = {**self._envelope(True), "choices": [choice]}
        if stats is not None:
            out.update(seed=chunk.seed, spec_decode=stats)
        return out

    def usage_chunk(self, last: Chunk, stats: dict) -> dict:
        """``stream_options.include_usage``: a last chunk with no choices, the usage and the stats."""
        return {**self._envelope(True), "choices": [], "usage": usage_json(last), "seed": last.seed, "spec_decode": stats}
