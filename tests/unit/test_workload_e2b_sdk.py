"""The real E2B Python SDK against cube-workload, when a Python with `e2b` is named by CUBEACCEL_E2B_PYTHON.

`e2b` is not a project dependency (yet): set up a throwaway venv (`python3 -m venv /tmp/e2b && /tmp/e2b/bin/pip
install e2b`) and point the variable at its python. HTTP/1.1 and the SDK's default ("2", which falls back to
HTTP/1.1 on plain http) are both run; envd versions 0.5.7 (what we report) and the SDK's debug fallback 99.99.99.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.workload_client import ROOT

SDK_PYTHON = os.environ.get("CUBEACCEL_E2B_PYTHON")


@pytest.mark.skipif(not SDK_PYTHON, reason="CUBEACCEL_E2B_PYTHON not set (a Python with the e2b SDK)")
@pytest.mark.parametrize(("http_version", "envd_version"), [("1.1", "0.5.7"), ("2", "99.99.99")])
def test_e2b_sdk_drives_the_workload_service(tmp_path: Path, http_version: str, envd_version: str) -> None:
    import socket
    import sys
    import time

    token = "sdk-" + os.urandom(8).hex()
    (tmp_path / "token").write_text(token)
    with socket.socket() as s:  # a free port for the server (closed before it binds)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err = tmp_path / "stderr"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cubeaccel.workload",
            "serve",
            "--tcp",
            f"127.0.0.1:{port}",
            "--token-file",
            str(tmp_path / "token"),
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        stderr=err.open("wb"),
    )
    try:
        deadline = time.monotonic() + 20
        while b"serving on" not in err.read_bytes():
            assert server.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.02)
        assert SDK_PYTHON is not None
        check = subprocess.run(
            [
                SDK_PYTHON,
                str(ROOT / "tests" / "e2b_sdk_check.py"),
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
        server.terminate()
        server.wait(10)
