"""The serve loop: moves bytes between a file descriptor pair and the protocol.

Works on anything with a file descriptor: a virtio-serial port (/dev/virtio-ports/NAME or /dev/vportNpM),
a serial tty (switched to raw mode), a pipe pair (stdio) or a socket. A virtio-serial port reads EOF
and blocks writes while the host side is disconnected; with `eof="wait"` the agent waits for the host
to come back instead of exiting (the shim may reconnect) and announces `ready` again when it does.
"""

from __future__ import annotations

import os
import select
import sys
import time
from dataclasses import dataclass
from typing import Literal

from cubeaccel.agent.protocol import DEFAULT_MAX_REQUEST_BYTES, Agent, LineFramer, encode, reply_error
from cubeaccel.protocol.agent_messages import Json, ReadyEvent
from cubeaccel.protocol.errors import CubeError

EOF_RETRY_S = 0.2  # poll interval while a virtio port's host side is away (EOF is always "readable")
WRITE_TIMEOUT_S = 10.0
ANNOUNCE_TIMEOUT_S = 0.5


@dataclass(frozen=True)
class ServeOptions:
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    read_timeout_s: float = 5.0  # an unfinished line older than this is dropped with an error reply
    eof: Literal["exit", "wait"] = "exit"
    announce: bool = True  # write a `ready` event line when serving starts (and, on a port, after each EOF)


def log(message: str) -> None:
    print(f"cube-agent: {message}", file=sys.stderr, flush=True)


def write_all(fd: int, data: bytes, timeout_s: float = WRITE_TIMEOUT_S) -> bool:
    """Write everything or give up after `timeout_s` (a host that stops reading must not hang the agent)."""
    deadline = time.monotonic() + timeout_s
    view = memoryview(data)
    while view:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        _, writable, _ = select.select([], [fd], [], remaining)
        if not writable:
            continue
        try:
            written = os.write(fd, view)
        except BlockingIOError:
            continue
        except OSError:
            return False
        view = view[written:]
    return True


def serve(agent: Agent, rfd: int, wfd: int, options: ServeOptions = ServeOptions()) -> int:
    """Serve requests until `shutdown` (returns 0) or EOF with eof="exit" (returns 0)."""
    for fd in {rfd, wfd}:
        if os.isatty(fd):
            import tty  # only for tty channels: a pruned guest python may lack termios

            tty.setraw(fd)  # no echo, no line editing, no 4 KiB canonical-line limit
    framer = LineFramer(options.max_request_bytes)
    announce = options.announce
    partial_since: float | None = None
    while not agent.stopping:
        if announce:  # a virtio port blocks writes while the host is away: try briefly, retry after EOF
            ready = encode(ReadyEvent(agent.hello()).to_json())
            announce = not write_all(wfd, ready, ANNOUNCE_TIMEOUT_S if options.eof == "wait" else WRITE_TIMEOUT_S)
            announce = announce and options.eof == "wait"
        timeout = None
        if partial_since is not None:
            timeout = max(0.0, partial_since + options.read_timeout_s - time.monotonic())
        readable, _, _ = select.select([rfd], [], [], timeout)
        if not readable:
            _send(wfd, reply_error(None, framer.drop_partial()))
            partial_since = None
            continue
        try:
            data = os.read(rfd, 65536)
        except BlockingIOError:
            continue
        except OSError:  # EIO: a pty whose other side closed
            data = b""
        if not data:
            if options.eof == "exit":
                return 0
            if framer.partial:  # the peer that sent half a line is gone; its successor starts clean
                framer.drop_partial()
                partial_since = None
            time.sleep(EOF_RETRY_S)
            announce = options.announce  # the host may be back: tell it again that the agent is here
            continue
        items = framer.feed(data)
        for item in items:
            reply = reply_error(None, item) if isinstance(item, CubeError) else agent.handle_line(item)
            if reply is not None:
                _send(wfd, reply)
            if agent.stopping:
                break
        if not framer.partial:
            partial_since = None
        elif items or partial_since is None:  # a new unfinished line started in this chunk
            partial_since = time.monotonic()
    return 0


def _send(wfd: int, message: Json) -> None:
    if not write_all(wfd, encode(message)):
        log(f"reply dropped (peer not reading): id={message.get('id')!r}")


def poweroff() -> None:
    """Power the guest off (PID 1 helper use): sync, then reboot(2) with RB_POWER_OFF via libc."""
    import ctypes

    os.sync()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.reboot(0x4321FEDC)
