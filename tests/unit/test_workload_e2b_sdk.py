"""The real E2B Python SDK against cube-workload, when a Python with `e2b` is named by CUBEACCEL_E2B_PYTHON.

`e2b` is not a project dependency (yet): set up a throwaway venv (`python3 -m venv /tmp/e2b && /tmp/e2b/bin/pip
install e2b`) and point the variable at its python. HTTP/1.1 and the SDK's default ("2", which falls back to
HTTP/1.1 on plain http) are both run; envd versions 0.6.4 (what we report) and the SDK's debug fallback 99.99.99.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from cubeaccel.workload import ENVD_VERSION
from tests.workload_client import ROOT

SDK_PYTHON = os.environ.get("CUBEACCEL_E2B_PYTHON")


@pytest.mark.skipif(not SDK_PYTHON, reason="CUBEACCEL_E2B_PYTHON not set (a Python with the e2b SDK)")
@pytest.mark.parametrize(
    ("transport", "http_version", "envd_version"),
    [("tcp", "1.1", ENVD_VERSION), ("tcp", "2", "99.99.99"), ("mux", "1.1", ENVD_VERSION)],
)
def test_e2b_sdk_drives_the_workload_service(
    tmp_path: Path, transport: str, http_version: str, envd_version: str
) -> None:
    """`mux`: the SDK talks TCP to a proxy that puts each connection on its own mux stream, as the shim will."""
    import socket
    import sys
    import time

    token = "sdk-" + os.urandom(8).hex()
    (tmp_path / "token").write_text(token)
    proxy = channel = None
    pass_fds: tuple[int, ...] = ()
    if transport == "tcp":
        with socket.socket() as s:  # a free port for the server (closed before it binds)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        where = ["--tcp", f"127.0.0.1:{port}"]
    else:
        guest_end, host_end = socket.socketpair()
        where, pass_fds = ["--mux-fd", str(guest_end.fileno())], (guest_end.fileno(),)
    err = tmp_path / "stderr"
    server = subprocess.Popen(
        [sys.executable, "-m", "cubeaccel.workload", "serve", *where, "--token-file", str(tmp_path / "token")],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        stderr=err.open("wb"),
        pass_fds=pass_fds,
    )
    if transport == "mux":
        from cubeaccel.workload.muxchannel import MuxChannel
        from tests.workload_client import MuxTcpProxy

        guest_end.close()
        channel = MuxChannel(host_end.fileno(), host_end.fileno(), client=True)
        proxy = MuxTcpProxy(channel)
        port = proxy.port
    try:
        deadline = time.monotonic() + 20
        while b"serving on" not in err.read_bytes():
            assert server.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.02)
        assert SDK_PYTHON is not None
        check = subprocess.run(
            [
                SDK_PYTHON,
                str(ROOT / "tests" / "e2b" / "sdk_workload_check.py"),
                f"http://127.0.0.1:{port}",
                token,
                envd_version,
                str(tmp_path),
            ],
            env={**os.environ, "E2B_HTTP_VERSION": http_version},
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert check.returncode == 0, check.stdout + check.stderr
        assert "all checks passed" in check.stdout
    finally:
        if proxy is not None and channel is not None:
            proxy.close()
            channel.close()
            host_end.close()
        server.terminate()
        server.wait(10)
