"""Start and stop a real `cubeaccel cubelet serve` process for tests."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

from cubeaccel.host.vmm import vmmproc
from cubeaccel.transport.cubelet_client import CubeletClient
from tests.support.poll import poll


def terminate(proc: subprocess.Popen[bytes] | None, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after a grace; always waited for (no zombie or stray server after a test)."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class CubeletProcess:
    def __init__(self, state_dir: Path, profile: str = "h100x8", *extra: str) -> None:
        """`profile` is the simulated host's; with `--backend` in `extra` that backend is used instead."""
        self.state_dir = state_dir
        self.profile = profile
        self.extra = list(extra)
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = CubeletClient(socket=state_dir / "cubelet.sock")
        self.token: str | None = None
        if "--node-token-file" in self.extra:
            self.token = Path(self.extra[self.extra.index("--node-token-file") + 1]).read_text().strip()
        elif "--listen" in self.extra:  # a standalone TCP listener: the token a test's client presents
            self.token = f"cbn:test:1:{secrets.token_hex(16)}"
            state_dir.mkdir(parents=True, exist_ok=True)
            (state_dir / "node.token").write_text(self.token)
            self.extra += ["--node-token-file", str(state_dir / "node.token")]

    def start(self) -> CubeletProcess:
        backend = [] if "--backend" in self.extra else ["--backend", "simulated", "--profile", self.profile]
        cmd = [
            sys.executable,
            "-m",
            "cubeaccel",
            "cubelet",
            "serve",
            *backend,
            "--state-dir",
            str(self.state_dir),
            "--tick",
            "0.2",
            *self.extra,
        ]
        log = open(self.state_dir / "cubelet.log", "ab")  # noqa: SIM115 - child owns it
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
        poll(lambda: self.client.health())
        return self

    def vmm(self, sandbox_id: str) -> int | None:
        """Pid of this Cubelet's live VMM for `sandbox_id` (another run on the host may use the same id)."""
        return vmmproc.find_vmm(sandbox_id, under=self.state_dir.absolute() / "shims")

    def shim(self, sandbox_id: str) -> int | None:
        return vmmproc.find_shim(sandbox_id, under=self.state_dir.absolute() / "shims")

    def sigkill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        terminate(self.proc)
