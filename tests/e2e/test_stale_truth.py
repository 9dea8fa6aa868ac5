"""CubeMaster learns at once what a restarted Cubelet found (issue 30 #8): real `master serve` and `cubelet serve`
processes on the simulated host.

A Cubelet and its sandbox's VMM die together; the Cubelet comes back well inside CubeMaster's staleness bound, so
nothing looks stale. Its first heartbeat after the restart says which sandboxes its reconcile ended, and a new
incarnation makes CubeMaster reconcile the node at once: the sandbox is `failed` within seconds, not at the next
periodic reconcile (60 s). A node that stays silent past the bound shows its sandboxes as `unknown`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cubeaccel.host.pci.simulated import SimulatedPciHost
from tests.support.cubelet_process import CubeletProcess
from tests.support.master_harness import MasterProcess, cubelet, example, wait_nodes_ready
from tests.support.poll import poll

NODE = "n1"
TRUTH_WITHIN_S = 15.0  # generous for a loaded CI machine; the periodic reconcile would take 60 s


def _start(root: Path, staleness: float) -> tuple[MasterProcess, CubeletProcess]:
    master = MasterProcess(root / "master", staleness=staleness).start()
    node = cubelet(root / NODE, "2xh100", NODE, master.url).start()
    wait_nodes_ready(master.client, {NODE})
    master.client.register_template(example("cuda12-h100", spec__memory__size_mib=1024), default=True)
    return master, node


@pytest.fixture
def slow_to_stale(tmp_path: Path) -> Iterator[tuple[MasterProcess, CubeletProcess]]:
    """Staleness far above a Cubelet's restart time: a restart is never seen as a node going stale."""
    master, node = _start(tmp_path, staleness=60.0)
    try:
        yield master, node
    finally:
        node.stop()
        master.stop()


@pytest.fixture
def quick_to_stale(tmp_path: Path) -> Iterator[tuple[MasterProcess, CubeletProcess]]:
    master, node = _start(tmp_path, staleness=1.5)
    try:
        yield master, node
    finally:
        node.stop()
        master.stop()


def _kill_vmm(node: CubeletProcess, sandbox_id: str) -> None:
    host = SimulatedPciHost(path=node.state_dir / "simulated-host.json")
    vmm = host.find_process(f"vmm:{sandbox_id}")
    assert vmm is not None and host.kill(vmm)


def test_cubelet_dying_with_its_vm_is_failed_at_cubemaster_right_after_the_restart(
    slow_to_stale: tuple[MasterProcess, CubeletProcess],
) -> None:
    master, node = slow_to_stale
    sid = master.client.create({"gpu": "H100:1"}, wait_s=20).id
    assert master.client.sandbox(sid).state == "running"
    node.sigkill()
    _kill_vmm(node, sid)
    t0 = time.monotonic()
    node.start()
    final = poll(
        lambda: s if (s := master.client.sandbox(sid)).state != "running" else None,
        TRUTH_WITHIN_S,
        what="CubeMaster shows the dead sandbox",
    )
    took = time.monotonic() - t0
    print(f"restart to CubeMaster's truth: {took:.2f}s")
    assert final.state == "failed", final
    assert final.error is not None and final.error.code == "reconcile.vmm_gone"
    assert final.error.node == NODE
    assert master.client.nodes()[0].state == "ready"  # never seen stale: the heartbeat said it


def test_a_sandbox_on_a_silent_node_is_shown_unknown_and_running_again_when_it_returns(
    quick_to_stale: tuple[MasterProcess, CubeletProcess],
) -> None:
    master, node = quick_to_stale
    sid = master.client.create({"gpu": "H100:1"}, wait_s=20).id
    node.sigkill()
    unknown = poll(
        lambda: s if (s := master.client.sandbox(sid)).state == "unknown" else None, 20, what="shown unknown"
    )
    assert unknown.last_known_state == "running"
    assert [s.state for s in master.client.sandboxes() if s.id == sid] == ["unknown"]
    node.start()  # its VMM survived: the node's reconcile keeps it, and CubeMaster shows it running again
    back = poll(lambda: s if (s := master.client.sandbox(sid)).state == "running" else None, 20, what="running again")
    assert back.last_known_state is None
