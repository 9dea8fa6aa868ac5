"""Run the front door under Hypercorn: plain HTTP/1.1, and HTTP/2 with prior knowledge (the E2B_API_URL/
E2B_SANDBOX_URL way; `Upgrade: h2c` is not honoured: hypercorn_edge.py), or TLS with the operator's certificate,
HTTP/2 and HTTP/1.1 by ALPN (the E2B_DOMAIN way)."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

from cubeaccel.frontdoor.app import FrontDoorConfig, create_app
from cubeaccel.frontdoor.envd import CLIENT_TRANSPORT
from cubeaccel.frontdoor.hypercorn_edge import answer_protocol_errors_in_json, bounded_config, ignore_h2c_upgrade
from cubeaccel.host.service import sdnotify


def read_secret(path: Path) -> str:
    """A key or secret from a file (never from argv, where `ps` shows it)."""
    value = path.read_text().strip()
    if not value:
        raise ValueError(f"{path} is empty")
    return value


def expose_client_sockets() -> None:
    """Each plain-HTTP/1.1 connection's transport in `envd.CLIENT_TRANSPORT`, so that a stream cut upstream can
    be cut with a reset (envd.reset_client_connection). Hypercorn gives the app no socket: its per-connection
    server object is wrapped instead, and the value reaches the app's tasks as their context is copied. Not for
    TLS: there HTTP/2 multiplexes streams on one connection, which one stream's failure must not reset."""
    from hypercorn.asyncio import tcp_server

    original = tcp_server.TCPServer.__init__
    if getattr(original, "cubeaccel_wrapped", False):
        return

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if self.writer.get_extra_info("ssl_object") is None:
            CLIENT_TRANSPORT.set(self.writer.transport)

    init.cubeaccel_wrapped = True  # type: ignore[attr-defined]
    setattr(tcp_server.TCPServer, "__init__", init)  # noqa: B010


def serve(cfg: FrontDoorConfig, listen: str, certfile: Path | None = None, keyfile: Path | None = None) -> None:
    from hypercorn.asyncio import serve as hypercorn_serve

    expose_client_sockets()
    answer_protocol_errors_in_json()
    ignore_h2c_upgrade()
    hc = bounded_config(listen)  # header, idle and header-size bounds; bodies: the shared edge guard (app.py)
    if certfile is not None:
        hc.certfile = str(certfile)
        hc.keyfile = str(keyfile) if keyfile else None
        hc.alpn_protocols = ["h2", "http/1.1"]
    stop = asyncio.Event()

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        scheme = "https" if certfile else "http"
        print(f"cubeaccel api: serving E2B on {scheme}://{listen} (CubeMaster {cfg.master_url})", file=sys.stderr)
        host, _, port = listen.rpartition(":")
        ready = asyncio.create_task(sdnotify.when_listening(host.strip("[]") or "127.0.0.1", int(port), "api"))
        try:
            await hypercorn_serve(create_app(cfg), hc, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
        finally:
            ready.cancel()
            sdnotify.stopping()

    asyncio.run(run())
