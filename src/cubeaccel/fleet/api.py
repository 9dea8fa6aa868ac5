"""The Cubelet API calls CubeMaster makes, answered for a simulated node: reserve (with start), start, release,
reservation lookups, the event trail, warm claims, health. Each request must carry the node's own signature
(transport/node_sig.py), as the real Cubelet's TCP listener demands.

The reservation body is read for what the journal stores; its frozen contract is carried, not re-checked: the
simulator models placement and its bookkeeping, not compatibility (the real Cubelet's tests cover that).
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from cubeaccel.fleet import replies
from cubeaccel.fleet.http import NodeRequest
from cubeaccel.fleet.journal import NodeJournal
from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport import node_sig

PARAM_KEYS = ("class", "count", "labels", "lifetime_s", "memory_mib", "pin_memory", "template", "tenant", "vcpus")


@dataclass
class Faults:
    """What the simulator injects: latency on every answer, a share of reservations refused as a node whose host
    checks fail would (`host.not_ready`, which CubeMaster retries elsewhere), and the dead and the stale nodes
    (dead: connections closed unanswered and no heartbeats; stale: answering but not heartbeating)."""

    latency_s: float = 0.0
    jitter_s: float = 0.0
    release_s: float = 0.0  # added to a release's answer: devices coming back slowly (scrub, reset)
    error_rate: float = 0.0
    dead: set[int] = field(default_factory=set)
    stale: set[int] = field(default_factory=set)
    rng: random.Random = field(default_factory=random.Random)


@dataclass
class Counters:
    requests: int = 0
    arrived_reserves: int = 0  # reservation requests received, counted before any injected latency
    reserves: int = 0
    refused: int = 0
    releases: int = 0
    dropped: int = 0  # requests to a dead node, closed unanswered
    unauthenticated: int = 0


class FleetApi:
    def __init__(self, journals: list[NodeJournal], tokens: list[str], faults: Faults) -> None:
        self.journals = journals
        self.tokens = tokens
        self.faults = faults
        self.counters = Counters()
        self.nonces = node_sig.NonceCache()

    async def __call__(self, req: NodeRequest) -> tuple[int, dict[str, Any]] | None:
        f = self.faults
        if req.node >= len(self.journals) or req.node in f.dead:
            self.counters.dropped += 1
            return None
        self.counters.requests += 1
        if req.method == "POST" and req.path == "/v1/reservations":
            self.counters.arrived_reserves += 1
        delay = f.latency_s + f.rng.random() * f.jitter_s + (f.release_s if req.method == "DELETE" else 0.0)
        if delay:
            await asyncio.sleep(delay)
            if req.node in f.dead:  # died while answering
                self.counters.dropped += 1
                return None
        try:
            self._authenticate(req)
            return self._route(req)
        except CubeError as e:
            return e.status, e.to_json()

    def _authenticate(self, req: NodeRequest) -> None:
        claim = node_sig.parse(req.headers.get("authorization"), req.headers.get(node_sig.BODY_HEADER))
        why = "no CubeSig signature"
        if claim is not None:
            target = node_sig.target_of(req.path, req.query)
            why = node_sig.check(claim, self.tokens[req.node], req.method, target, self.nonces) or ""
            if not why and not node_sig.body_matches(claim, req.body):
                why = "the body does not match its signed hash"
        if why:
            self.counters.unauthenticated += 1
            raise CubeError("auth.invalid_credential", f"node {self.journals[req.node].name}: {why}", "api")

    def _route(self, req: NodeRequest) -> tuple[int, dict[str, Any]]:
        j, now = self.journals[req.node], time.time()
        parts = [unquote(p) for p in req.path.strip("/").split("/")]
        m = req.method
        if parts[:2] == ["v1", "reservations"]:
            if len(parts) == 2 and m == "POST":
                return self._reserve(j, req.body, now)
            if len(parts) == 2 and m == "GET":
                return 200, replies.reservation_list(j)
            if len(parts) == 3 and m == "GET":
                return 200, replies.reservation_view(j, j.get(parts[2]), now, None)
            if len(parts) == 3 and m == "DELETE":
                res = j.release(parts[2])
                self.counters.releases += 1
                return 200, replies.released(j, res, now)
            if len(parts) == 4 and parts[3] == "start" and m == "POST":
                return 200, replies.reservation_view(j, j.get(parts[2]), now, None)
        if parts == ["v1", "events"] and m == "GET":
            return 200, replies.no_events()
        if parts == ["v1", "warm", "claim"] and m == "POST":
            raise CubeError("warm.no_match", "the simulated node keeps no warm pool", "cubelet", {"reason": "none"})
        if parts == ["v1", "health"] and m == "GET":
            return 200, replies.health(j)
        raise CubeError("api.not_found", f"no route {m} {req.path} on a simulated node", "api")

    def _reserve(self, j: NodeJournal, raw: bytes, now: float) -> tuple[int, dict[str, Any]]:
        try:
            body = json.loads(raw)
            sid, count = str(body["sandbox_id"]), int(body.get("count", 1))
        except (ValueError, KeyError, TypeError) as e:
            raise CubeError("reserve.invalid_sandbox_id", f"a reservation body that does not parse: {e}", "api") from e
        self.counters.reserves += 1
        if self.faults.error_rate and self.faults.rng.random() < self.faults.error_rate:
            self.counters.refused += 1
            raise CubeError("host.not_ready", f"{j.name}: injected host check failure", "host_hardware")
        params = {k: body[k] for k in PARAM_KEYS if body.get(k) is not None}
        lifetime = body.get("lifetime_s")
        res = j.reserve(sid, count, params, float(lifetime) if lifetime is not None else None)
        token = secrets.token_urlsafe(32) if body.get("start") else None
        return 201, replies.reservation_view(j, res, now, token)
