"""A real `cubeaccel api serve` process (the E2B front door) in front of a test's CubeMaster."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import httpx

from tests.support.cubelet_process import terminate
from tests.support.master_harness import free_port
from tests.support.poll import poll


class FrontDoorProcess:
    def __init__(
        self,
        state_dir: Path,
        master_url: str,
        admin_key: str,
        *extra: str,
        host: str = "127.0.0.1",
        scheme: str = "http",
        verify: str | bool = True,
    ) -> None:
        self.state_dir = state_dir
        self.port = free_port()
        self.url = f"{scheme}://{host}:{self.port}"
        self.master_url = master_url
        self.extra = list(extra)
        self.verify = verify
        self.proc: subprocess.Popen[bytes] | None = None
        state_dir.mkdir(parents=True, exist_ok=True)
        self.admin_key_file = state_dir / "admin.key"
        self.admin_key_file.write_text(admin_key)
        self.admin_key_file.chmod(0o600)
        self.secret_file = state_dir / "frontdoor.secret"
        if not self.secret_file.exists():
            self.secret_file.write_text(secrets.token_urlsafe(32))

    def start(self) -> FrontDoorProcess:
        cmd = [
            sys.executable,
            "-m",
            "cubeaccel",
            "api",
            "serve",
            "--master",
            self.master_url,
            "--listen",
            f"127.0.0.1:{self.port}",
            "--admin-key-file",
            str(self.admin_key_file),
            "--secret-file",
            str(self.secret_file),
            *self.extra,
        ]
        log = open(self.state_dir / "frontdoor.log", "ab")  # noqa: SIM115 - child owns it
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})

        def up() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log()
            try:
                return (
                    httpx.get(
                        f"https://127.0.0.1:{self.port}/health"
                        if "--cert" in self.extra
                        else f"http://127.0.0.1:{self.port}/health",
                        verify=self.verify,
                    ).status_code
                    == 200
                )
            except httpx.HTTPError:
                return False

        poll(up, 30, what="the front door answers /health")
        return self

    def log(self) -> str:
        p = self.state_dir / "frontdoor.log"
        return p.read_text(errors="replace")[-3000:] if p.exists() else ""

    def stop(self) -> None:
        terminate(self.proc)
