"""Headless Chromium (Debian's `chromium`) driven over the DevTools protocol: a websocket, JSON commands.

No Playwright or Selenium: the browser is the distribution's, the protocol client is twenty lines over
`websockets`. The page is evaluated in its real JavaScript engine, so what a test reads is what a person sees.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.sync.client import ClientConnection, connect

from tests.support.cubelet_process import terminate
from tests.support.poll import poll


def chromium_binary() -> str:
    """The browser, or a skip — a failure where the run must have it (CI, or CUBEACCEL_REQUIRE_BROWSER=1)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("CUBEACCEL_REQUIRE_BROWSER") or os.environ.get("CI"):
            pytest.fail("chromium missing (scripts/install-system-deps.sh installs it)")
        pytest.skip("chromium not installed (scripts/install-system-deps.sh installs it)")
    return found


class Browser:
    def __init__(self, profile_dir: Path) -> None:
        profile_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            chromium_binary(),
            "--headless=new",
            "--no-sandbox",  # tests run as root, where Chromium's own sandbox cannot start
            "--disable-gpu",
            "--no-first-run",
            "--disable-extensions",
            "--disable-background-networking",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",
            f"--user-data-dir={profile_dir}",
            "--window-size=1400,1000",
            "about:blank",
        ]
        log = open(profile_dir.parent / "chromium.log", "ab")  # noqa: SIM115 - the child owns it
        self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        active = profile_dir / "DevToolsActivePort"
        poll(lambda: active.exists() and len(active.read_text().splitlines()) >= 2, 30, what="chromium's DevTools")
        port = int(active.read_text().splitlines()[0])
        pages = poll(lambda: [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json() if t["type"] == "page"])
        self._stack = ExitStack()
        url = pages[0]["webSocketDebuggerUrl"]
        self.ws: ClientConnection = self._stack.enter_context(connect(url, max_size=None, open_timeout=10))
        self._id = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=30))
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))

    def navigate(self, url: str) -> None:
        self.call("Page.enable")
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        got = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in got:
            raise RuntimeError(f"page script failed: {got['exceptionDetails']}")
        return got.get("result", {}).get("value")

    def screenshot(self, path: Path) -> None:
        import base64

        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        try:
            self._stack.close()
        finally:
            terminate(self.proc, grace_s=5.0)
            self.proc = None
