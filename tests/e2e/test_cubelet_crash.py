"""SIGKILL the real Cubelet process between lifecycle steps; the restarted one must converge safely.

Each test starts its own Cubelet: it kills and restarts it, which no shared process survives."""

from __future__ import annotations

from pathlib import Path

import pytest

from cubeaccel.host.pci.simulated import SimulatedPciHost
from tests.support.cubelet_process import CubeletProcess
from tests.support.poll import poll

STEPS = ["reserved", "attached", "releasing_stuck_holder"]


def _states(p: CubeletProcess) -> dict[str, str]:
    return {d.id: d.state for d in p.client.devices()}


@pytest.mark.parametrize("step", STEPS)
def test_sigkill_between_steps_then_restart_converges(tmp_path: Path, step: str) -> None:
    p = CubeletProcess(tmp_path, "h100x4", "--release-timeout", "1").start()
    try:
        c = p.client
        body = c.reserve("sb", 2, start=step != "reserved")
        devs = [d.id for d in body.devices]
        host = SimulatedPciHost(path=tmp_path / "simulated-host.json")
        if step == "releasing_stuck_holder":
            from cubeaccel.host.pci.simulated import Fault
            from cubeaccel.model.device import PciAddress

            for d in body.devices:
                host.inject(Fault.HOLDER_STUCK, PciAddress.parse(d.address))
            c.release("sb")
        p.sigkill()
        p.start()
        states = _states(p)
        # Nothing is double-allocated or falsely freed across the crash.
        if step == "reserved":
            assert [states[d] for d in devs] == ["reserved", "reserved"]
            c.release("sb")
            poll(lambda: all(s == "allocatable" for s in _states(p).values()))
        elif step == "attached":
            assert [states[d] for d in devs] == ["attached", "attached"]  # the VMM survived the crash
            assert host.find_process("vmm:sb") is not None
            c.release("sb")
            poll(lambda: all(s == "allocatable" for s in _states(p).values()))
            assert host.find_process("vmm:sb") is None
        else:

            def quarantined() -> dict[str, str] | None:
                s = _states(p)
                return s if all(s[d] == "quarantined" for d in devs) else None

            final = poll(quarantined)
            assert all(final[d] == "quarantined" for d in devs)
            reasons = {d.reason for d in c.devices() if d.id in devs}
            assert reasons == {"release.holder_stuck"}
        others = [s for d, s in _states(p).items() if d not in devs]
        assert others == ["allocatable", "allocatable"]
    finally:
        p.stop()


def test_vmm_killed_while_cubelet_is_down_is_reconciled_and_released(tmp_path: Path) -> None:
    p = CubeletProcess(tmp_path, "h100x2").start()
    try:
        devs = [d.id for d in p.client.reserve("sb", 1, start=True).devices]
        p.sigkill()
        host = SimulatedPciHost(path=tmp_path / "simulated-host.json")
        vmm = host.find_process("vmm:sb")
        assert vmm is not None and host.kill(vmm)
        p.start()
        assert _states(p)[devs[0]] == "allocatable"
        repairs = [e for e in p.client.events().events if e.kind == "reconcile_repair"]
        assert repairs and repairs[0].reason == "VMM is gone"
    finally:
        p.stop()
