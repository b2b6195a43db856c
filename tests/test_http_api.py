"""The OpenAI-compatible HTTP API (orchestrator/http.py) against real servers on loopback: the
session's test cluster (TLS on every hop, sessions in Redis) with HTTP beside its gRPC API, and more
orchestrators over the same workers and store. Clients: the real `openai` package and `httpx`.

Each claim of docs/http-api.md has a test here: text identical to the gRPC API's for the same
request (greedy and seeded), usage, the `spec_decode` field, every error class with its status and
JSON shape, streams cut and resumed on another orchestrator with Last-Event-ID (each token once),
API keys, a 10 MB body refused before it is read whole, and ResumingClient moving past an
orchestrator at its admission limit.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import pytest_asyncio

from cluster import LOOPBACK, Cluster
from specdec import roles
from specdec.client import ResumingClient, StreamReport
from specdec.core.errors import Overloaded, SessionTakenOver, StoreUnavailable, WorkerUnavailable
from specdec.core.redis_store import RedisSessionStore
from specdec.orchestrator.http import HttpApi, HttpConfig, api_error
from specdec.orchestrator.http_server import HttpServer
from specdec.orchestrator.loop import Chunk, Orchestrator
from specdec.orchestrator.request import OrchestratorConfig
from specdec.rpc.auth import Credentials
from specdec.rpc.server import RunningServer, ServerConfig
from specdec.rpc.tls import client_tls
from specdec.v1 import common_pb2, generation_pb2 as pb, generation_pb2_grpc

from test_bad_input import wait_for_no_sessions

MODEL = "tiny-target"
PROMPT = "def fibonacci(n):\n"
FIXED_K3 = {"mode": "fixed", "num_speculative_tokens": 3}
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
KEY = "http-test-key-0123456789"


@dataclass
class Orch:
    """One orchestrator with both APIs."""

    grpc: RunningServer
    orchestrator: Orchestrator
    http: HttpServer

    @property
    def url(self) -> str:
        return self.http.url

    async def stop(self) -> None:
        await self.http.stop(0)
        await self.orchestrator.aclose()
        await self.grpc.stop(0)


def ssl_context(cluster: Cluster) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=cluster.tls.ca_file)


async def start_orch(cluster: Cluster, redis_url: str, tokenizer_path: str, config: OrchestratorConfig | None = None,
                     api_keys: tuple[str, ...] = ()) -> Orch:
    """Another orchestrator over the cluster's workers and session store, with its HTTP API."""
    draft_server, target_server, _ = cluster.servers
    store = RedisSessionStore.from_url(redis_url, prefix=cluster.store._prefix)
    upstreams = roles.Upstreams(draft_server.address, target_server.address, tokenizer_path, tls=cluster.tls)
    server = ServerConfig(LOOPBACK.host, 0, credentials=Credentials(api_keys), tls=cluster.tls)
    running, orch = await roles.start_orchestrator(config or OrchestratorConfig(max_new_tokens_limit=256), upstreams, store, server)
    http = await roles.start_http_api(orch, server, 0, MODEL)
    return Orch(running, orch, http)


@pytest_asyncio.fixture(scope="module")
async def main(cluster) -> HttpServer:
    """HTTP beside the cluster's own orchestrator (no API keys)."""
    server = ServerConfig(LOOPBACK.host, 0, tls=cluster.tls)
    http = await roles.start_http_api(cluster.orchestrator, server, 0, MODEL)
    yield http
    await http.stop(0)


@pytest_asyncio.fixture(scope="module")
async def other(cluster, tiny_pair, redis_url) -> Orch:
    """A second orchestrator over the same workers and store: its tokenizer has a chat template, and
    it runs one request at a time with no line (the next is refused: 429 / RESOURCE_EXHAUSTED)."""
    folder = Path(tempfile.mkdtemp(prefix="specdec-chat-"))
    for name in Path(tiny_pair[0]).iterdir():
        if "token" in name.name or name.suffix == ".json" and "config" not in name.name:
            shutil.copy(name, folder / name.name)
    shutil.copy(Path(tiny_pair[0]) / "config.json", folder / "config.json")
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    o = await start_orch(cluster, redis_url, str(folder), OrchestratorConfig(max_new_tokens_limit=256, max_concurrent_requests=1,
                                                                             max_waiting_requests=0))
    yield o
    await o.stop()
    shutil.rmtree(folder, ignore_errors=True)


def oai(cluster: Cluster, url: str, api_key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0,
                              http_client=httpx.AsyncClient(verify=ssl_context(cluster), timeout=120))


def raw(cluster: Cluster) -> httpx.AsyncClient:
    return httpx.AsyncClient(verify=ssl_context(cluster), timeout=120)


async def grpc_generate(cluster: Cluster, **kw) -> pb.GenerateResponse:
    return await cluster.stub.Generate(pb.GenerateRequest(**kw), timeout=120)


def sse_events(text: str) -> list[tuple[str, str]]:
    """(id, data) of every event of a whole SSE body."""
    out = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((fields.get("id", ""), fields["data"]))
    return out


# ----------------------------------------------------------------------------- completions
async def test_completions_text_is_the_grpc_apis_greedy_and_seeded(cluster, main):
    """Greedy and seeded-sampled text over HTTP (unary and streamed) is the gRPC API's for the same request."""
    client = oai(cluster, main.url)
    for sampling, http_args in ((common_pb2.SamplingParams(temperature=0), {"temperature": 0}),
                                (common_pb2.SamplingParams(temperature=0.8, seed=7), {"temperature": 0.8, "seed": 7})):
        want = await grpc_generate(cluster, text=PROMPT, max_new_tokens=24, sampling=sampling,
                                   speculation=common_pb2.SpeculationPolicy(mode=common_pb2.SPECULATION_MODE_FIXED,
                                                                            num_speculative_tokens=3))
        got = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, extra_body={"speculation": FIXED_K3},
                                              **http_args)
        choice = got.choices[0]
        assert choice.text == want.text and choice.model_extra["token_ids"] == list(want.token_ids)
        assert choice.finish_reason == "length"
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.usage.prompt_tokens, 24)
        assert got.usage.total_tokens == want.usage.prompt_tokens + 24
        assert got.id == f"cmpl-{got.model_extra['session_id']}" and got.object == "text_completion" and got.model == MODEL
        stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, stream=True,
                                                 extra_body={"speculation": FIXED_K3}, **http_args)
        pieces = [c async for c in stream]
        assert "".join(c.choices[0].text for c in pieces) == want.text
        assert pieces[-1].choices[0].finish_reason == "length"
    await client.close()


async def test_prompt_as_token_ids_and_usage_in_the_stream(cluster, main):
    """A prompt of token ids; `stream_options.include_usage` adds a last chunk with no choices, the
    usage and the stats; every event has `id: <session>:<tokens so far>`; the stream ends with [DONE]."""
    want = await grpc_generate(cluster, token_ids=pb.TokenIds(ids=[5, 17, 42, 9]), max_new_tokens=16,
                               sampling=common_pb2.SamplingParams(temperature=0))
    async with raw(cluster) as http:
        reply = await http.post(main.url + "/v1/completions", json={
            "model": MODEL, "prompt": [5, 17, 42, 9], "max_tokens": 16, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}})
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    events = sse_events(reply.text)
    assert events[-1][1] == "[DONE]"
    chunks = [json.loads(data) for _, data in events[:-1]]
    session = chunks[0]["session_id"]
    counts = [int(event_id.split(":")[1]) for event_id, _ in events]
    assert all(event_id.split(":")[0] == session for event_id, _ in events)
    assert counts == sorted(counts) and counts[-1] == 16
    ids = [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]]
    assert ids == list(want.token_ids)
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 4, "completion_tokens": 16, "total_tokens": 20}
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and "spec_decode" in chunks[-2] and "spec_decode" in usage


async def test_spec_decode_stats_in_the_body(cluster, main):
    """The `spec_decode` field: totals that agree with each other and with the per-position counts."""
    client = oai(cluster, main.url)
    got = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0,
                                          extra_body={"speculation": FIXED_K3, "drafter": "model"})
    stats = got.model_extra["spec_decode"]
    await client.close()
    assert stats["drafter"] == "model" and stats["num_drafts"] >= 1
    assert stats["draft_tokens"] <= 3 * stats["num_drafts"] and 0 <= stats["accepted_tokens"] <= stats["draft_tokens"]
    assert sum(stats["accepted_by_position"]) == stats["accepted_tokens"]
    assert len(stats["acceptance_by_position"]) == len(stats["accepted_by_position"]) <= 3
    assert all(0 <= a <= 1 for a in stats["acceptance_by_position"])
    assert stats["mean_accepted_length"] == pytest.approx(1 + stats["accepted_tokens"] / stats["num_drafts"], abs=1e-5)
    assert stats["verify_steps"] >= stats["num_drafts"] and stats["last_num_speculative_tokens"] in (0, 1, 2, 3)


async def test_models_and_health(cluster, main):
    client = oai(cluster, main.url)
    models = await client.models.list()
    await client.close()
    assert [m.id for m in models.data] == [MODEL]
    assert "model" in models.data[0].model_extra["drafters"]
    async with raw(cluster) as http:
        assert (await http.get(main.url + "/health")).json() == {"status": "ok"}


# ----------------------------------------------------------------------------- chat
async def test_chat_without_a_template_is_a_clear_400(cluster, main):
    client = oai(cluster, main.url)
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    await client.close()
    assert err.value.status_code == 400 and err.value.code == "no_chat_template"
    assert "chat template" in err.value.message and err.value.body["param"] == "messages"


async def test_chat_uses_the_template_unary_and_streamed(cluster, other):
    """The prompt is the template's (the same tokens through gRPC give the same greedy text)."""
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    tokenizer = other.orchestrator.target.tokenizer
    prompt_ids = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                           add_special_tokens=False)["input_ids"]
    want = await grpc_generate(cluster, token_ids=pb.TokenIds(ids=prompt_ids), max_new_tokens=20,
                               sampling=common_pb2.SamplingParams(temperature=0))
    client = oai(cluster, other.url)
    got = await client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20, temperature=0)
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(prompt_ids) and got.object == "chat.completion"
    assert "spec_decode" in got.model_extra
    stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True,
                                                  stream_options={"include_usage": True})
    pieces = [c async for c in stream]
    await client.close()
    assert pieces[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == want.text
    assert pieces[-1].usage.completion_tokens == 20 and pieces[-1].model_extra["spec_decode"]["verify_steps"] >= 1


# ----------------------------------------------------------------------------- errors
def assert_error(reply: httpx.Response, status: int, code: str) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code and error["message"]
    assert "Traceback" not in reply.text
    return error


async def test_each_bad_request_is_a_400_in_openais_shape(cluster, main):
    url = main.url + "/v1/completions"
    bad = [
        ({"model": MODEL, "prompt": PROMPT, "temperature": -1}, "temperature"),
        ({"model": MODEL, "prompt": PROMPT, "n": 2}, "n must be 1"),
        ({"model": MODEL, "prompt": PROMPT, "max_tokens": 100000}, "max_new_tokens"),
        ({"model": MODEL, "prompt": ""}, "empty"),
        ({"model": MODEL}, "prompt"),
        ({"model": MODEL, "prompt": ["a", "b"]}, "one prompt"),
        ({"model": MODEL, "prompt": [1, "x"]}, "token ids"),
        ({"model": MODEL, "prompt": [10 ** 9]}, "vocab"),
        ({"model": MODEL, "prompt": [1] * ((1 << 18) + 1)}, "token ids"),  # the gRPC API's limit
        ({"model": MODEL, "prompt": PROMPT, "stop": ["x"] * 9}, "stop"),
        ({"model": MODEL, "prompt": PROMPT, "speculation": {"mode": "sometimes"}}, "speculation.mode"),
        ({"model": MODEL, "prompt": PROMPT, "speculation": {"num_speculative_tokens": 99}}, "num_speculative_tokens"),
        ({"model": MODEL, "prompt": PROMPT, "rule": "best"}, "rule"),
        ({"model": MODEL, "prompt": PROMPT, "drafter": "oracle"}, "unknown drafter"),
        ({"model": MODEL, "prompt": PROMPT, "presence_penalty": 0.5}, "presence_penalty"),
        ({"model": MODEL, "prompt": PROMPT, "temperature": "hot"}, "temperature"),
        ([1, 2], "JSON object"),
    ]
    async with raw(cluster) as http:
        for body, words in bad:
            error = assert_error(await http.post(url, json=body), 400, "invalid_request")
            assert words.lower() in error["message"].lower(), (body, error)
            assert error["type"] == "invalid_request_error"
        assert_error(await http.post(url, content=b"{not json", headers={"content-type": "application/json"}), 400, "invalid_json")
        assert_error(await http.post(url, content=b"[" * 100_000, headers={"content-type": "application/json"}), 400,
                     "invalid_json")  # nested past what json.loads reads (RecursionError): still the body's fault
        # The same body through the streaming path: refused before any event, with its status.
        assert_error(await http.post(url, json={"model": MODEL, "prompt": PROMPT, "temperature": -1, "stream": True}), 400,
                     "invalid_request")
        assert_error(await http.post(url, json={"model": "gpt-5", "prompt": PROMPT}), 404, "model_not_found")
        assert_error(await http.get(main.url + "/v1/nothing"), 404, "not_found")
        assert_error(await http.get(url), 405, "method_not_allowed")


# Bodies whose text is not valid Unicode: (endpoint, body bytes, the field the 400 names, what it says).
# json.dumps escapes a lone surrogate as \\udXXX, which Python's json (and the server's) reads back.
NOT_UNICODE = [
    ("completions", json.dumps({"model": MODEL, "prompt": "def f(\ud800):"}).encode(), "prompt",
     "lone surrogate at character 6"),
    ("completions", json.dumps({"model": MODEL, "prompt": "x", "stream": True, "stop": ["\n", "\udfff"]}).encode(),
     "stop[1]", "lone surrogate at character 0"),
    ("completions", json.dumps({"model": MODEL, "prompt": ["ok \udc80"]}).encode(), "prompt[0]", "lone surrogate at character 3"),
    ("completions", json.dumps({"model": MODEL + "\ud83d", "prompt": "x"}).encode(), "model", "lone surrogate at character 11"),
    ("completions", b'{"model": "tiny-target", "prompt": "caf\xe9 au lait"}', "prompt",
     "not valid UTF-8: it holds a byte that is not UTF-8 (0xe9) at character 3"),
    ("completions", b'{"model": "tiny-target", "prompt": "a\xed\xa0\x80"}', "prompt", "(0xed) at character 1"),  # an encoded surrogate
    ("chat/completions", json.dumps({"model": MODEL, "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi \ud800 there"}]}).encode(),
     "messages[1].content", "lone surrogate at character 3"),
    ("chat/completions", json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}).encode(), "messages[0].content[0].text",
     "lone surrogate at character 0"),
    ("chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "us\udc00er", "content": "x"}]}).encode(),
     "messages[0].role", "lone surrogate at character 2"),
    ("chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "name": "\ud800", "content": "x"}]}).encode(),
     "messages[0].name", "lone surrogate at character 0"),
    ("chat/completions", b'{"model": "tiny-target", "messages": [{"role": "user", "content": "\xff"}]}', "messages[0].content",
     "(0xff) at character 0"),
]


@pytest.mark.parametrize("endpoint, body, field, words", NOT_UNICODE, ids=[f"{e}-{f}-{i}" for i, (e, _, f, _) in enumerate(NOT_UNICODE)])
async def test_text_that_is_not_unicode_is_a_400_naming_the_field(cluster, other, endpoint, body, field, words):
    """A lone surrogate (a JSON escape) or bytes that are not UTF-8, in any string the server reads:
    a 400 that names the field and says what to send, never a 500, and no session is opened."""
    async with raw(cluster) as http:
        reply = await http.post(f"{other.url}/v1/{endpoint}", content=body, headers={"content-type": "application/json"})
    error = assert_error(reply, 400, "invalid_request")
    assert error["message"].startswith(f"{field} is not valid ") and error["message"].endswith("; send UTF-8 text"), error
    assert words in error["message"] and error["param"] == field and error["type"] == "invalid_request_error"
    assert await wait_for_no_sessions(cluster) == (0, 0)


async def test_a_surrogate_pair_is_one_character_and_is_served(cluster, main):
    """Escapes that pair up (\\ud83d\\ude00 is one emoji) are valid text: only a lone surrogate is refused."""
    body = json.dumps({"model": MODEL, "prompt": "# \U0001F600\n" + PROMPT, "max_tokens": 4, "temperature": 0,
                       "stop": ["\U0001F600"]})
    assert "\\ud83d\\ude00" in body
    async with raw(cluster) as http:
        reply = await http.post(main.url + "/v1/completions", content=body.encode(), headers={"content-type": "application/json"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] >= 1


async def raw_request_head(cluster: Cluster, url: str, head: str, body_parts: list[bytes]) -> tuple[int, dict]:
    """Send a request's head and only ``body_parts`` of its body over TLS, then read the answer
    (status, JSON) without ever sending the rest: an answer proves the body was refused unread."""
    host, port = url.split("://")[1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port), ssl=ssl_context(cluster), server_hostname=host)
    try:
        writer.write(head.encode())
        for part in body_parts:
            writer.write(part)
            await writer.drain()
        status_line = await reader.readline()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        payload = await reader.readexactly(int(headers["content-length"]))
        return int(status_line.split()[1]), json.loads(payload)
    finally:
        writer.close()


async def test_a_10_mb_body_is_refused_before_it_is_read(cluster, main):
    """413 by Content-Length with none of the body sent, and by counting a chunked body's bytes
    as they come: the answer comes while most of the 10 MB was never sent."""
    limit = main.api.config.max_body_bytes
    async with raw(cluster) as http:  # the whole 10 MB, as a client sends it
        body = b'{"prompt": "' + b"x" * (10 << 20) + b'"}'
        assert_error(await http.post(main.url + "/v1/completions", content=body), 413, "request_too_large")
    host = main.url.split("://")[1]
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    status, error = await raw_request_head(cluster, main.url, head + f"Content-Length: {10 << 20}\r\n\r\n", [])
    assert status == 413 and error["error"]["code"] == "request_too_large"
    chunk = b"x" * (1 << 16)
    parts = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * (limit // len(chunk) + 2)  # just over the limit of the 10 MB
    status, error = await raw_request_head(cluster, main.url, head + "Transfer-Encoding: chunked\r\n\r\n", parts)
    assert status == 413 and error["error"]["code"] == "request_too_large" and str(limit) in error["error"]["message"]


async def test_api_keys_are_the_grpc_apis(cluster, tiny_pair, redis_url):
    """With keys: 401 without one or with a wrong one (OpenAI's shape), served with one; a session is
    its key's only (resuming it with another key: 404, as GetSession's NOT_FOUND)."""
    other_key = "another-http-key-0123456789"
    keyed = await start_orch(cluster, redis_url, tiny_pair[0], api_keys=(KEY, other_key))
    try:
        async with raw(cluster) as http:
            url = keyed.url + "/v1/completions"
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
            error = assert_error(await http.post(url, json=body), 401, "invalid_api_key")
            assert error["type"] == "authentication_error" and "Authorization: Bearer" in error["message"]
            assert_error(await http.post(url, json=body, headers={"Authorization": "Bearer wrong-key-0123456789"}), 401,
                         "invalid_api_key")
            assert_error(await http.get(keyed.url + "/v1/models"), 401, "invalid_api_key")
            assert (await http.get(keyed.url + "/health")).status_code == 200  # health stays open, as gRPC's
            ok = await http.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"})
            assert ok.status_code == 200
            event_id = sse_events(ok.text)[0][0]
            session = event_id.split(":")[0]
            stolen = await http.post(url, json=body, headers={"Authorization": f"Bearer {other_key}", "Last-Event-ID": f"{session}:0"})
            assert_error(stolen, 404, "session_not_found")
        client = oai(cluster, keyed.url, api_key=KEY)
        assert (await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)).usage.completion_tokens == 4
        await client.close()
        # The same key over gRPC.
        channel = grpc.aio.secure_channel(keyed.grpc.address, client_tls(cluster.tls.ca_file))
        reply = await generation_pb2_grpc.GenerationStub(channel).Generate(
            pb.GenerateRequest(text=PROMPT, max_new_tokens=4), metadata=(("authorization", f"Bearer {KEY}"),), timeout=60)
        await channel.close()
        assert len(reply.token_ids) == 4
    finally:
        await keyed.stop()


async def test_over_capacity_is_429_with_retry_after_and_draining_is_503(cluster, other):
    async with raw(cluster) as http:
        url = other.url + "/v1/completions"
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
        async with other.orchestrator.admission.slot():  # its one running slot taken, no line
            for stream in (False, True):
                reply = await http.post(url, json={**body, "stream": stream})
                error = assert_error(reply, 429, "over_capacity")
                assert error["type"] == "rate_limit_error" and reply.headers["retry-after"] == "1"
        other.http.begin_drain()
        try:
            reply = await http.post(url, json=body)
            assert_error(reply, 503, "draining")
            assert reply.headers["retry-after"] == "1"
            assert (await http.get(other.url + "/health")).status_code == 503
        finally:
            other.http.api.draining = False
        assert (await http.post(url, json=body)).status_code == 200


def test_every_core_error_maps_to_its_status():
    """The store down or no worker: 503 with Retry-After; over capacity: 429."""
    for exc, status, code in ((StoreUnavailable("the session store is unavailable"), 503, "session_store_unavailable"),
                              (WorkerUnavailable("no verifier"), 503, "workers_unavailable"),
                              (Overloaded("full"), 429, "over_capacity")):
        error = api_error(exc)
        assert (error.status, error.code, error.retry_after_s) == (status, code, 1)
        assert error.response().headers["retry-after"] == "1"


# ----------------------------------------------------------------------------- resuming
async def test_a_cut_stream_resumes_on_another_orchestrator_each_token_once(cluster, main, other):
    """Cut after a few events on one orchestrator; the same request with Last-Event-ID on the other
    gives the rest: together, each token once, the uncut greedy output."""
    want = await grpc_generate(cluster, text=PROMPT, max_new_tokens=48, sampling=common_pb2.SamplingParams(temperature=0))
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "stream": True,
            "speculation": {"mode": "fixed", "num_speculative_tokens": 1}}
    got: list[int] = []
    last_id = ""
    async with raw(cluster) as http:
        async with http.stream("POST", main.url + "/v1/completions", json=body) as reply:
            assert reply.status_code == 200
            event_id = ""
            async for line in reply.aiter_lines():
                if line.startswith("id: "):
                    event_id = line[4:]
                elif line.startswith("data: "):
                    got.extend(json.loads(line[6:])["choices"][0]["token_ids"])
                    last_id = event_id
                    if len(got) >= 4:
                        break  # the client goes away mid-stream
        assert 4 <= len(got) < 48 and last_id.endswith(f":{len(got)}")
        rest = await http.post(other.url + "/v1/completions", json=body, headers={"Last-Event-ID": last_id})
    assert rest.status_code == 200, rest.text
    events = sse_events(rest.text)
    assert events[-1][1] == "[DONE]"
    for event_id, data in events[:-1]:
        got.extend(json.loads(data)["choices"][0]["token_ids"])
    assert got == list(want.token_ids)
    assert events[-1][0] == f"{last_id.split(':')[0]}:48"


async def test_a_bad_last_event_id_is_a_400(cluster, main):
    async with raw(cluster) as http:
        for bad in ("nonsense", "abc:1", f"{uuid.uuid4().hex}:x"):
            reply = await http.post(main.url + "/v1/completions", json={"stream": True}, headers={"Last-Event-ID": bad})
            assert reply.status_code == 400 and "Traceback" not in reply.text
        reply = await http.post(main.url + "/v1/completions", json={"stream": True}, headers={"Last-Event-ID": f"{uuid.uuid4().hex}:0"})
        assert_error(reply, 404, "session_not_found")


async def test_resuming_client_is_served_by_the_free_orchestrator(cluster, other):
    """An orchestrator at its admission limit answers RESOURCE_EXHAUSTED; ResumingClient, given it
    first and then a free one, gets the request served by the free one."""
    request = pb.GenerateRequest(text=PROMPT, max_new_tokens=8, sampling=common_pb2.SamplingParams(temperature=0))
    want = await grpc_generate(cluster, text=PROMPT, max_new_tokens=8, sampling=common_pb2.SamplingParams(temperature=0))
    report = StreamReport()
    async with other.orchestrator.admission.slot():
        async with ResumingClient([other.grpc.address, cluster.address], client_tls(cluster.tls.ca_file)) as client:
            ids = [t async for msg in client.stream(request, report, timeout_s=120) for t in msg.token_ids]
    assert ids == list(want.token_ids)
    assert report.address == cluster.address


# ----------------------------------------------------------------------------- failures inside the server
class FailingOrchestrator:
    """Just enough of an Orchestrator for HttpApi: ``generate`` yields ``chunks`` then raises ``error``."""

    def __init__(self, chunks: list, error: BaseException) -> None:
        self.config = OrchestratorConfig()
        self.chunks, self.error = chunks, error

    async def generate(self, request):
        for chunk in self.chunks:
            yield chunk
        raise self.error


async def asgi_post(orch, body: dict) -> httpx.Response:
    api = HttpApi(orch, HttpConfig(MODEL))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api.app), base_url="http://specdec") as client:
        return await client.post("/v1/completions", json=body)


async def test_a_bug_is_a_500_with_a_request_id_never_a_traceback():
    reply = await asgi_post(FailingOrchestrator([], RuntimeError("secret internals")), {"prompt": "x"})
    error = assert_error(reply, 500, "internal_error")
    assert "request id" in error["message"] and "secret internals" not in reply.text
    # Mid-stream: the status is sent already; one last event says what happened, and no [DONE].
    chunk = Chunk(session_id="a" * 32, seed=1, token_ids=(5,), text="x", completion_tokens=1)
    for exc, code in ((RuntimeError("secret internals"), "internal_error"),
                      (SessionTakenOver("resumed elsewhere"), "taken_over")):
        reply = await asgi_post(FailingOrchestrator([chunk], exc), {"prompt": "x", "stream": True})
        events = sse_events(reply.text)
        assert reply.status_code == 200 and len(events) == 2 and events[0][0] == f"{'a' * 32}:1"
        assert json.loads(events[1][1])["error"]["code"] == code and "[DONE]" not in reply.text
        assert "secret internals" not in reply.text and "Traceback" not in reply.text
