"""Which allocatable devices a reservation takes. Pure: the store's transaction applies the choice."""

from __future__ import annotations

from collections import defaultdict

from cubeaccel.model.device import DeviceRecord
from cubeaccel.model.states import DeviceState


def matches(device: DeviceRecord, accel_class: str | None, labels: dict[str, str]) -> bool:
    if accel_class is not None and device.accel_class.value != accel_class:
        return False
    return all(device.labels.get(k) == v for k, v in labels.items())


def choose_devices(
    devices: list[DeviceRecord], count: int, accel_class: str | None, labels: dict[str, str]
) -> list[DeviceRecord] | None:
    """`count` allocatable matching devices, all on one NUMA node when any node has enough.

    Among nodes that can hold the whole request, the one with the fewest free devices wins
    (packing keeps big NUMA-local blocks free for bigger requests). None when not enough.
    """
    free = [d for d in devices if d.state is DeviceState.ALLOCATABLE and matches(d, accel_class, labels)]
    if len(free) < count:
        return None
    by_node: dict[int, list[DeviceRecord]] = defaultdict(list)
    for d in free:
        by_node[d.numa_node].append(d)
    fitting = [(len(ds), node) for node, ds in by_node.items() if len(ds) >= count]
    if fitting:
        _, node = min(fitting)
        return sorted(by_node[node], key=lambda d: d.address)[:count]
    # Spread: take from the fullest nodes first to touch as few nodes as possible.
    out: list[DeviceRecord] = []
    for _, node in sorted(((len(ds), n) for n, ds in by_node.items()), reverse=True):
        out += sorted(by_node[node], key=lambda d: d.address)
    return out[:count]
