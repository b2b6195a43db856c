"""Protobuf <-> core dataclasses, at the edge only (TGI's from_pb / to_pb). Core code never sees *_pb2."""
from __future__ import annotations

from specdec.core.sampling import SamplingParams
from specdec.core.steps import DraftProposal, SequenceSync, SessionSpec, SparseDistribution, VerifyOutcome, WorkerInfo
from specdec.v1 import common_pb2, drafter_pb2, verifier_pb2


def sampling_from_pb(pb: common_pb2.SamplingParams, default_seed: int = 0) -> SamplingParams:
    return SamplingParams(
        temperature=pb.temperature,
        top_k=pb.top_k,
        top_p=pb.top_p if pb.top_p != 0 else 1.0,
        seed=pb.seed if pb.HasField("seed") else default_seed,
    )


def sampling_to_pb(s: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed)


def spec_from_pb(pb: common_pb2.OpenSessionRequest) -> SessionSpec:
    return SessionSpec(pb.session_id, tuple(pb.prompt_token_ids), sampling_from_pb(pb.sampling), pb.drafter)


def spec_to_pb(spec: SessionSpec) -> common_pb2.OpenSessionRequest:
    return common_pb2.OpenSessionRequest(session_id=spec.session_id, prompt_token_ids=spec.prompt_ids,
                                         sampling=sampling_to_pb(spec.sampling), drafter=spec.drafter)


def sync_from_pb(pb: common_pb2.SequenceSync) -> SequenceSync:
    return SequenceSync(pb.base_len, tuple(pb.append_ids))


def sync_to_pb(sync: SequenceSync) -> common_pb2.SequenceSync:
    return common_pb2.SequenceSync(base_len=sync.base_len, append_ids=sync.append_ids)


def _dists_to_pb(dists: tuple[SparseDistribution, ...] | None) -> list[common_pb2.DraftDistribution]:
    return [common_pb2.DraftDistribution(token_ids=d.token_ids, probs=d.probs) for d in dists or ()]


def _dists_from_pb(pbs) -> tuple[SparseDistribution, ...] | None:
    if not pbs:
        return None
    return tuple(SparseDistribution(tuple(d.token_ids), tuple(d.probs)) for d in pbs)


def proposal_to_pb(p: DraftProposal) -> drafter_pb2.DraftResponse:
    return drafter_pb2.DraftResponse(draft_token_ids=p.token_ids, draft_distributions=_dists_to_pb(p.distributions),
                                     draft_time_ns=p.draft_time_ns)


def proposal_from_pb(pb: drafter_pb2.DraftResponse) -> DraftProposal:
    return DraftProposal(tuple(pb.draft_token_ids), _dists_from_pb(pb.draft_distributions), pb.draft_time_ns)


def verify_request_to_pb(session_id: str, sync: SequenceSync, p: DraftProposal) -> verifier_pb2.VerifyRequest:
    return verifier_pb2.VerifyRequest(session_id=session_id, sync=sync_to_pb(sync), draft_token_ids=p.token_ids,
                                      draft_distributions=_dists_to_pb(p.distributions))


def verify_request_from_pb(pb: verifier_pb2.VerifyRequest) -> tuple[str, SequenceSync, DraftProposal]:
    proposal = DraftProposal(tuple(pb.draft_token_ids), _dists_from_pb(pb.draft_distributions))
    return pb.session_id, sync_from_pb(pb.sync), proposal


def outcome_to_pb(o: VerifyOutcome) -> verifier_pb2.VerifyResponse:
    return verifier_pb2.VerifyResponse(token_ids=o.token_ids, num_accepted=o.num_accepted, committed_len=o.committed_len,
                                       verify_time_ns=o.verify_time_ns)


def outcome_from_pb(pb: verifier_pb2.VerifyResponse) -> VerifyOutcome:
    return VerifyOutcome(tuple(pb.token_ids), pb.num_accepted, pb.committed_len, pb.verify_time_ns)


def worker_info_to_pb(w: WorkerInfo) -> common_pb2.WorkerStatus:
    return common_pb2.WorkerStatus(active_sessions=w.active_sessions, model=w.model, vocab_size=w.vocab_size,
                                   context_length=w.context_length, drafters=w.drafters)


def worker_info_from_pb(pb: common_pb2.WorkerStatus) -> WorkerInfo:
    return WorkerInfo(pb.active_sessions, pb.model, pb.vocab_size, pb.context_length, tuple(pb.drafters))
