"""Stage 3 (reservation) and stage 5 (guest) of the compatibility contract, inside Cubelet."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.model.contract import CompatibilityContract, freeze
from cubeaccel.model.reservation_params import parse_contract
from cubeaccel.model.states import DeviceState
from cubeaccel.protocol.errors import CubeError
from cubeaccel.protocol.reports import GuestPciDevice, GuestReport, ShimReport, ShimReportKind
from cubeaccel.wire.templates import load_template
from tests.support.cubelet_harness import Node

EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "cubeaccel" / "examples" / "templates"


def _h100_contract() -> CompatibilityContract:
    return freeze(load_template(EXAMPLES / "cuda12-h100.yaml"))


def test_contract_matching_devices_are_reserved(tmp_path: Path) -> None:
    node = Node.create(tmp_path, "2xt4,2xh100")
    res = node.cubelet.reserve("sb", ReservationRequest(count=2, contract=_h100_contract()))
    assert {node.device(d).labels["model"] for d in res.device_ids} == {"H100-PCIe-80GB"}
    assert res.params.memory_mib == 65536  # the contract's memory wins


def test_reservation_refused_by_check_device_leaves_devices_allocatable_and_no_row(tmp_path: Path) -> None:
    node = Node.create(tmp_path, "t4x2")
    events_before = len(node.cubelet.store.events())
    with pytest.raises(CubeError) as err:
        node.cubelet.reserve("sb", ReservationRequest(count=1, contract=_h100_contract()))
    assert err.value.layer == "host_hardware"
    assert err.value.code == "compat.device_not_supported"
    assert err.value.details["violations"][0]["expected"] == "10de:2331 or 10de:2321"
    assert set(node.states().values()) == {DeviceState.ALLOCATABLE}
    assert node.cubelet.store.reservation("sb") is None
    assert len(node.cubelet.store.events()) == events_before


def test_tampered_contract_is_refused(node: Node) -> None:
    c = _h100_contract().to_json()
    c["document"]["spec"]["memory"]["size_mib"] = 1024
    with pytest.raises(CubeError) as err:  # as a peer's JSON is parsed (the body of POST /v1/reservations)
        node.cubelet.reserve("sb", ReservationRequest(count=1, contract=parse_contract(c)))
    assert err.value.code == "contract.digest_mismatch"
    assert node.cubelet.store.reservation("sb") is None


def test_guest_report_without_the_nvidia_driver_tears_the_sandbox_down(node: Node) -> None:
    res = node.cubelet.reserve("sb", ReservationRequest(count=1, contract=_h100_contract()))
    node.cubelet.start("sb")
    dev = res.device_ids[0]
    assert node.device(dev).state is DeviceState.ATTACHED
    report = GuestReport(
        agent_version=1,
        kernel_release="6.1.0-57-amd64",
        module_failures={"nvidia": "modprobe: FATAL: Module nvidia not found"},
        pci_devices=(GuestPciDevice("0000:01:00.0", "10de", "2331", "030200"),),
    )
    # Even a shim that claims success is judged again on the host.
    start_id = node.cubelet.store.reservation("sb").checkpoint.start_id  # type: ignore[union-attr]
    node.cubelet.handle_report(
        ShimReport("sb", ShimReportKind.GUEST_VALIDATED, (dev,), {"report": report.to_json()}, 0.0, start_id)
    )
    checked = [e for e in node.cubelet.store.events() if e.kind == "guest_checked"]
    layers = {v["layer"] for v in checked[-1].details["violations"]}
    assert "modules_img" in layers or "kernel_driver" in layers
    assert node.device(dev).state is DeviceState.ALLOCATABLE  # released through the normal rules
    assert node.cubelet.store.reservation("sb") is None


def test_a_node_that_cannot_lock_the_guest_memory_refuses_at_the_pinned_memory_layer(tmp_path: Path) -> None:
    from cubeaccel.cubelet.lifecycle import CubeletConfig

    node = Node.create(tmp_path, "h100x2", CubeletConfig(pinnable_memory_mib=16 * 1024))
    with pytest.raises(CubeError) as err:
        node.cubelet.reserve("sb", ReservationRequest(count=1, contract=_h100_contract()))  # pins 64 GiB
    assert (err.value.layer, err.value.code) == ("pinned_memory", "compat.pinned_memory_insufficient")
    assert node.cubelet.store.reservation("sb") is None


def test_an_inconsistent_frozen_contract_is_refused_even_with_a_valid_digest(node: Node) -> None:
    from dataclasses import replace

    from cubeaccel.model.template_spec import KernelDriver

    t = load_template(EXAMPLES / "cuda12-h100.yaml")
    old_driver = replace(t, kernel_driver=KernelDriver("nvidia", "535.104.05"))  # too old for CUDA 12.4
    with pytest.raises(CubeError) as err:
        node.cubelet.reserve("sb", ReservationRequest(count=1, contract=freeze(old_driver)))
    assert err.value.status == 422 and err.value.layer in ("cuda_runtime", "userspace_driver", "kernel_driver")
    assert node.cubelet.store.reservation("sb") is None


# --- which guest the shim is told to boot -------------------------------------------------------------------


def _shim_reports(node: Node, sid: str, kind: str) -> list[dict[str, Any]]:
    return [e.details for e in node.cubelet.store.events(sandbox_id=sid) if e.kind == "shim_report" and e.event == kind]


def test_the_shim_is_told_the_contracts_pinned_image_by_digest(node: Node) -> None:
    contract = _h100_contract()
    node.cubelet.reserve("sb", ReservationRequest(count=1, contract=contract))
    res = node.cubelet.start("sb")
    pinned = contract.to_json()["document"]["spec"]["guest"]["image"]["digest"]
    assert res is not None and res.checkpoint.image_digest == pinned
    assert [r["image_digest"] for r in _shim_reports(node, "sb", "vm_started")] == [pinned]


def test_a_sandbox_without_a_contract_boots_the_nodes_default_image_recorded_by_digest(node: Node) -> None:
    node.cubelet.reserve("sb", ReservationRequest(count=1))
    res = node.cubelet.start("sb")
    default = node.shim.node_facts().default_image
    assert default is not None and res is not None and res.checkpoint.image_digest == default
    assert [r["image_digest"] for r in _shim_reports(node, "sb", "vm_started")] == [default]


def test_a_node_without_the_pinned_image_fails_the_start_at_layer_template(tmp_path: Path) -> None:
    node = Node.create(tmp_path, "h100x2")
    node.shim.guest_images = node.shim.guest_images[1:]  # only the edu guest is on this node
    res = node.cubelet.reserve("sb", ReservationRequest(count=1, contract=_h100_contract()))
    node.cubelet.start("sb")
    (failed,) = _shim_reports(node, "sb", "attach_failed")
    assert (failed["reason"], failed["layer"]) == ("shim.image_not_found", "template")
    assert _shim_reports(node, "sb", "vm_started") == []  # refused before any VMM
    assert node.device(res.device_ids[0]).state is DeviceState.ALLOCATABLE


def test_bars_read_at_discovery_reach_the_node_facts_and_the_shim_spec(tmp_path: Path) -> None:
    """The H100s' BAR1 (128 GiB) is in the capacity summary CubeMaster sees, on each device handed to the shim,
    and among the layouts a template machine must fit; the T4s the contract does not admit are not."""
    from cubeaccel.cubelet.capacity import capacity_summary
    from cubeaccel.model.bars import Bar, BarKind

    node = Node.create(tmp_path, "2xt4,2xh100")
    aperture = Bar(1, 128 << 30, BarKind.MEM64, prefetch=True)
    summary = capacity_summary(node.cubelet.store.devices(), "n1", ["vfio"])
    h100 = next(g for g in summary.groups if g.labels.get("model") == "H100-PCIe-80GB")
    assert {"index": 1, "size": 128 << 30, "kind": "mem64", "prefetch": True} in [b.model_dump() for b in h100.bars]
    node.cubelet.reserve("sb", ReservationRequest(count=1, contract=_h100_contract()))
    spec = node.cubelet._spec("sb")
    assert aperture in spec.devices[0].bars
    assert len(spec.template_bars) == 1 and aperture in spec.template_bars[0]  # T4 (256 MiB BAR1) not admitted
