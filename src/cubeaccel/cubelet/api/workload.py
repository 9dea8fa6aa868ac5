"""The workload proxy: `…/v1/sandboxes/{sandbox_id}/workload/{path}` to that sandbox's shim socket, on both
listeners, bodies streamed both ways (never buffered whole). The caller's `X-Access-Token` is checked against the
start's stored hash here, and again by the guest; `GET health` and envd's signed `/files` URLs pass to the guest,
which checks them. Upstream connections are pooled per sandbox (`workload_upstreams.WorkloadUpstreams`)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from cubeaccel.cubelet.api.deps import CubeletDep, UpstreamsDep
from cubeaccel.cubelet.lifecycle import Cubelet, validate_sandbox_id
from cubeaccel.model.reservation_states import ReservationPhase
from cubeaccel.protocol.connect_envelope import FLAG_END_STREAM, HEADER, encode_json
from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport import proxy

WORKLOAD_PREFIX = "/v1/sandboxes/"  # + {sandbox_id}/workload/{path}: envd's API of that sandbox, streamed through
WORKLOAD_PATH = re.compile(r"^/v1/sandboxes/[^/]+/workload/")
WORKLOAD_METHODS = ("GET", "POST", "HEAD", "PUT", "PATCH", "DELETE", "OPTIONS")  # the last four: ports only
PORT_PATH = "cubeaccel/port/"  # …/workload/cubeaccel/port/<port>/<path>: another port of the sandbox

router = APIRouter()


def workload_socket(cubelet: Cubelet, sandbox_id: str) -> Path:
    """The running sandbox's bridge socket, or the refusal a caller gets."""
    res = cubelet.store.reservation(sandbox_id)
    if res is None or res.phase is not ReservationPhase.RUNNING:
        raise CubeError(
            "workload.not_running", f"sandbox {sandbox_id} is not running here", "api", {"sandbox_id": sandbox_id}
        )
    path = cubelet.shim.workload_socket(res.shim_id)  # a claimed warm sandbox's shim keeps its own id
    if not isinstance(path, Path) or not path.exists():
        raise CubeError(
            "workload.unavailable",
            f"sandbox {sandbox_id} has no workload endpoint",
            "api",
            {"sandbox_id": sandbox_id},
        )
    return path


class _EnvelopeTracker:
    """Follows Connect envelope boundaries in a streamed reply, so that when the guest's side breaks
    mid-stream the proxy can end the stream with a clear error envelope instead of a cut connection (only
    at a boundary; inside an envelope there is nothing valid left to append)."""

    def __init__(self) -> None:
        self._need = HEADER.size  # bytes until the next boundary event
        self._header = True
        self._head = bytearray()
        self.ended = False  # an end-of-stream envelope passed

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            take = min(self._need, len(view))
            if self._header:
                self._head += view[:take]
            view, self._need = view[take:], self._need - take
            if self._need:
                continue
            if self._header:
                flags, length = HEADER.unpack(self._head)
                self.ended = self.ended or bool(flags & FLAG_END_STREAM)
                self._head.clear()
                self._header, self._need = False, length
                if length:
                    continue
            self._header, self._need = True, HEADER.size

    @property
    def at_boundary(self) -> bool:
        return self._header and self._need == HEADER.size and not self.ended


def _still_running(cubelet: Cubelet, sandbox_id: str) -> bool:
    res = cubelet.store.reservation(sandbox_id)
    return res is not None and res.phase is ReservationPhase.RUNNING


def _end_of_stream_error(code: str, message: str) -> bytes:
    return encode_json({"error": {"code": code, "message": message}}, FLAG_END_STREAM)


def _port_target(request: Request) -> str:
    """Where a request to another port of the sandbox goes (the guest forwards it: workload/portforward.py):
    the caller's path and query as sent, not re-encoded."""
    raw = request.scope.get("raw_path") or request.url.path.encode()
    target = raw.decode("latin-1").split("/workload", 1)[1]
    if request.url.query:
        target += "?" + request.url.query
    return target


@router.api_route(
    WORKLOAD_PREFIX + "{sandbox_id}/workload/{path:path}",
    methods=list(WORKLOAD_METHODS),
    include_in_schema=False,
)
async def workload(
    sandbox_id: str, path: str, request: Request, cubelet: CubeletDep, upstreams: UpstreamsDep
) -> Response:
    validate_sandbox_id(sandbox_id)
    token = request.headers.get("x-access-token")
    if token is not None:
        if not cubelet.workload_token_ok(sandbox_id, token):
            raise CubeError("workload.unauthenticated", "missing or wrong access token", "api")
    elif not (path == "health" or (path == "files" and "signature" in request.query_params)):
        raise CubeError("workload.unauthenticated", "missing or wrong access token", "api")
    sock = workload_socket(cubelet, sandbox_id)
    client = upstreams.get(sandbox_id, sock)
    headers = proxy.request_headers(request)
    try:
        if path.startswith(PORT_PATH):
            upstream = await proxy.send(client, request, _port_target(request), headers, framed=True)
        else:
            url = httpx.URL("/" + path, params=list(request.query_params.multi_items()))
            upstream = await proxy.send(client, request, url, headers)
    except httpx.HTTPError as e:
        upstreams.drop(sandbox_id)  # its pooled connections may all be dead (the bridge reconnected)
        raise CubeError("workload.unavailable", f"workload endpoint: {e}", "api") from e
    connect_stream = upstream.headers.get("content-type", "").startswith("application/connect+")
    tracker = _EnvelopeTracker()

    def broke(e: httpx.HTTPError) -> bytes | None:
        upstreams.drop(sandbox_id)
        if not (connect_stream and tracker.at_boundary) or not _still_running(cubelet, sandbox_id):
            # A sandbox being torn down ends its streams as E2B's do when a sandbox is killed: the
            # connection is cut, and the SDK's health probe (502, gone) tells it the sandbox was killed.
            return None
        code = "workload.channel_closed"  # ours, in the message; the Connect code is envd's vocabulary
        return _end_of_stream_error("unavailable", f"{code}: the sandbox's workload channel broke mid-stream ({e})")

    return proxy.Relay(upstream, observe=tracker.feed if connect_stream else None, on_error=broke)
