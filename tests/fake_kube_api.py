"""A FAKE Kubernetes API server: just the Deployment scale subresource, for the autoscaler's tests.

No Kubernetes can run here, so this stands in for the API server well enough for the official
``kubernetes`` client: GET and PATCH of ``/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale``
with JSON bodies (autoscaling/v1 Scale objects), merge, strategic-merge and JSON patches, and
Status objects for errors. It records every request so tests can assert what was sent.
"""
from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SCALE_PATH = re.compile(r"^/apis/apps/v1/namespaces/(?P<ns>[^/]+)/deployments/(?P<name>[^/]+)/scale$")
OBJECT_PATCHES = ("application/merge-patch+json", "application/strategic-merge-patch+json")
JSON_PATCH = "application/json-patch+json"


@dataclass
class Request:
    method: str
    path: str  # without the query
    query: str
    content_type: str | None
    body: object | None


@dataclass
class FakeKubeApi:
    """Deployments as {(namespace, name): replicas}; start() serves them on 127.0.0.1."""

    deployments: dict[tuple[str, str], int] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    fail_patches: bool = False  # answer every PATCH with 500, as an overloaded API server might
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def start(self) -> FakeKubeApi:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                api._handle(self, None)

            def do_PATCH(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                api._handle(self, self.rfile.read(length))

            def log_message(self, format, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def patches(self) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.method == "PATCH"]

    # ------------------------------------------------------------------ the API
    def _handle(self, handler: BaseHTTPRequestHandler, raw: bytes | None) -> None:
        path, _, query = handler.path.partition("?")
        content_type = handler.headers.get("Content-Type")
        body = json.loads(raw) if raw else None
        with self._lock:
            self.requests.append(Request(handler.command, path, query, content_type, body))
            status, reply = self._answer(handler.command, path, content_type, body)
        data = json.dumps(reply).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def _answer(self, method: str, path: str, content_type: str | None, body) -> tuple[int, dict]:
        match = SCALE_PATH.match(path)
        if match is None:
            return 404, _status(404, "NotFound", f"the server could not find the requested resource {path}")
        key = (match["ns"], match["name"])
        if key not in self.deployments:
            return 404, _status(404, "NotFound", f'deployments.apps "{key[1]}" not found')
        if method == "PATCH":
            if self.fail_patches:
                return 500, _status(500, "InternalError", "etcdserver: request timed out")
            media = (content_type or "").split(";")[0].strip()
            if media not in OBJECT_PATCHES + (JSON_PATCH,):
                return 415, _status(415, "UnsupportedMediaType", f"the body of the request was in an unknown format: {media}")
            replicas = _patched_replicas(media, body)
            if replicas is None:
                return 422, _status(422, "Invalid", f"spec.replicas must be set to a non-negative integer by {body!r}")
            self.deployments[key] = replicas
        return 200, _scale(*key, self.deployments[key])


def _patched_replicas(media: str, body) -> int | None:
    """The replicas a patch sets; None when it sets none, or nonsense."""
    if media == JSON_PATCH:
        ops = [op for op in body or [] if op.get("path") == "/spec/replicas" and op.get("op") in ("replace", "add")]
        replicas = ops[-1]["value"] if ops else None
    else:
        replicas = (body or {}).get("spec", {}).get("replicas") if isinstance(body, dict) else None
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        return None
    return replicas


def _scale(namespace: str, name: str, replicas: int) -> dict:
    return {"kind": "Scale", "apiVersion": "autoscaling/v1",
            "metadata": {"name": name, "namespace": namespace, "resourceVersion": str(replicas + 1)},
            "spec": {"replicas": replicas}, "status": {"replicas": replicas, "selector": f"app={name}"}}


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}
