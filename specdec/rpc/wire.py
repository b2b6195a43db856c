"""Protobuf <-> core dataclasses, at the edge only (TGI's from_pb / to_pb). Core code never sees *_pb2."""
from __future__ import annotations

from specdec.core import features
from specdec.core.errors import InvalidRequest
from specdec.core.sampling import SamplingParams, VerificationRule
from specdec.core.speculation import SpeculationMode, SpeculationPolicy
from specdec.core.steps import (
    MAX_DISTRIBUTION_ENTRIES,
    MAX_FALLBACK_DRAFTERS,
    MAX_STEP_TOKENS,
    DraftBlock,
    DraftProposal,
    LookaheadParams,
    SessionRun,
    SessionSpec,
    SparseDistribution,
    StepCommit,
    StepOutcome,
    WorkerInfo,
)
from specdec.v1 import common_pb2, drafter_pb2, verifier_pb2

_MODE = {common_pb2.SPECULATION_MODE_FIXED: SpeculationMode.FIXED, common_pb2.SPECULATION_MODE_ADAPTIVE: SpeculationMode.ADAPTIVE}
_MODE_PB = {v: k for k, v in _MODE.items()}


_RULE = {common_pb2.VERIFICATION_RULE_REJECTION: VerificationRule.REJECTION,
         common_pb2.VERIFICATION_RULE_COUPLED: VerificationRule.COUPLED}
_RULE_PB = {v: k for k, v in _RULE.items()}


def sampling_from_pb(pb: common_pb2.SamplingParams, default_seed: int = 0) -> SamplingParams:
    """Unset rule: coupled (seed-exact; on the demo pair its acceptance is on par with the rejection rule's)."""
    if pb.rule != common_pb2.VERIFICATION_RULE_UNSPECIFIED and pb.rule not in _RULE:  # proto3 enums are open
        raise InvalidRequest(f"sampling.rule {pb.rule} is unknown: use VERIFICATION_RULE_REJECTION or VERIFICATION_RULE_COUPLED")
    return SamplingParams(
        temperature=pb.temperature,
        top_k=pb.top_k,
        top_p=pb.top_p if pb.top_p != 0 else 1.0,
        seed=pb.seed if pb.HasField("seed") else default_seed,
        rule=_RULE.get(pb.rule, VerificationRule.COUPLED),
    )


def sampling_to_pb(s: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed, rule=_RULE_PB[s.rule])


def policy_from_pb(msg: common_pb2.SpeculationPolicy, default: SpeculationPolicy) -> SpeculationPolicy:
    """Unset fields take ``default``'s values; validation is SpeculationPolicy's own."""
    if msg.mode != common_pb2.SPECULATION_MODE_UNSPECIFIED and msg.mode not in _MODE:  # proto3 enums are open
        raise InvalidRequest(f"speculation.mode {msg.mode} is unknown: use SPECULATION_MODE_FIXED or SPECULATION_MODE_ADAPTIVE")
    mode = _MODE.get(msg.mode, default.mode)
    k = msg.num_speculative_tokens if msg.HasField("num_speculative_tokens") else default.num_speculative_tokens
    k_max = msg.max_speculative_tokens or max(default.max_speculative_tokens, k)
    overlap = msg.overlap if msg.HasField("overlap") else default.overlap
    return SpeculationPolicy(mode, k, k_max, default.draft_cost_ratio, overlap)


def policy_to_pb(p: SpeculationPolicy) -> common_pb2.SpeculationPolicy:
    return common_pb2.SpeculationPolicy(mode=_MODE_PB[p.mode], num_speculative_tokens=p.num_speculative_tokens,
                                        max_speculative_tokens=p.max_speculative_tokens, overlap=p.overlap)


def spec_from_pb(pb: common_pb2.OpenSessionRequest) -> SessionSpec:
    return SessionSpec(pb.session_id, tuple(pb.prompt_token_ids), sampling_from_pb(pb.sampling), pb.drafter,
                       lookahead_from_pb(pb.lookahead))


def spec_to_pb(spec: SessionSpec) -> common_pb2.OpenSessionRequest:
    return common_pb2.OpenSessionRequest(session_id=spec.session_id, prompt_token_ids=spec.prompt_ids,
                                         sampling=sampling_to_pb(spec.sampling), drafter=spec.drafter,
                                         lookahead=lookahead_to_pb(spec.lookahead))


def lookahead_from_pb(pb: common_pb2.LookaheadParams) -> LookaheadParams:
    return LookaheadParams(pb.window, pb.ngram, pb.candidates)  # (checked: InvalidRequest out of bounds)


def lookahead_to_pb(p: LookaheadParams) -> common_pb2.LookaheadParams:
    return common_pb2.LookaheadParams(window=p.window, ngram=p.ngram, candidates=p.candidates)


def _dists_to_pb(dists: tuple[SparseDistribution, ...] | None) -> list[common_pb2.DraftDistribution]:
    return [common_pb2.DraftDistribution(token_ids=d.token_ids, probs=d.probs) for d in dists or ()]


def _dists_from_pb(pbs) -> tuple[SparseDistribution, ...] | None:
    if not pbs:
        return None
    return tuple(SparseDistribution(tuple(d.token_ids), tuple(d.probs)) for d in pbs)


def block_to_pb(b: DraftBlock) -> drafter_pb2.DraftBlock:
    p = b.proposal
    return drafter_pb2.DraftBlock(anchor_len=b.anchor_len, assumed_ids=b.assumed_ids, draft_token_ids=p.token_ids,
                                  draft_distributions=_dists_to_pb(p.distributions), draft_time_ns=p.draft_time_ns,
                                  parent_indices=p.parents)


def block_from_pb(pb: drafter_pb2.DraftBlock) -> DraftBlock:
    """A block from a drafter, its sizes checked before anything is copied (a drafter may misbehave)."""
    if len(pb.draft_token_ids) > MAX_STEP_TOKENS or len(pb.assumed_ids) > MAX_STEP_TOKENS:
        raise InvalidRequest(f"a draft block carries at most {MAX_STEP_TOKENS} draft and {MAX_STEP_TOKENS} assumed tokens, "
                             f"got {len(pb.draft_token_ids)} and {len(pb.assumed_ids)}")
    if len(pb.draft_distributions) > len(pb.draft_token_ids) or any(
            max(len(d.token_ids), len(d.probs)) > MAX_DISTRIBUTION_ENTRIES for d in pb.draft_distributions):
        raise InvalidRequest(f"a draft block carries one distribution per draft token, each of at most "
                             f"{MAX_DISTRIBUTION_ENTRIES} entries")
    if pb.parent_indices and len(pb.parent_indices) != len(pb.draft_token_ids):
        raise InvalidRequest(f"a token tree's block carries one parent index per draft token: {len(pb.draft_token_ids)} "
                             f"tokens, {len(pb.parent_indices)} parent indices")
    try:
        proposal = DraftProposal(tuple(pb.draft_token_ids), _dists_from_pb(pb.draft_distributions), pb.draft_time_ns,
                                 parents=tuple(pb.parent_indices))
    except ValueError as exc:  # a malformed tree
        raise InvalidRequest(f"bad token tree in a draft block: {exc}") from exc
    return DraftBlock(pb.anchor_len, tuple(pb.assumed_ids), proposal)


def outcome_to_pb(o: StepOutcome) -> drafter_pb2.SpeculateRequest:
    pb = drafter_pb2.StepOutcome(committed_len=o.committed_len, token_ids=o.token_ids,
                                 num_speculative_tokens=o.num_speculative_tokens, overlap=o.overlap,
                                 row_argmax=o.row_argmax, verified_ids=o.verified_ids, verified_parents=o.verified_parents)
    if o.features is not None:
        first, width, data = features.encode(o.features)
        pb.features.CopyFrom(drafter_pb2.FeatureChunk(first_position=first, width=width, bfloat16=data))
    return drafter_pb2.SpeculateRequest(outcome=pb)


def outcome_from_pb(pb: drafter_pb2.StepOutcome) -> StepOutcome:
    chunk = None
    if pb.HasField("features"):
        f = pb.features
        chunk = features.decode(f.first_position, f.width, f.bfloat16)
        if chunk.end > pb.committed_len:
            raise InvalidRequest(f"features reach position {chunk.end - 1}, past the {pb.committed_len} committed tokens")
    rows, ids, parents = tuple(pb.row_argmax), tuple(pb.verified_ids), tuple(pb.verified_parents)
    if len(rows) >= MAX_STEP_TOKENS or len(ids) != len(rows) or (parents and len(parents) != len(ids)):
        raise InvalidRequest(f"row_argmax ({len(rows)}) and verified_ids ({len(ids)}) must be of one length below "
                             f"{MAX_STEP_TOKENS}, verified_parents empty or as long ({len(parents)})")
    return StepOutcome(pb.committed_len, tuple(pb.token_ids), pb.num_speculative_tokens, pb.overlap, chunk, rows, ids, parents)


MAX_DNS_NAME_CHARS = 253
MAX_ADDRESS_CHARS = MAX_DNS_NAME_CHARS + 8  # host:port, an IPv6 host in brackets


def run_to_pb(r: SessionRun) -> verifier_pb2.SessionRequest:
    return verifier_pb2.SessionRequest(session=spec_to_pb(r.spec), drafter_address=r.drafter_address, max_new_tokens=r.max_new_tokens,
                                       speculation=policy_to_pb(r.policy), stop_token_ids=r.stop_token_ids,
                                       drafter_server_name=r.drafter_server_name,
                                       fallback_drafters=[verifier_pb2.DrafterEndpoint(address=a, server_name=n)
                                                          for a, n in r.fallback_drafters])


def _fallbacks_from_pb(endpoints) -> tuple[tuple[str, str], ...]:
    if len(endpoints) > MAX_FALLBACK_DRAFTERS:
        raise InvalidRequest(f"SessionRequest.fallback_drafters names {len(endpoints)} drafters; send at most "
                             f"{MAX_FALLBACK_DRAFTERS}")
    if any(len(e.address) > MAX_ADDRESS_CHARS or len(e.server_name) > MAX_DNS_NAME_CHARS for e in endpoints):
        raise InvalidRequest(f"a fallback drafter's address is over {MAX_ADDRESS_CHARS} characters or its server_name over "
                             f"{MAX_DNS_NAME_CHARS}: send host:port and a DNS name")
    return tuple((e.address, e.server_name) for e in endpoints if e.address)


def run_from_pb(pb: verifier_pb2.SessionRequest) -> SessionRun:
    if not pb.HasField("session"):
        raise InvalidRequest("SessionRequest.session is missing: send the session id, prompt and sampling")
    if not pb.HasField("speculation"):
        raise InvalidRequest("SessionRequest.speculation is missing: send the speculation policy")
    return SessionRun(spec_from_pb(pb.session), pb.drafter_address, pb.max_new_tokens,
                      policy_from_pb(pb.speculation, SpeculationPolicy()), tuple(pb.stop_token_ids),
                      pb.drafter_server_name[:MAX_DNS_NAME_CHARS],
                      _fallbacks_from_pb(pb.fallback_drafters))


def commit_to_pb(c: StepCommit) -> verifier_pb2.StepCommit:
    return verifier_pb2.StepCommit(token_ids=c.token_ids, num_draft_tokens=c.num_draft_tokens, num_accepted=c.num_accepted,
                                   committed_len=c.committed_len, verify_time_ns=c.verify_time_ns, draft_wait_ns=c.draft_wait_ns,
                                   predrafted=c.predrafted, finished=c.finished)


def commit_from_pb(pb: verifier_pb2.StepCommit) -> StepCommit:
    return StepCommit(tuple(pb.token_ids), pb.num_draft_tokens, pb.num_accepted, pb.committed_len, pb.verify_time_ns,
                      pb.draft_wait_ns, pb.predrafted, pb.finished)


def worker_info_to_pb(w: WorkerInfo) -> common_pb2.WorkerStatus:
    return common_pb2.WorkerStatus(active_sessions=w.active_sessions, model=w.model, vocab_size=w.vocab_size,
                                   context_length=w.context_length, drafters=w.drafters)


def worker_info_from_pb(pb: common_pb2.WorkerStatus) -> WorkerInfo:
    return WorkerInfo(pb.active_sessions, pb.model, pb.vocab_size, pb.context_length, tuple(pb.drafters))
