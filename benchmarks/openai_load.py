"""One load generator for any OpenAI-compatible completions server (specdec's HTTP API, `vllm serve`):
N concurrent streams, each sending greedy `POST /v1/completions` with `stream: true`, read as
server-sent events with httpx. Per level: aggregate tokens/s, time to first token and inter-token
latency p50/p99, and the text each prompt got.

Definitions (the same for every server, so numbers compare):
- TTFT: from sending the request to the first event that carries a generated token.
- Inter-token latency (ITL): an event that arrives g seconds after the previous token-carrying event
  and carries n tokens (n > 1 under speculation, where a step's accepted tokens come together) counts
  as n samples of g / n. Percentiles are over every such sample of every request of the level.
- tokens/s: every generated token of the level over the level's wall time (first request sent to last
  stream closed).
Tokens are counted from each event's `token_ids` (specdec always sends them; vLLM with
`return_token_ids: true`), else one per event with text.

Used by benchmarks/bench_vllm_cpu.py; the pure parts (sse_event, percentile, StreamRecord.gaps,
summarize) are tested in tests/test_openai_load.py.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field

DONE = "[DONE]"


def sse_event(line: str) -> dict | str | None:
    """One line of a server-sent event stream -> its JSON payload, DONE for ``data: [DONE]``, or None
    (comments, ``id:``/``event:`` lines, blank separators)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == DONE:
        return DONE
    return json.loads(data) if data else None


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default); nan when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class StreamRecord:
    """One request as the client saw it: when each token-carrying event came and what it carried."""

    prompt_index: int
    sent: float  # perf_counter when the request was sent
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (perf_counter, tokens in that event)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    usage_tokens: int | None = None  # the final usage chunk's completion_tokens, where sent
    finish_reason: str | None = None
    error: str | None = None
    end: float | None = None

    def add(self, now: float, choice: dict) -> None:
        ids = choice.get("token_ids")
        text = choice.get("text") or ""
        n = len(ids) if ids is not None else int(bool(text))
        if ids:
            self.token_ids.extend(ids)
        self.text += text
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
        if n:
            self.arrivals.append((now, n))

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.arrivals)

    @property
    def ttft(self) -> float | None:
        return self.arrivals[0][0] - self.sent if self.arrivals else None

    def gaps(self) -> list[float]:
        """Inter-token latency samples: each event after the first, gap g carrying n tokens -> n x g / n."""
        out: list[float] = []
        for (t_prev, _), (t, n) in zip(self.arrivals, self.arrivals[1:]):
            out.extend([(t - t_prev) / n] * n)
        return out


def summarize(records: list[StreamRecord], wall_s: float) -> dict:
    """A level's numbers from its requests (failed ones counted apart, their tokens still counted)."""
    ok = [r for r in records if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps()]
    tokens = sum(r.tokens for r in records)
    texts: dict[int, list[str]] = {}
    for r in ok:
        if r.text not in texts.setdefault(r.prompt_index, []):
            texts[r.prompt_index].append(r.text)
    mismatched_usage = sum(1 for r in ok if r.usage_tokens is not None and r.usage_tokens != r.tokens)
    return {"requests": len(records), "errors": len(records) - len(ok),
            "error_samples": sorted({r.error for r in records if r.error})[:5],
            "tokens": tokens, "seconds": wall_s, "tokens_per_s": tokens / wall_s if wall_s > 0 else float("nan"),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
            "e2e_p50_s": percentile([r.end - r.sent for r in ok if r.end is not None], 50),
            "tokens_per_event": tokens / max(1, sum(len(r.arrivals) for r in records)),
            "usage_count_mismatches": mismatched_usage,
            # a prompt sent more than once in a level has one text, unless the server is not deterministic
            "texts": {str(i): t[0] if len(t) == 1 else t for i, t in sorted(texts.items())}}


async def stream_one(client, url: str, body: dict, prompt_index: int) -> StreamRecord:
    """One streamed completion; an HTTP or transport error is recorded on the record, not raised."""
    rec = StreamRecord(prompt_index, time.perf_counter())
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                await reply.aread()
                rec.error = f"HTTP {reply.status_code}: {reply.text[:200]}"
                return rec
            async for line in reply.aiter_lines():
                event = sse_event(line)
                if event is None:
                    continue
                if event == DONE:
                    break
                now = time.perf_counter()
                if "error" in event:
                    rec.error = f"stream error: {json.dumps(event['error'])[:200]}"
                    break
                for choice in event.get("choices") or []:
                    rec.add(now, choice)
                if event.get("usage"):
                    rec.usage_tokens = event["usage"].get("completion_tokens")
    except Exception as e:  # noqa: BLE001  a load test reports failures, it does not stop on the first
        rec.error = f"{type(e).__name__}: {e}"[:200]
    rec.end = time.perf_counter()
    return rec


def request_body(model: str, prompt: str, max_tokens: int) -> dict:
    """Greedy, streamed, with token ids and a usage chunk (fields both servers read)."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}


async def run_level(client, url: str, model: str, prompts: list[str], streams: int, max_tokens: int,
                    requests_per_stream: int = 1) -> dict:
    """``streams`` clients at once, each sending ``requests_per_stream`` requests one after another
    (client i's j-th request: prompt (i * requests_per_stream + j) mod len(prompts))."""
    records: list[StreamRecord] = []

    async def client_loop(i: int) -> None:
        for j in range(requests_per_stream):
            p = (i * requests_per_stream + j) % len(prompts)
            records.append(await stream_one(client, url, request_body(model, prompts[p], max_tokens), p))

    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop(i) for i in range(streams)))
    return summarize(records, time.perf_counter() - t0)


async def served_model(client, url: str) -> str:
    """The first model /v1/models lists (the name requests must carry)."""
    reply = await client.get(url + "/v1/models")
    reply.raise_for_status()
    return reply.json()["data"][0]["id"]
