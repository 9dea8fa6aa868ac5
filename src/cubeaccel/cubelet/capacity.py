"""The capacity summary CubeMaster consumes, derived from the store on every call (never cached).

Its shape is `wire.capacity.CapacitySummary`."""

from __future__ import annotations

from collections import Counter
from typing import Any

from cubeaccel.model.device import DeviceRecord
from cubeaccel.model.states import DeviceState
from cubeaccel.wire.capacity import CapacitySummary

SUMMARY_LABELS = ("vendor", "model", "memory_gib", "architecture", "backend")


def capacity_summary(devices: list[DeviceRecord], node: str, backends: list[str]) -> CapacitySummary:
    by_state = Counter(d.state.value for d in devices)
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for d in devices:
        key = (d.accel_class.value, *(d.labels.get(k, "") for k in SUMMARY_LABELS), d.identity.bars)
        g = groups.setdefault(
            key,
            {
                "class": d.accel_class.value,
                "labels": {k: d.labels[k] for k in SUMMARY_LABELS if k in d.labels},
                "total": 0,
                "by_state": Counter(),
                "allocatable_by_numa": Counter(),
                "bars": [b.to_json() for b in d.identity.bars],
            },
        )
        g["total"] += 1
        g["by_state"][d.state.value] += 1
        if d.state is DeviceState.ALLOCATABLE:
            g["allocatable_by_numa"][str(d.numa_node)] += 1
    reasons = Counter(d.reason for d in devices if d.reason and d.state is not DeviceState.ALLOCATABLE)
    return CapacitySummary.model_validate(
        {
            "node": node,
            "backends": backends,
            "total": len(devices),
            "by_state": {s.value: by_state.get(s.value, 0) for s in DeviceState},
            "allocatable": by_state.get(DeviceState.ALLOCATABLE.value, 0),
            "groups": [
                {**g, "by_state": dict(g["by_state"]), "allocatable_by_numa": dict(g["allocatable_by_numa"])}
                for g in groups.values()
            ],
            "unavailable_reasons": dict(reasons),
        }
    )
