"""Cubelet reads a VMM's confinement from /proc itself before a device may reach it (issue 15, deliverable 1).

The shim proves confinement and reports `vmm_confined`; Cubelet does not take its word: it re-reads the pid it was
told about, and a device attached without that proof never becomes `attached` — the start fails with
`vmm.not_confined` and the device goes through the release path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.cubelet.shim_driver import SimulatedShimDriver
from cubeaccel.host.vmm.confine import cubelet_verdict
from cubeaccel.model.states import DeviceState
from cubeaccel.wire.reports import ReportDetails, VmmConfined, VmStarted
from tests.support.cubelet_harness import Node


@dataclass
class RealShimLike(SimulatedShimDriver):
    """The simulated node, but Cubelet treats it as launching real VMMs; `vouch` makes it report `vmm_confined`
    for the VMM it started (a pid Cubelet can read: this test process, root and unconfined)."""

    vouch: bool = False

    host_devices = True

    def _report(self, sid: str, details: ReportDetails, dev_ids: tuple[str, ...] = ()) -> None:
        if isinstance(details, VmStarted):
            details = VmStarted(**{**details.to_json(), "pid": os.getpid()})
        super()._report(sid, details, dev_ids)
        if isinstance(details, VmStarted) and self.vouch:
            super()._report(sid, VmmConfined.model_validate({"pid": os.getpid(), "uid": 1900000001, "seccomp": 2}))


def node_with(tmp_path: Path, vouch: bool) -> Node:
    node = Node.create(tmp_path)
    node.shim = RealShimLike(node.host, vouch=vouch)
    node.cubelet = node._build()
    node.cubelet.shim.bind(node.cubelet.handle_report)
    return node


def started(node: Node, sid: str) -> list[tuple[str, str | None]]:
    """(kind, reason) of the sandbox's events; a device transition's kind is its event (`attach_succeeded`)."""
    node.cubelet.reserve(sid, ReservationRequest(count=1))
    node.cubelet.start(sid)
    return [
        (str(e.event) if e.kind == "transition" else e.kind, e.reason)
        for e in node.cubelet.store.events()
        if e.sandbox_id == sid
    ]


def refused_then_released(node: Node, events: list[tuple[str, str | None]]) -> None:
    kinds = [k for k, _ in events]
    assert "attach_succeeded" not in kinds and "sandbox_running" not in kinds
    assert ("teardown_started", "vmm.not_confined") in events
    assert kinds.index("teardown_started") < kinds.index("reservation_closed")  # the release path ran to its end
    assert "scrub_finished" in kinds
    assert [d.state for d in node.cubelet.store.devices()].count(DeviceState.ALLOCATABLE) == len(node.devices())


def test_a_vmm_the_shim_vouches_for_is_read_from_proc_and_refused_when_it_is_not_confined(tmp_path: Path) -> None:
    node = node_with(tmp_path, vouch=True)
    events = started(node, "sb-vouched")
    refused_then_released(node, events)
    kinds = [k for k, _ in events]
    # refused on the proof itself (vm_started, vmm_confined), before the guest or any device was reported
    assert kinds[: kinds.index("teardown_started")].count("shim_report") == 2


def test_a_device_attached_without_a_confinement_proof_never_becomes_attached(tmp_path: Path) -> None:
    node = node_with(tmp_path, vouch=False)
    refused_then_released(node, started(node, "sb-unproven"))


def test_cubelets_own_reading_lists_every_way_a_process_is_not_confined() -> None:
    """This test process: root, every capability, no seccomp filter, Cubelet's own mount namespace."""
    bad = cubelet_verdict(os.getpid(), 0)
    text = "; ".join(bad)
    assert "claimed uid 0" in text and "CapEff" in text and "seccomp mode" in text and "mount namespace" in text
    assert any("uid" in b for b in cubelet_verdict(os.getpid(), os.getuid() + 1))
    assert cubelet_verdict(2**22 + 12345, 1900000001)[0].startswith("VMM ")  # no such pid: unreadable, refused
