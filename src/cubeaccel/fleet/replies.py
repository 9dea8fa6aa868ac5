"""A simulated node's replies, built from the Cubelet's own wire models (wire/cubelet_api.py), so CubeMaster parses
exactly what a real Cubelet would send it."""

from __future__ import annotations

from typing import Any

from cubeaccel.fleet.journal import NodeJournal, SimReservation
from cubeaccel.model.bars import BarKind
from cubeaccel.model.device import AcceleratorClass
from cubeaccel.model.states import DeviceState
from cubeaccel.wire.cubelet_api import (
    Bar,
    Checkpoint,
    Device,
    EventPage,
    Health,
    Identity,
    Release,
    Reservation,
    ReservationList,
    ReservationParamsShown,
    ReservationView,
)

SCHEMA_VERSION = 0  # the simulator keeps no on-disk journal
# An H100 PCIe 80GB: a GPU the shipped cuda12-h100 template supports (an HGX/SXM H100 is held out by nodes until
# Fabric Manager partitions are managed, so the template no longer lists it and a fleet of them placed nothing).
GPU_LABELS = {"vendor": "nvidia", "model": "H100-PCIe-80GB", "memory_gib": "80", "architecture": "hopper"}
_IDENTITY = Identity(
    vendor_id="10de",
    device_id="2331",
    subsystem_vendor_id="10de",
    subsystem_device_id="1626",
    class_code="030200",
    revision="a1",
    serial=None,
    bars=[Bar(index=0, size=16 << 20, kind=BarKind.MEM64, prefetch=False)],
)


def device(j: NodeJournal, i: int, now: float) -> Device:
    did = j.device_ids[i]
    sid = j.holder.get(did)
    return Device(
        id=did,
        address=f"0000:{0x18 + i:02x}:00.0",
        state=DeviceState.ATTACHED if sid else DeviceState.ALLOCATABLE,
        sandbox_id=sid,
        reason=None,
        labels={**GPU_LABELS, "backend": "vfio"},
        accel_class=AcceleratorClass.GPU,
        backend="vfio",
        numa_node=0 if i < len(j.device_ids) // 2 else 1,
        iommu_group=20 + i,
        expected_driver="vfio-pci",
        identity=_IDENTITY,
        generation=1,
        updated_at=now,
    )


def reservation(r: SimReservation) -> Reservation:
    facts = Checkpoint(
        v=1,
        shim_started=True,
        started_at=r.created_at,
        image_digest=None,
        workload_token_sha256=None,
        warm_pool=None,
        shim_id=None,
        claimed_at=None,
        claim_acked=False,
        vmm_pid=None,
        vmm_confined=True,
        guest_addresses={},
        detached=[],
        shim_exited=False,
        failure=None,
        network=None,
        kill_at=r.expires_at,
        vmm_survives=False,
        release_waits={},
    )
    return Reservation(
        sandbox_id=r.sandbox_id,
        params=ReservationParamsShown.model_validate(r.params),
        device_ids=list(r.device_ids),
        phase=r.phase,
        created_at=r.created_at,
        expires_at=r.expires_at,
        facts=facts,
        releasing_since=None,
    )


def _devices(j: NodeJournal, r: SimReservation, now: float) -> list[Device]:
    return [device(j, j.device_ids.index(d), now) for d in r.device_ids]


def reservation_view(j: NodeJournal, r: SimReservation, now: float, token: str | None) -> dict[str, Any]:
    return dump(
        ReservationView(
            sandbox_id=r.sandbox_id,
            reservation=reservation(r),
            devices=_devices(j, r, now),
            timeline=[],
            failure=None,
            access_token=token,
        )
    )


def released(j: NodeJournal, r: SimReservation, now: float) -> dict[str, Any]:
    return dump(Release(sandbox_id=r.sandbox_id, released=True, reservation=None, devices=_devices(j, r, now)))


def reservation_list(j: NodeJournal) -> dict[str, Any]:
    return dump(ReservationList(reservations=[reservation(r) for r in j.all()]))


def no_events() -> dict[str, Any]:
    return dump(EventPage(events=[], next=0))


def health(j: NodeJournal) -> dict[str, Any]:
    return dump(Health(status="ok", node=j.name, schema_version=SCHEMA_VERSION))


def dump(m: Any) -> dict[str, Any]:
    out: dict[str, Any] = m.model_dump(mode="json", by_alias=True)
    return out
