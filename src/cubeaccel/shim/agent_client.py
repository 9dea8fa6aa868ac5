"""Host side of cube-agent's JSON-lines protocol over the VMM's virtio-serial socket.

The messages are the agent's own records (protocol/agent_messages.py); a method's result is read leniently (the
guest is untrusted: a mistyped field reads as absent, and the caller judges). Own line buffer over `recv` with
deadlines (a `makefile()` reader is unusable after a timeout). Unsolicited `event` lines (the agent's `ready`
announcement) are remembered, not mistaken for replies.
"""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Callable
from pathlib import Path

from cubeaccel.host.service.unix_path import connect_path
from cubeaccel.protocol.agent_messages import (
    HelloResult,
    Json,
    PciFunction,
    PciResourcesParams,
    PciResourcesResult,
    ProbeParams,
    ProbeReply,
    ReadyEvent,
    ReplyError,
    Request,
    ReseedParams,
    ReseedResult,
    ShutdownParams,
    WaitPciParams,
    WaitPciResult,
    read_reply,
)
from cubeaccel.protocol.agent_protocol import GUEST_ERROR_CODES
from cubeaccel.protocol.error_catalog import CATALOG
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire import json_guard

MAX_REPLY = 4 << 20  # a guest is untrusted: a reply line larger than this ends the conversation


def agent_error(code: str, message: str, layer: str = "guest_kernel", **details: object) -> CubeError:
    return CubeError(code=code, message=message, layer=layer, details=dict(details), status=500)


class AgentClient:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._sock: socket.socket | None = None
        self._buf = bytearray()
        self._next_id = 1
        self.ready_event: ReadyEvent | None = None

    def connect(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(connect_path(self.path))
            except OSError:
                s.close()
                if time.monotonic() > deadline:
                    raise agent_error("agent.connect_failed", f"cannot connect to {self.path}") from None
                time.sleep(0.02)
                continue
            s.setblocking(False)
            self._sock = s
            return

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _readline(self, deadline: float, cancel_fd: int | None = None) -> Json | None:
        """One reply line from an untrusted guest: bounded in size and time; anything unreadable is `{}`.
        A readable `cancel_fd` (the shim's stop pipe) ends the wait at once: teardown never waits on a probe."""
        assert self._sock is not None
        while (end := self._buf.find(b"\n")) < 0:
            if len(self._buf) > MAX_REPLY:
                self.close()
                raise agent_error("agent.reply_too_large", f"agent reply over {MAX_REPLY} bytes without a newline")
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            waits: list[int] = [self._sock.fileno(), *([] if cancel_fd is None else [cancel_fd])]
            readable, _, _ = select.select(waits, [], [], left)
            if not readable:
                return None
            if cancel_fd is not None and cancel_fd in readable:
                raise agent_error("agent.cancelled", "stopped while waiting for cube-agent", layer="cubelet")
            chunk = self._sock.recv(65536)
            if not chunk:
                raise agent_error("agent.disconnected", "agent channel closed by the VMM")
            self._buf += chunk
        line = bytes(self._buf[:end])
        del self._buf[: end + 1]
        try:
            msg = json_guard.loads(line)  # NaN, 1e400, a duplicated key or deep nesting: unreadable, like junk
        except (ValueError, RecursionError):
            return {}
        return msg if isinstance(msg, dict) else {}

    def _send(self, method: str, params: Json, deadline: float) -> int:
        """A guest that stops reading must not hang the shim (teardown included): the send has what is left of
        the call's own bound, never more."""
        assert self._sock is not None
        rid = self._next_id
        self._next_id += 1
        data = json.dumps(Request(rid, method, params).to_json()).encode() + b"\n"
        left = deadline - time.monotonic()
        if left <= 0:
            raise agent_error("agent.timeout", f"no time left to send {method}", method=method)
        self._sock.settimeout(left)
        try:
            self._sock.sendall(data)
        except TimeoutError:
            self.close()  # a half-sent line would garble the next request
            raise agent_error(
                "agent.timeout", f"agent did not read the {method} request in time", method=method
            ) from None
        finally:
            if self._sock is not None:
                self._sock.setblocking(False)
        return rid

    def call(
        self, method: str, params: Json | None = None, timeout_s: float = 10.0, cancel_fd: int | None = None
    ) -> dict[str, object]:
        """One request, its reply's `result` object (read with the method's result type); agent errors become
        CubeErrors with the agent's code and layer."""
        if self._sock is None:
            raise agent_error("agent.not_connected", "agent channel not connected")
        deadline = time.monotonic() + timeout_s
        rid = self._send(method, params or {}, deadline)
        while True:
            msg = self._readline(deadline, cancel_fd)
            if msg is None:
                raise agent_error("agent.timeout", f"no reply to {method} within {timeout_s:.1f} s", method=method)
            if "event" in msg:
                self.ready_event = ReadyEvent.from_json(msg)
                continue
            said, answer = read_reply(msg)
            if said != rid:
                continue
            if answer is None:
                raise agent_error("agent.bad_reply", f"unreadable error reply to {method}", method=method)
            if not isinstance(answer, ReplyError):
                return answer
            code = answer.code if answer.code in GUEST_ERROR_CODES else "agent.error"  # never a host code from a guest
            raise agent_error(
                code,
                answer.message,
                layer=CATALOG[code].layer,
                details=answer.details,
                **({} if code == answer.code else {"guest_code": answer.code}),
            )

    def notify(self, method: str, params: Json, timeout_s: float) -> None:
        """Send a request whose reply nobody waits for (teardown's `shutdown`: the guest may still be busy with
        a request the shim gave up on, and the teardown does not wait for it to finish)."""
        if self._sock is None:
            raise agent_error("agent.not_connected", "agent channel not connected")
        self._send(method, params, time.monotonic() + timeout_s)

    def wait_hello(
        self, timeout_s: float, retry_s: float = 2.0, cancelled: Callable[[], bool] = lambda: False
    ) -> HelloResult:
        """Until the agent answers `hello` (it may still be booting; requests wait in the port until it reads)."""
        deadline = time.monotonic() + timeout_s
        while not cancelled():
            left = deadline - time.monotonic()
            if left <= 0:
                raise agent_error("agent.not_ready", f"cube-agent did not answer within {timeout_s:.0f} s")
            try:
                return HelloResult.from_json(self.call("hello", timeout_s=min(retry_s, left)))
            except CubeError as e:
                if e.code != "agent.timeout":
                    raise
        raise agent_error("agent.cancelled", "stopped while waiting for cube-agent", layer="cubelet")

    def probe(self, params: ProbeParams, timeout_s: float, cancel_fd: int | None = None) -> ProbeReply:
        return ProbeReply.from_json(self.call("probe", params.to_json(), timeout_s, cancel_fd))

    def wait_pci(self, params: WaitPciParams, timeout_s: float, cancel_fd: int | None = None) -> WaitPciResult:
        return WaitPciResult.from_json(self.call("wait_pci", params.to_json(), timeout_s, cancel_fd))

    def pci_resources(self, address: str, timeout_s: float, cancel_fd: int | None = None) -> PciResourcesResult:
        params = PciResourcesParams(address).to_json()
        return PciResourcesResult.from_json(self.call("pci_resources", params, timeout_s, cancel_fd))

    def reseed(self, seed: str, timeout_s: float, cancel_fd: int | None = None) -> ReseedResult:
        return ReseedResult.from_json(self.call("reseed", ReseedParams(seed).to_json(), timeout_s, cancel_fd))

    def scrub(self, params: Json, timeout_s: float, cancel_fd: int | None = None) -> dict[str, object]:
        """The registry's parameters for the method, sent unchanged; the result is judged as wire ScrubReport."""
        return self.call("scrub", params, timeout_s, cancel_fd)

    def shutdown(self, params: ShutdownParams, timeout_s: float) -> None:
        """Asked, not awaited (`notify`)."""
        self.notify("shutdown", params.to_json(), timeout_s)

    def pci_devices(self, timeout_s: float = 10.0) -> list[PciFunction]:
        """The guest's PCI functions, via a probe with an empty contract (no modules loaded)."""
        return self.probe(ProbeParams({"probes": {}}, load_modules=False), timeout_s).pci_devices()
