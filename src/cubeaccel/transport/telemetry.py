"""What every cubeaccel process says about itself: JSON log lines on stderr, a request id, API request metrics.

- `configure_logging(level)`: one JSON object per line on stderr for the `cubeaccel` loggers (stdlib logging).
  The level is a plain parameter (default `$CUBEACCEL_LOG_LEVEL`, else INFO) that a config file can set.
- A request id (`X-Request-Id`, generated when absent or malformed) lives in a context variable for the whole
  request — the route's worker thread included — is sent on every call our HTTP clients make meanwhile
  (CubeMaster → Cubelet), is written into a shim's spec (Cubelet → shim), and is on every log line; so one
  sandbox's story can be followed across processes with one `grep`.
- `ApiTelemetry`: the ASGI edge (`api_edges.EdgeGuard`) counts every request by route template and status,
  times it, and logs one line for it. Routes are the templates (`/v1/sandboxes/{sandbox_id}`), never raw paths:
  a scanner cannot grow the series without bound. Any front door can use the same class.

Secrets are never logged: a log line carries only fields chosen here (no headers, no bodies), and any field
whose name says credential (token, key, secret, password, authorization) is replaced by `[redacted]`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import sys
import time
import uuid
from collections.abc import Mapping
from contextvars import ContextVar
from typing import IO, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics

REQUEST_ID_HEADER = "x-request-id"
_VALID_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_request_id: ContextVar[str | None] = ContextVar("cubeaccel_request_id", default=None)
SECRET_FIELD = re.compile(r"token|key|secret|password|authorization|credential", re.IGNORECASE)
REDACTED = "[redacted]"
LOG_LEVEL_ENV = "CUBEACCEL_LOG_LEVEL"

# No `*_created` series beside every counter: they double the output and no dashboard here reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]

# API latency buckets: a reserve is milliseconds, a create that waits for a guest is seconds.
API_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


# ---- request ids ------------------------------------------------------------------------------------------------
def request_id() -> str | None:
    """The current request's id (None outside a request)."""
    return _request_id.get()


def set_request_id(rid: str | None) -> None:
    """Adopt `rid` (a shim adopts its spec's) for this context: a malformed one is replaced by a new id."""
    _request_id.set(rid if rid is None or _VALID_ID.fullmatch(rid) else new_request_id())


def new_request_id() -> str:
    return uuid.uuid4().hex


def accept_request_id(given: str | None) -> str:
    """The caller's id if it is a plain token (it lands in logs: no spaces, quotes or newlines), else a new one."""
    return given if given is not None and _VALID_ID.fullmatch(given) else new_request_id()


def outgoing_headers() -> dict[str, str]:
    """Headers an HTTP call made during a request carries, so the next process logs the same id."""
    rid = _request_id.get()
    return {"X-Request-Id": rid} if rid else {}


def add_request_id(request: Any) -> None:
    """An httpx `request` event hook: the current request id onto an outgoing call that has none."""
    rid = _request_id.get()
    if rid and REQUEST_ID_HEADER not in request.headers:
        request.headers["X-Request-Id"] = rid


# ---- JSON logs --------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def _secret(name: str) -> bool:
    return SECRET_FIELD.search(name) is not None


def redact(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Fields with credential-like names replaced, one level of nesting deep (what our log calls pass)."""
    out: dict[str, Any] = {}
    for k, v in fields.items():
        if _secret(k):
            out[k] = REDACTED
        elif isinstance(v, dict):  # not Mapping: an ABC check per field is most of a line's cost
            out[k] = {kk: REDACTED if _secret(str(kk)) else vv for kk, vv in v.items()}
        else:
            out[k] = v
    return out


class JsonFormatter(logging.Formatter):
    """`{"ts", "level", "logger", "msg", "request_id"?, ...fields}`: fields come from `extra={"fields": {...}}`."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", None) or _request_id.get()
        if rid:
            out["request_id"] = rid
        fields = getattr(record, "fields", None)
        if isinstance(fields, Mapping):
            out.update(redact(fields))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, separators=(",", ":"))


def parse_level(level: str | int | None) -> int:
    if level is None:
        level = os.environ.get(LOG_LEVEL_ENV) or "INFO"
    if isinstance(level, int):
        return level
    value = logging.getLevelName(level.upper())
    if not isinstance(value, int):
        raise ValueError(f"unknown log level {level!r}: debug, info, warning, error or critical")
    return value


def configure_logging(level: str | int | None = None, stream: IO[str] | None = None) -> logging.Logger:
    """Send the `cubeaccel` loggers to `stream` (stderr) as JSON lines at `level`; idempotent (one handler)."""
    log = logging.getLogger("cubeaccel")
    for h in [h for h in log.handlers if getattr(h, "_cubeaccel_json", False)]:
        log.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    handler._cubeaccel_json = True  # type: ignore[attr-defined]
    log.addHandler(handler)
    log.setLevel(parse_level(level))
    log.propagate = False
    return log


def log_fields(logger: logging.Logger, level: int, msg: str, **fields: Any) -> None:
    """One structured line (cheap when the level is off: nothing is formatted)."""
    if logger.isEnabledFor(level):
        logger.log(level, msg, extra={"fields": fields})


# ---- API requests -----------------------------------------------------------------------------------------------
api_log = logging.getLogger("cubeaccel.api")


class ApiTelemetry:
    """Per-request counting, timing and logging at an ASGI edge, into `registry` (one per server process)."""

    def __init__(self, registry: CollectorRegistry, component: str) -> None:
        self.component = component
        self.requests = Counter(
            "cubeaccel_api_requests",
            "API requests by route template, method and status",
            ["route", "method", "status"],
            registry=registry,
        )
        self.duration = Histogram(
            "cubeaccel_api_request_duration_seconds",
            "API request duration (to the end of the response body)",
            ["route", "method"],
            registry=registry,
            buckets=API_BUCKETS,
        )
        self.errors = Counter(
            "cubeaccel_api_errors", "API error replies by stable error code", ["code"], registry=registry
        )
        self.auth_denials = Counter(
            "cubeaccel_auth_denials", "Requests refused by authentication or authorization", ["code"], registry=registry
        )
        self.quota_denials = Counter(
            "cubeaccel_quota_denials", "Requests refused by a tenant's quota", ["code"], registry=registry
        )

    def record(self, scope: Mapping[str, Any], status: int, seconds: float, rid: str) -> None:
        route = getattr(scope.get("route"), "path", None) or "unmatched"
        method = str(scope.get("method", "?"))
        self.requests.labels(route, method, str(status)).inc()
        self.duration.labels(route, method).observe(seconds)
        code = scope.get("state", {}).get("error_code") if status >= 400 else None
        if code is not None:
            self.errors.labels(code).inc()
            if code.startswith("quota."):
                self.quota_denials.labels(code).inc()
        if status in (401, 403) or (code or "").startswith("auth."):
            self.auth_denials.labels(code or "unknown").inc()
        if api_log.isEnabledFor(logging.INFO):
            client = scope.get("client")
            fields = {
                "component": self.component,
                "method": method,
                "route": route,
                "path": scope.get("path"),
                "status": status,
                "duration_ms": round(seconds * 1000, 3),
                "client": client[0] if client else None,
                "error_code": code,
            }
            log_fields(api_log, logging.INFO, "request", **fields)  # the request's id is still the context's

    async def __call__(self, app: Any, scope: Any, receive: Any, send: Any) -> None:
        """Run `app` for one HTTP request with its id set, then count and log it."""
        state = scope.setdefault("state", {})
        rid = state.get("request_id")
        if not rid:
            given = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), None)
            rid = accept_request_id(given.decode("latin-1") if given is not None else None)
            state["request_id"] = rid
        token = _request_id.set(rid)
        status = 500
        header = (b"x-request-id", rid.encode())

        async def tagged(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = list(message.get("headers", ()))
                if not any(k.lower() == b"x-request-id" for k, _ in headers):
                    headers.append(header)
                message = {**message, "headers": headers}
            await send(message)

        t0 = time.perf_counter()
        try:
            await app(scope, receive, tagged)
        finally:
            self.record(scope, status, time.perf_counter() - t0, rid)
            _request_id.reset(token)
