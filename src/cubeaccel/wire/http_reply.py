"""Client side of the API edge: a reply body, or the server's `{"error": {...}}` back as a `CubeError`."""

from __future__ import annotations

from typing import Any

import httpx

from cubeaccel.model.errors import CubeError


def reply_body(r: httpx.Response) -> Any:
    try:
        body = r.json() if r.content else {}
    except ValueError:
        body = {}
    if r.status_code >= 400:
        err = body.get("error", {}) if isinstance(body, dict) else {}
        raise CubeError(
            err.get("code", "http.error"),
            err.get("message", r.text[:500]),
            err.get("layer", "api"),
            err.get("details", {}),
            r.status_code,
        )
    return body
