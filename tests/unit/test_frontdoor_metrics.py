"""The front door's metrics reply: the guest's samples within the SDK's window, as E2B's SandboxMetric, the
newest with the sandbox's devices matched to what the guest sees."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.frontdoor.metrics import devices_of, e2b_metrics
from cubeaccel.wire.cubelet_api import Device
from cubeaccel.wire.e2b_api import GuestMetrics

EDU = {"address": "0000:00:05.0", "vendor": "0x1234", "device": "0x11e8", "class": "0x00ff00", "driver": ""}


def guest(ts: list[int]) -> GuestMetrics:
    sample = {"cpu_count": 2, "cpu_used_pct": 1.5, "mem_total": 100, "mem_used": 40, "disk_used": 5, "disk_total": 9}
    return GuestMetrics.model_validate({"samples": [{"ts": t, **sample} for t in ts], "devices": [EDU]})


def node_devices() -> list[Device]:
    ident: dict[str, object] = {
        "vendor_id": "1234",
        "device_id": "11e8",
        "subsystem_vendor_id": "0000",
        "subsystem_device_id": "0000",
    }
    ident |= {"class_code": "120000", "revision": "10", "serial": None, "bars": []}
    common: dict[str, object] = {
        "address": "0000:00:03.0",
        "reason": None,
        "labels": {},
        "class": "accelerator",
        "backend": "emulated",
    }
    common |= {"numa_node": 0, "iommu_group": None, "expected_driver": None, "identity": ident}
    common |= {"generation": 1, "updated_at": 0.0}
    return [
        Device.model_validate({"id": "d1", "state": "attached", "sandbox_id": "s1", **common}),
        Device.model_validate({"id": "d2", "state": "allocatable", "sandbox_id": None, **common}),
    ]


def test_the_newest_sample_carries_the_sandboxs_devices_and_what_the_guest_sees() -> None:
    g = guest([100, 105, 110])
    devices = devices_of(["d1"], node_devices(), g.devices)
    out = e2b_metrics(g, None, None, devices)
    assert [m["timestampUnix"] for m in out] == [100, 105, 110]
    assert out[0]["timestamp"] == "1970-01-01T00:01:40Z" and out[0]["memCache"] == 0 and "devices" not in out[0]
    assert out[-1]["devices"] == [{"id": "d1", "state": "attached", "class": "accelerator", "guest": [EDU]}]


@given(st.lists(st.integers(0, 1000), max_size=30), st.none() | st.integers(0, 1000), st.none() | st.integers(0, 1000))
def test_the_window_keeps_exactly_the_samples_inside_it(ts: list[int], start: int | None, end: int | None) -> None:
    out = e2b_metrics(guest(sorted(ts)), start, end, [])
    inside = [t for t in sorted(ts) if (start is None or t >= start) and (end is None or t <= end)]
    assert [m["timestampUnix"] for m in out] == inside
