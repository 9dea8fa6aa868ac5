"""A real CubeMaster process plus real Cubelet processes that heartbeat to it (`--master`)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport.master_client import MasterClient
from cubeaccel.transport.node_sig import NodeAuth
from tests.support.cubelet_process import CubeletProcess, terminate
from tests.support.poll import poll

EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "cubeaccel" / "examples" / "templates"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def example(name: str, **spec: Any) -> dict[str, Any]:
    """An example template document with `spec` keys replaced (memory, metadata)."""
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    for path, value in spec.items():
        node = doc
        *parents, last = path.split("__")
        for p in parents:
            node = node[p]
        node[last] = value
    return doc


RUNNING: dict[str, MasterProcess] = {}  # url → process: cubelet() enrols its node through the admin key


class MasterProcess:
    def __init__(self, state_dir: Path, db: str | None = None, staleness: float = 1.5, *extra: str) -> None:
        """`extra`: more `master serve` options."""
        self.extra = list(extra)
        self.state_dir = state_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.db = db or str(state_dir / "master.db")
        self.staleness = staleness
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = MasterClient(self.url)
        self._tokens: dict[str, str] = {}

    def start(self) -> MasterProcess:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "cubeaccel",
            "master",
            "serve",
            "--db",
            self.db,
            "--state-dir",
            str(self.state_dir),  # its own: CubeMaster locks its state dir (two test masters never share one)
            "--listen",
            f"127.0.0.1:{self.port}",
            "--staleness",
            str(self.staleness),
            "--tick",
            "0.2",
            "--bootstrap",
            str(self.state_dir),
            "--audit-log",
            str(self.audit_log),
            *self.extra,
        ]
        log = open(self.state_dir / "master.log", "ab")  # noqa: SIM115 - child owns it
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        poll(self.client.health)
        self.admin_key = self._key("admin")
        self.tenant_key = self._key("default")
        self.client.close()
        self.client = MasterClient(self.url, key=self.admin_key)
        RUNNING[self.url] = self
        return self

    @property
    def audit_log(self) -> Path:
        return self.state_dir / "audit.jsonl"

    def _key(self, name: str) -> str:
        """This process's bootstrap key, or (a replica on a shared database) the first replica's."""
        path = self.state_dir / f"{name}.key"
        if path.exists():
            return path.read_text().strip()
        other = next(m for m in RUNNING.values() if m.db == self.db)
        return other.admin_key if name == "admin" else other.tenant_key

    def enrol(self, node: str, state_dir: Path) -> Path:
        """A node token for `node`, in a 0600 file under `state_dir` (the Cubelet's --node-token-file)."""
        token = self.client.request("POST", f"/v1/nodes/{node}/credential")["token"]
        state_dir.mkdir(parents=True, exist_ok=True)
        path = state_dir / "node.token"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token)
        return path

    def headers(self) -> dict[str, str]:
        """The admin key, for a raw HTTP call."""
        return {"Authorization": f"Bearer {self.admin_key}"}

    def node_auth(self, node: str) -> NodeAuth:
        """A raw HTTP call as `node` (`httpx.put(..., auth=...)`): signed with its token, enrolled on first use."""
        if node not in self._tokens:
            self._tokens[node] = self.client.request("POST", f"/v1/nodes/{node}/credential")["token"]
        return NodeAuth(self._tokens[node])

    def stop(self) -> None:
        RUNNING.pop(self.url, None)
        terminate(self.proc)
        self.client.close()


def cubelet(state_dir: Path, profile: str, node: str, master_url: str, *extra: str) -> CubeletProcess:
    port = free_port()
    token = RUNNING[master_url].enrol(node, state_dir)
    return CubeletProcess(
        state_dir,
        profile,
        "--master",
        master_url,
        "--listen",
        f"127.0.0.1:{port}",
        "--node",
        node,
        "--node-token-file",
        str(token),
        *extra,
    )


def wait_nodes_ready(client: MasterClient, names: set[str], deadline_s: float = 30.0) -> None:
    poll(lambda: names <= {n.node for n in client.nodes() if n.state == "ready"}, deadline_s)


class Cluster:
    def __init__(
        self,
        root: Path,
        profiles: dict[str, str],
        guest_images: dict[str, list[dict[str, Any]]] | None = None,
        staleness: float = 5.0,
    ) -> None:
        """`guest_images`: node → the simulated image set it reports instead of the default one. `staleness`: long
        enough that a loaded CI machine (Chromium starting beside two Cubelets) never turns both nodes stale between
        heartbeats; tests of staleness poll for it."""
        self.root = root
        self.profiles = profiles
        self.master = MasterProcess(root / "master", staleness=staleness).start()
        self.c = self.master.client
        self.cubelets: dict[str, CubeletProcess] = {}
        for name, profile in profiles.items():
            (root / name).mkdir()
            extra: list[str] = []
            if guest_images and name in guest_images:
                (root / name / "guest-images.json").write_text(json.dumps(guest_images[name]))
                extra = ["--guest-images", str(root / name / "guest-images.json")]
            self.cubelets[name] = cubelet(root / name, profile, name, self.master.url, *extra).start()
        wait_nodes_ready(self.c, set(profiles))
        self.c.register_template(example("cuda12-h100", spec__memory__size_mib=1024), default=True)
        self.c.register_template(
            example("cuda12-h100", metadata__name="cuda12-h100-huge", spec__memory__size_mib=4 * 1024 * 1024)
        )
        self.c.register_template(example("edu-demo"), default=True)

    def refused(self, body: dict[str, Any]) -> CubeError:
        with pytest.raises(CubeError) as e:
            self.c.create(body)
        return e.value

    def reasons(self, body: dict[str, Any]) -> dict[str, str]:
        err = self.refused(body)
        assert err.code == "schedule.unschedulable", err
        return {n: d["reason"] for n, d in err.details["tried"][-1]["nodes"].items()}

    def cleanup(self) -> None:
        for s in self.c.sandboxes("running"):
            self.c.delete(s.id)
        poll(lambda: not self.c.sandboxes("deleting") and not self.c.sandboxes("running"))
        poll(lambda: all(n.allocatable == n.total for n in self.c.nodes() if n.node in self.profiles))

    def stop(self) -> None:
        for p in self.cubelets.values():
            p.stop()
        self.master.stop()


def emulated_cubelet(master: MasterProcess, state_dir: Path, node: str, *extra: str) -> CubeletProcess:
    """A Cubelet on the emulated backend (real MicroVMs), enrolled at `master` as `node`, on a free TCP port;
    not started. `extra`: more `cubelet serve` flags."""
    return CubeletProcess(
        state_dir,
        "-",
        "--backend",
        "emulated",
        "--master",
        master.url,
        "--listen",
        f"127.0.0.1:{free_port()}",
        "--node",
        node,
        "--release-timeout",
        "20",
        *extra,
        "--node-token-file",
        str(master.enrol(node, state_dir)),
    )
