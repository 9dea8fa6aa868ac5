"""A warm shim's control socket (docs/warm.md): `control.sock` in its run directory, 0600, one claim per shim.

A warm sandbox starts with an unknowable workload token (made here, never written or sent), so its workload
service refuses every request. Cubelet's claim arrives as one `ShimClaim` line; the bridge rebinds to the
tenant's token (a new mux session whose preamble carries it) and the reply, one `ShimClaimAck` line, is sent
once the guest answers under the new session. Before the rebind, the claim's seed goes into the guest's RNG
(cube-agent's `reseed`); the ack says `reseeded` only when the agent confirmed it. A second claim is refused:
a claimed sandbox stays its tenant's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from cubeaccel.host.service.unix_path import connect_path
from cubeaccel.protocol.errors import CubeError
from cubeaccel.shim.workload_bridge import WorkloadBridge
from cubeaccel.wire import json_guard
from cubeaccel.wire.warm import MAX_CONTROL_LINE, ShimClaim, ShimClaimAck

log = logging.getLogger(__name__)
CONTROL_SOCKET = "control.sock"
REBIND_TIMEOUT_S = 30.0


# What the E2B SDK runs for every command (`commands.run`): a login shell. The first one in a restored guest reads
# bash, its libraries and the profile scripts from disk; run once before the sandbox is warm, a claim's first
# command finds them in the guest's page cache (issue 28: measured ~300 ms of a first command under TCG).
WARM_UP_COMMAND = {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "true"]}}
WARM_UP_END = b'"end":{"exited":true,"status":"exit status 0"}'


def unknowable_token() -> str:
    """A warm sandbox's token before its claim: random, held only by the bridge's preamble."""
    return secrets.token_urlsafe(32)


def warm_up(bridge: WorkloadBridge, token: str) -> bool:
    """Run `WARM_UP_COMMAND` in the guest through the bridge with the warm sandbox's own token (the node's
    command, before any claim: no tenant's); True when it ran to a zero exit. Once it ended, the guest lists no
    process of it."""
    message = json.dumps(WARM_UP_COMMAND).encode()
    body = b"\x00" + struct.pack(">I", len(message)) + message
    head = (
        "POST /process.Process/Start HTTP/1.1\r\nHost: workload\r\nContent-Type: application/connect+json\r\n"
        f"Connect-Protocol-Version: 1\r\nX-Access-Token: {token}\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    try:
        reply = bridge.request(head.encode() + body)
    except (OSError, CubeError):
        log.warning("the warm-up command could not be sent", exc_info=True)
        return False
    if WARM_UP_END not in reply:
        log.warning("the warm-up command did not end with status 0: %r", reply[-200:])
        return False
    return True


class WarmControl:
    def __init__(
        self,
        run_dir: Path,
        bridge: WorkloadBridge,
        on_claim: Callable[[ShimClaim], None],
        reseed: Callable[[str], bool] = lambda seed: False,
    ) -> None:
        self.path = run_dir / CONTROL_SOCKET
        self.bridge = bridge
        self.on_claim = on_claim  # the shim's report of the claim (history for Cubelet's journal)
        self.reseed = reseed  # the seed into the guest's RNG through cube-agent; True once the guest confirmed
        self.claimed = False
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None

    def start(self) -> None:
        self.path.unlink(missing_ok=True)
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            lsock.bind(connect_path(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        lsock.listen(4)
        self._listener = lsock
        threading.Thread(target=self._accept_loop, daemon=True, name="warm control").start()

    def close(self) -> None:
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
        self.path.unlink(missing_ok=True)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(REBIND_TIMEOUT_S + 5)
                ack, claim = self._answer(conn)
                with contextlib.suppress(OSError):
                    conn.sendall(ack.model_dump_json().encode() + b"\n")
            if claim is not None:  # after the ack: the report is history, the claim's caller is waiting
                with contextlib.suppress(Exception):  # a report that cannot be sent costs history, never the claim
                    self.on_claim(claim)

    def _answer(self, conn: socket.socket) -> tuple[ShimClaimAck, ShimClaim | None]:
        """The ack, and the claim when it was taken."""
        raw = bytearray()
        while not raw.endswith(b"\n") and len(raw) <= MAX_CONTROL_LINE:
            chunk = conn.recv(MAX_CONTROL_LINE)
            if not chunk:
                break
            raw += chunk
        try:
            claim = ShimClaim.model_validate(json_guard.loads(bytes(raw)))
        except (ValueError, ValidationError, RecursionError) as e:
            return ShimClaimAck(ok=False, code="warm.claim_malformed", message=str(e)[:300]), None
        with self._lock:
            if self.claimed:
                return ShimClaimAck(ok=False, code="warm.already_claimed", message="this sandbox was claimed"), None
            self.claimed = True
            t0 = time.monotonic()
            try:  # before the rebind: no tenant command can run on the guest's old RNG state
                reseeded = self.reseed(claim.rng_seed)
            except Exception:  # a guest that cannot take the seed still serves; the ack says it was not reseeded
                log.warning("the guest did not take the claim's RNG seed", exc_info=True)
                reseeded = False
            t1 = time.monotonic()
            try:
                self.bridge.rebind(claim.workload_token.get_secret_value(), REBIND_TIMEOUT_S)
            except CubeError as e:
                return ShimClaimAck(ok=False, code=e.code, message=e.message[:300]), None
            t2 = time.monotonic()
        ack = ShimClaimAck(
            ok=True, reseed_ms=round((t1 - t0) * 1000, 1), rebind_ms=round((t2 - t1) * 1000, 1), reseeded=reseeded
        )
        return ack, claim
