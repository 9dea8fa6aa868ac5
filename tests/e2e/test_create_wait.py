"""Create returns when ready, through the API and the CLI, against a real CubeMaster and Cubelet processes
(simulated host): `?wait=` answers with the running sandbox, the node's start phases come through CubeMaster
(`GET /v1/sandboxes/{id}/events`, which holds the node token), and `sandbox create` prints them."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from typer.testing import CliRunner

from cubeaccel.cli.root import app as cli
from cubeaccel.host.pci.simulated import SimulatedPciHost
from cubeaccel.master.up import run_down, run_up
from cubeaccel.transport.cubelet_client import CubeletClient
from cubeaccel.transport.master_client import MasterClient
from tests.support.master_harness import Cluster
from tests.support.poll import poll

PROFILES = {"w": "2xh100"}
START_PHASES = ["VM up", "memory pinned", "device attached", "guest validated"]  # what the simulated shim reports


def test_create_with_wait_answers_running_and_the_phases_come_through_cubemaster(c: Cluster) -> None:
    s = c.c.create({"gpu": "H100:1", "id": "wait-1"}, wait_s=60)
    assert s.state == "running" and s.access_token
    events = c.c.sandbox_events("wait-1")
    assert events.node_answered is True and events.state == "running"
    assert [p.phase for p in events.phases] == START_PHASES
    assert [p.at for p in events.phases] == sorted(p.at for p in events.phases)


def test_the_cli_shows_the_nodes_phases_live(c: Cluster) -> None:
    root = cli
    env = {"CUBEACCEL_MASTER": c.master.url, "CUBEACCEL_API_KEY": c.master.admin_key, "COLUMNS": "200"}
    out = CliRunner().invoke(root, ["sandbox", "create", "--gpu", "H100:1", "--id", "wait-cli"], env=env)
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    shown = [p for p in START_PHASES if any(line.strip().endswith(p) for line in lines)]
    assert shown == START_PHASES, out.output
    order = [next(i for i, line in enumerate(lines) if line.strip().endswith(p)) for p in START_PHASES]
    assert order == sorted(order), out.output  # in time order
    as_json = CliRunner().invoke(root, ["sandbox", "create", "--gpu", "H100:1", "--json", "--id", "wait-j"], env=env)
    assert json.loads(as_json.output)["state"] == "running"


def test_up_with_its_warm_sandbox_create_kill_create_kill_create_gets_the_device_back_each_time(
    tmp_path: Path,
) -> None:
    """The embedded default (`up`, its warm sandbox kept) on one GPU whose resets are slow (the killed sandbox's
    device is still being released when the next create comes): every create waits for the device and runs; none
    is answered 409 because the node's capacity was in motion (the release, the pool refilling)."""
    assert run_up(tmp_path, "simulated", "h100x1", detach=True, warm=1) == 0
    try:
        host = SimulatedPciHost(path=tmp_path / "cubelet" / "simulated-host.json")
        node = CubeletClient(socket=tmp_path / "cubelet" / "cubelet.sock")
        poll(lambda: node.request("GET", "/v1/warm/pools")["pools"][0]["warm"] == 1, 30, what="one warm sandbox")
        info = json.loads((tmp_path / "up.json").read_text())
        c = MasterClient(info["master_url"], key=(tmp_path / "default.key").read_text().strip())
        host.set_reset_delay(1.5)
        made = c.create({"gpu": "H100:1"}, wait_s=60)
        for _ in range(2):
            assert made.state == "running", made
            _kill_under_way(c, made.id)
            made = c.create({"gpu": "H100:1"}, wait_s=60)
        assert made.state == "running", made
        (pool,) = node.request("GET", "/v1/warm/pools")["pools"]
        assert pool["failures"] == 0  # the refill waited for the device; it never failed for want of one
        c.close()
        node.close()
    finally:
        host.set_reset_delay(0.0)
        assert run_down(tmp_path) == 0


def _kill_under_way(c: MasterClient, sid: str) -> None:
    """The kill sent (its reply comes after the slow reset) and under way."""
    threading.Thread(target=c.delete, args=(sid,), daemon=True).start()
    poll(lambda: c.sandbox(sid).state in ("deleting", "deleted"), 30, what="the kill under way")
