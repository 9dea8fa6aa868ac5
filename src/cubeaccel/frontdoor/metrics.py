"""`GET /sandboxes/{id}/metrics`: the guest's own 5 s samples as E2B's SandboxMetric list, the newest with the
sandbox's devices (the node's state for each, and what the guest sees of it)."""

from __future__ import annotations

from collections.abc import Collection
from datetime import UTC, datetime
from typing import Any

from cubeaccel.wire.cubelet_api import Device
from cubeaccel.wire.e2b_api import GuestMetrics, GuestPciDevice, MetricDevice, SandboxMetric


def window(start: str | None, end: str | None) -> tuple[int | None, int | None]:
    """The SDK's `start`/`end` query (Unix seconds); anything else is a 400 by the caller."""
    return (int(start) if start else None, int(end) if end else None)


def devices_of(
    device_ids: Collection[str], node_devices: list[Device], seen: list[GuestPciDevice]
) -> list[MetricDevice]:
    """The sandbox's devices (`device_ids`) among its node's (the Cubelet's device records)."""
    mine = set(device_ids)
    out = []
    for d in node_devices:
        if d.id not in mine:
            continue
        vendor, device = f"0x{d.identity.vendor_id}", f"0x{d.identity.device_id}"
        guest = [g for g in seen if (g.vendor, g.device) == (vendor, device)]
        out.append(
            MetricDevice.model_validate(
                {"id": d.id, "state": str(d.state), "class": str(d.accel_class), "guest": guest}
            )
        )
    return out


def e2b_metrics(
    guest: GuestMetrics, start: int | None, end: int | None, devices: list[MetricDevice]
) -> list[dict[str, Any]]:
    picked = [s for s in guest.samples if (start is None or s.ts >= start) and (end is None or s.ts <= end)]
    out = []
    for i, s in enumerate(picked):
        out.append(
            SandboxMetric.model_validate(
                {
                    "timestamp": datetime.fromtimestamp(s.ts, UTC).isoformat().replace("+00:00", "Z"),
                    "timestamp_unix": s.ts,
                    "cpu_count": s.cpu_count,
                    "cpu_used_pct": s.cpu_used_pct,
                    "mem_used": s.mem_used,
                    "mem_total": s.mem_total,
                    "mem_cache": s.mem_cache,
                    "disk_used": s.disk_used,
                    "disk_total": s.disk_total,
                    "devices": devices if i == len(picked) - 1 else None,
                }
            ).body()
        )
    return out
