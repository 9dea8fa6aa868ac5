"""systemd readiness (`Type=notify`): one datagram to `$NOTIFY_SOCKET` once a server really accepts requests.

The sd_notify protocol is a newline-separated `KEY=VALUE` datagram on a unix socket whose path systemd puts in
`$NOTIFY_SOCKET` (a leading `@` is Linux's abstract namespace). Stdlib only: no libsystemd binding. Without the
variable (not under systemd) every call is a no-op, so the servers send it unconditionally.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any


def notify(message: str) -> bool:
    """Send `message` (e.g. `READY=1`) to systemd; False when not run under a notify-type unit."""
    addr = os.environ.get("NOTIFY_SOCKET", "")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        s.connect(addr)
        s.sendall(message.encode())
    return True


def ready(status: str) -> bool:
    return notify(f"READY=1\nSTATUS={status}\nMAINPID={os.getpid()}")


def stopping() -> bool:
    return notify("STOPPING=1")


async def when_started(servers: Sequence[Any], status: str, then: Callable[[], None] | None = None) -> None:
    """Report READY once every uvicorn server in `servers` listens (their `started` flag), then STOPPING when
    one is told to exit (uvicorn re-raises SIGTERM after serving, so a `finally` would never run). Nothing if a
    server gives up before it listens (a port in use: the unit then fails instead of claiming readiness).
    `then` runs once they listen: what may only be said of a server that answers (a node's heartbeat)."""
    while not all(s.started for s in servers):
        if any(s.should_exit for s in servers):
            return
        await asyncio.sleep(0.02)
    ready(status)
    if then is not None:
        then()
    while not any(s.should_exit for s in servers):
        await asyncio.sleep(0.1)
    stopping()


async def when_listening(host: str, port: int, status: str, deadline_s: float = 60.0) -> bool:
    """READY once `host:port` accepts a TCP connection: for servers with no `started` flag (Hypercorn, the front
    door) — run beside them, e.g. `asyncio.gather(serve(...), when_listening(host, port, "api"))`."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while loop.time() < end:
        try:
            _, writer = await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        writer.close()
        return ready(status)
    return False
