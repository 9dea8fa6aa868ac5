"""Run the front door under Hypercorn: plain HTTP/1.1 (the E2B_API_URL/E2B_SANDBOX_URL way) or TLS with the
operator's certificate, HTTP/2 and HTTP/1.1 by ALPN (the E2B_DOMAIN way)."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

from cubeaccel.frontdoor.app import FrontDoorConfig, create_app
from cubeaccel.host import sdnotify


def read_secret(path: Path) -> str:
    """A key or secret from a file (never from argv, where `ps` shows it)."""
    value = path.read_text().strip()
    if not value:
        raise ValueError(f"{path} is empty")
    return value


def serve(cfg: FrontDoorConfig, listen: str, certfile: Path | None = None, keyfile: Path | None = None) -> None:
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    hc = Config()
    hc.bind = [listen]
    hc.accesslog = None
    hc.keep_alive_timeout = 75  # above the SDK's idle keepalive interval
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
