"""Create returns when ready, through the API and the CLI, against a real CubeMaster and Cubelet processes
(simulated host): `?wait=` answers with the running sandbox, the node's start phases come through CubeMaster
(`GET /v1/sandboxes/{id}/events`, which holds the node token), and `sandbox create` prints them."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from cubeaccel.cli.root import app as cli
from tests.support.master_harness import Cluster

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
