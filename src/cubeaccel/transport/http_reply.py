"""Client side of the API edge: a reply body, or the server's `{"error": {...}}` back as a `CubeError`.

A reply names its version in `v` (wire/base.py); one this client cannot read is refused, not half-read.
"""

from __future__ import annotations

from typing import Any

import httpx

from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.base import WIRE_VERSION

UNREADABLE_ERROR = "http.error"  # an error reply without the server's `{"error": {...}}` (a proxy's page, a crash)


def reply_body(r: httpx.Response) -> Any:
    try:
        body = r.json() if r.content else {}
    except ValueError:
        body = {}
    if r.status_code >= 400:
        err = body.get("error", {}) if isinstance(body, dict) else {}
        raise CubeError(
            err.get("code", UNREADABLE_ERROR),
            err.get("message", r.text[:500]),
            err.get("layer", "api"),
            err.get("details", {}),
            r.status_code,
        )
    if isinstance(body, dict) and body.get("v", WIRE_VERSION) != WIRE_VERSION:
        raise CubeError(
            "api.unsupported_reply_version",
            f"{r.request.method} {r.request.url.path}: reply of version {body['v']!r:.20}; this client reads v1",
            "api",
            {"v": body["v"]},
        )
    return body
