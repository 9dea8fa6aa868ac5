"""The front door's server edge under Hypercorn: the bounds every cubeaccel listener has (transport/http_server.py).

What Hypercorn enforces, read from its code (0.17/0.18) and checked by tests/e2e/test_hostile_http.py:
- `keep_alive_timeout` runs from the connection's start (or the end of a reply) until a request's headers are
  complete; bytes arriving meanwhile do not restart it. It is the header deadline and the idle timeout in one,
  so it gets the shorter of the two (10 s; clients expire idle connections sooner, httpx at 5 s).
- `h11_max_incomplete_size` / `h2_max_header_list_size` bound what is buffered of a request's headers;
  the app checks the parsed size too (`http_server.headers_too_large`), as a request read in one piece passes h11.
- Bodies have no deadline in Hypercorn (`read_timeout` would cut envd streams that are quiet while a command
  runs): the REST routes get theirs from the shared edge guard (`api_edges.EdgeGuard`), as the other servers do.
- A request that does not parse is answered by Hypercorn with an empty body; `answer_protocol_errors_in_json`
  makes it E2B's error body with the catalogued code, as `http_server.GuardedH11` does for uvicorn.
There is no bound on concurrent connections in Hypercorn (nor in uvicorn as configured): docs/decisions.md.

HTTP/2 without TLS (h2c): Hypercorn serves it two ways on a plain listener, and the front door keeps one. HTTP/2
with prior knowledge (a client or an L7 proxy that opens with the h2 preface) is served, as documented in
docs/e2b.md; an HTTP/1.1 request asking `Upgrade: h2c` is answered in HTTP/1.1 (`ignore_h2c_upgrade`): a reverse
proxy that passes Upgrade headers on (as one set up for WebSockets does) would otherwise hand its client an h2c
tunnel to this server, past the proxy's own routing, limits and logs (h2c smuggling).
"""

from __future__ import annotations

import json
from typing import Any

from cubeaccel.transport.http_server import MAX_HEADER_BYTES, HttpLimits
from cubeaccel.wire.e2b_api import Error


def bounded_config(listen: str, limits: HttpLimits | None = None) -> Any:
    """A Hypercorn Config for `listen` with cubeaccel's bounds."""
    from hypercorn.config import Config

    limits = limits or HttpLimits.from_env()
    hc = Config()
    hc.bind = [listen]
    hc.accesslog = None
    hc.keep_alive_timeout = min(limits.header_timeout_s, float(limits.idle_timeout_s))
    hc.h11_max_incomplete_size = MAX_HEADER_BYTES
    hc.h2_max_header_list_size = MAX_HEADER_BYTES
    return hc


def protocol_error_body(status: int) -> bytes:
    code, what = (
        ("api.headers_too_large", f"request line and headers over {MAX_HEADER_BYTES} bytes")
        if status == 431
        else ("api.bad_http_request", "an HTTP request that does not parse (bad framing, a malformed header)")
    )
    return json.dumps(Error(code=status, message=f"cubeaccel (api): {code}: {what}").body()).encode()


def answer_protocol_errors_in_json() -> None:
    """Hypercorn's HTTP/1.1 protocol errors (a malformed request line or header, bad chunked framing, headers
    over the bound) answered with a JSON error body and `Connection: close`, not an empty one."""
    import h11
    from hypercorn.protocol.h11 import H11Protocol

    if getattr(H11Protocol._send_error_response, "cubeaccel_wrapped", False):
        return

    async def send_error_response(self: Any, status_code: int) -> None:
        body = protocol_error_body(status_code)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            (b"should-retry", b"false"),
            *self.config.response_headers("h11"),
        ]
        await self._send_h11_event(h11.Response(status_code=status_code, headers=headers))
        await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())

    send_error_response.cubeaccel_wrapped = True  # type: ignore[attr-defined]
    setattr(H11Protocol, "_send_error_response", send_error_response)  # noqa: B010


def ignore_h2c_upgrade() -> None:
    """An HTTP/1.1 request with `Upgrade: h2c` served as HTTP/1.1 (RFC 9110 lets a server ignore Upgrade), never
    switched to HTTP/2: Hypercorn has no setting for it, so its H11 protocol's check is wrapped (pinned by
    tests/unit/test_frontdoor_h2c.py, for the Hypercorn versions pyproject allows). The h2 preface (prior
    knowledge) still goes to Hypercorn's check, which serves HTTP/2."""
    from hypercorn.protocol.h11 import H11Protocol

    original = H11Protocol._check_protocol
    if getattr(original, "cubeaccel_wrapped", False):
        return

    async def check_protocol(self: Any, event: Any) -> None:
        if any(name.lower() == b"upgrade" and value.strip().lower() == b"h2c" for name, value in event.headers):
            return
        await original(self, event)

    check_protocol.cubeaccel_wrapped = True  # type: ignore[attr-defined]
    setattr(H11Protocol, "_check_protocol", check_protocol)  # noqa: B010
