"""Issue 19 #8: a shim killed during teardown must not cost the whole release timeout.

Once the shim is gone nothing will stop its VMM gracefully, so waiting for the timeout only keeps the devices
(and the VMM's pinned memory) for nothing: the next release pass kills the VMM and the release rules proceed.
"""

from __future__ import annotations

from pathlib import Path

from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.cubelet.reconcile import reconcile
from cubeaccel.model.states import DeviceState
from tests.support.cubelet_harness import Node


def test_a_shim_killed_during_teardown_leaves_no_vmm_and_no_wait(tmp_path: Path) -> None:
    n = Node.create(tmp_path)
    n.cubelet.reserve("sb", ReservationRequest(count=2))
    n.cubelet.start("sb")
    assert n.host.find_process("vmm:sb") is not None

    def killed_mid_teardown(sandbox_id: str) -> None:  # SIGKILL reached the shim before it stopped its VMM
        shim = n.host.find_process(f"shim:{sandbox_id}")
        assert shim is not None
        n.host.kill(shim)

    n.shim.stop = killed_mid_teardown  # type: ignore[method-assign]
    n.cubelet.release("sb")
    reconcile(n.cubelet)  # one tick; the clock has not moved, far from the 10 s release timeout
    assert n.host.find_process("vmm:sb") is None
    assert n.cubelet.store.reservation("sb") is None
    assert set(n.states().values()) == {DeviceState.ALLOCATABLE}
    kinds = n.kinds("sb")
    assert "release_vmm_survives" not in kinds
