"""Client API protobuf <-> the loop's dataclasses."""
from __future__ import annotations

import secrets

from specdec.core.errors import InvalidRequest
from specdec.core.sessions import SessionRecord, SpecCounters
from specdec.orchestrator.loop import Chunk, FinishReason
from specdec.orchestrator.request import GenerationRequest, OrchestratorConfig
from specdec.rpc.wire import lookahead_from_pb, policy_from_pb, sampling_from_pb
from specdec.v1 import generation_pb2 as pb

_FINISH = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.CONTEXT_FULL: pb.FINISH_REASON_CONTEXT_FULL,
}


def request_from_pb(msg: pb.GenerateRequest, config: OrchestratorConfig) -> GenerationRequest:
    which = msg.WhichOneof("prompt")
    # Sizes first, before anything is copied out of the message (the rest is checked in validate()).
    if which == "token_ids" and len(msg.token_ids.ids) > config.max_prompt_token_ids:
        raise InvalidRequest(f"the prompt has {len(msg.token_ids.ids)} token ids; this server takes at most "
                             f"{config.max_prompt_token_ids}: send a shorter prompt")
    if len(msg.stop) > config.max_stop_sequences:
        raise InvalidRequest(f"at most {config.max_stop_sequences} stop sequences, got {len(msg.stop)}")
    seed_given = msg.sampling.HasField("seed")
    sampling = sampling_from_pb(msg.sampling, default_seed=secrets.randbits(63))
    return GenerationRequest(
        prompt_text=msg.text if which == "text" else None,  # neither set: validate() asks for a prompt
        prompt_ids=tuple(msg.token_ids.ids) if which == "token_ids" else None,
        max_new_tokens=msg.max_new_tokens,
        sampling=sampling,
        seed_given=seed_given,
        stop=tuple(msg.stop),
        drafter=msg.drafter,
        policy=policy_from_pb(msg.speculation, config.default_policy),
        lookahead=lookahead_from_pb(msg.lookahead),
    )


def stats_to_pb(c: SpecCounters, last_k: int = 0) -> pb.SpeculationStats:
    return pb.SpeculationStats(drafts=c.drafts, draft_tokens=c.draft_tokens, accepted_tokens=c.accepted_tokens,
                               verify_steps=c.verify_steps, mean_accepted_length=c.mean_accepted_length,
                               last_num_speculative_tokens=last_k, predrafted_steps=c.predrafted_steps,
                               verify_time_ms=c.verify_time_ns / 1e6, draft_wait_time_ms=c.draft_wait_ns / 1e6)


def chunk_to_pb(chunk: Chunk) -> pb.GenerateStreamResponse:
    msg = pb.GenerateStreamResponse(session_id=chunk.session_id, text=chunk.text, token_ids=chunk.token_ids, seed=chunk.seed)
    if chunk.finish_reason is not None:
        msg.finish_reason = _FINISH[chunk.finish_reason]
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=chunk.prompt_tokens, completion_tokens=chunk.completion_tokens))
        msg.stats.CopyFrom(stats_to_pb(chunk.counters, chunk.last_num_speculative_tokens))
    return msg


def response_to_pb(last: Chunk, token_ids: tuple[int, ...], text: str) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        session_id=last.session_id, text=text, token_ids=token_ids, finish_reason=_FINISH[last.finish_reason],
        usage=pb.Usage(prompt_tokens=last.prompt_tokens, completion_tokens=last.completion_tokens),
        stats=stats_to_pb(last.counters, last.last_num_speculative_tokens), seed=last.seed,
    )


def record_to_pb(r: SessionRecord) -> pb.SessionInfo:
    return pb.SessionInfo(session_id=r.session_id, status=r.status.value, prompt_token_ids=r.prompt_ids,
                          output_token_ids=r.output_ids, finish_reason=r.finish_reason, stats=stats_to_pb(r.counters),
                          seed=r.seed)
