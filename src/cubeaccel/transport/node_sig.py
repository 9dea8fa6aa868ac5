"""Signed node requests: Cubelet ↔ CubeMaster never send the node token itself, so a copy of one request cannot be
used again, and a captured request is no key to make others (docs/security.md, docs/decisions.md).

Each request carries `Authorization: CubeSig <node>:<generation>:<unix time>:<nonce>:<hmac>` and
`X-Cube-Content-Sha256: <sha256 of the body>`; the HMAC, keyed with the node token, covers the method, the
path with its query, the time, the nonce and the body's hash. The receiver (CubeMaster, which derives the token
from node and generation; the Cubelet, which holds it) refuses a signature that does not match, a time more
than `WINDOW_S` from its clock, and a nonce it has seen within the window (`NonceCache`).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import httpx

SCHEME = "CubeSig"
BODY_HEADER = "x-cube-content-sha256"
WINDOW_S = 60.0  # clock skew plus delivery time accepted; a nonce is remembered this long
EMPTY_SHA = hashlib.sha256(b"").hexdigest()


@dataclass(frozen=True)
class Claim:
    node: str
    generation: int
    at: float
    stamp: str  # `at` as it was signed
    nonce: str
    sig: str
    body_sha: str


def _message(method: str, target: str, at: str, nonce: str, body_sha: str) -> bytes:
    return "\n".join((method.upper(), target, at, nonce, body_sha)).encode()


def token_parts(token: str) -> tuple[str, int]:
    """(node, generation) of a `cbn:<node>:<generation>:<mac>` token; ("", 0) for another shape (tests)."""
    parts = token.split(":")
    if len(parts) == 4 and parts[0] == "cbn" and parts[2].isdigit():
        return parts[1], int(parts[2])
    return "", 0


def sign(token: str, method: str, target: str, body: bytes, at: float | None = None) -> dict[str, str]:
    """The headers that authenticate one request; `target` is the decoded path plus `?query` if any."""
    node, gen = token_parts(token)
    stamp = f"{time.time() if at is None else at:.3f}"
    nonce = secrets.token_hex(16)
    body_sha = hashlib.sha256(body).hexdigest()
    mac = hmac.new(token.encode(), _message(method, target, stamp, nonce, body_sha), hashlib.sha256).hexdigest()
    return {"Authorization": f"{SCHEME} {node}:{gen}:{stamp}:{nonce}:{mac}", BODY_HEADER: body_sha}


def target_of(path: str, query: str | bytes) -> str:
    q = query.decode() if isinstance(query, bytes) else query
    return unquote(path) + (f"?{q}" if q else "")


def parse(header: str | None, body_sha: str | None) -> Claim | None:
    """The claim in a `CubeSig` header, or None for another scheme or a malformed one."""
    if not header or not header.startswith(SCHEME + " "):
        return None
    parts = header[len(SCHEME) + 1 :].strip().split(":")
    if len(parts) != 5 or not parts[1].isdigit() or len(parts[3]) != 32 or len(parts[4]) != 64:
        return None
    try:
        at = float(parts[2])
    except ValueError:
        return None
    return Claim(parts[0], int(parts[1]), at, parts[2], parts[3], parts[4], body_sha or "")


class NonceCache:
    """Nonces seen within the window: a second use of one is a replay."""

    def __init__(self, window_s: float = WINDOW_S, limit: int = 200_000) -> None:
        self.window_s, self.limit = window_s, limit
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def first_use(self, nonce: str, now: float) -> bool:
        with self._lock:
            if len(self._seen) > self.limit:  # bounded: forget what the window no longer covers
                self._seen = {n: t for n, t in self._seen.items() if t > now - 2 * self.window_s}
            if nonce in self._seen:
                return False
            self._seen[nonce] = now
            return True


def check(claim: Claim, token: str, method: str, target: str, cache: NonceCache) -> str | None:
    """None when the signed headers are authentic and fresh, else why not. Needs no body: a receiver reads
    the body only for a caller that proved it holds the token, then asks `body_matches`."""
    expect = hmac.new(
        token.encode(), _message(method, target, claim.stamp, claim.nonce, claim.body_sha), hashlib.sha256
    ).hexdigest()
    if not hmac.compare_digest(expect, claim.sig):
        return "the signature does not match"
    now = time.time()
    if abs(now - claim.at) > WINDOW_S:
        return f"signed {now - claim.at:.0f}s from this clock (±{WINDOW_S:.0f}s accepted)"
    if not cache.first_use(claim.nonce, now):
        return "a replay: this nonce was used already"
    return None


def body_matches(claim: Claim, body: bytes) -> bool:
    return hmac.compare_digest(hashlib.sha256(body).hexdigest(), claim.body_sha)


class TokenFile:
    """The node token from `--node-token-file`, read at every use (a few bytes): enrolling the node onto that
    file (`cubeaccel node-credential enrol NODE --out FILE`) rotates it without a restart. A file caught empty
    mid-rewrite keeps the token read before."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._value: str | None = None

    def current(self) -> str | None:
        try:
            value = self.path.read_text().strip()
        except FileNotFoundError:
            value = ""
        if value:
            self._value = value
        return self._value


class NodeAuth(httpx.Auth):
    """httpx signing for a node's requests; `token` is the token or a function giving the current one."""

    requires_request_body = True

    def __init__(self, token: str | Callable[[], str | None]) -> None:
        self._token = token

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        token = self._token() if callable(self._token) else self._token
        if token:
            target = target_of(request.url.path, request.url.query)
            request.headers.update(sign(token, request.method, target, request.content))
        yield request
