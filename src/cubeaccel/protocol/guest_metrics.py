"""The guest's resource samples as its workload service writes them (`GET /metrics`: envd's sample; `GET
/cubeaccel/metrics`: ours, the hour of samples and the PCI functions the guest sees). The host reads them at its
edge with pydantic (`wire/e2b_api.py` GuestMetrics, which ignores fields it does not know); a test holds the two
field for field. snake_case, as envd's REST API writes them. Stdlib only: the guest imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from cubeaccel.protocol import proto_json as pj
from cubeaccel.protocol.proto_json import Json


def _float(msg: Json, name: str) -> float:
    value = msg.get(name)
    if value is None:
        return 0.0
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise pj.ProtoJsonError(f"{name} must be a number")
    return float(value)


@dataclass(frozen=True)
class MetricsSample:
    """Values as gopsutil computes them for envd (bytes unless `_mib`); `ts` in Unix seconds."""

    ts: int
    cpu_count: int
    cpu_used_pct: float
    mem_total_mib: int
    mem_used_mib: int
    mem_total: int
    mem_used: int
    mem_cache: int
    disk_used: int
    disk_total: int

    def to_json(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, msg: Json) -> MetricsSample:
        ints = {f.name: pj.get_int64(msg, f.name) for f in fields(cls) if f.name != "cpu_used_pct"}
        return cls(cpu_used_pct=_float(msg, "cpu_used_pct"), **ints)


# Not agent_messages.PciFunction (hot-plug's, `vendor_id` without 0x, no driver) nor host/pci/base.PciFunction
# (the host's sysfs record, ints): the workload service's metrics entry, as envd-style text.
@dataclass(frozen=True)
class PciFunction:
    """One PCI function the guest sees: ids and class as sysfs writes them (`0x10de`), `driver` "" when none."""

    address: str
    vendor: str
    device: str
    pci_class: str
    driver: str

    def to_json(self) -> dict[str, object]:
        return {
            "address": self.address,
            "vendor": self.vendor,
            "device": self.device,
            "class": self.pci_class,
            "driver": self.driver,
        }

    @classmethod
    def from_json(cls, msg: Json) -> PciFunction:
        get = pj.get_str
        return cls(get(msg, "address"), get(msg, "vendor"), get(msg, "device"), get(msg, "class"), get(msg, "driver"))


@dataclass(frozen=True)
class MetricsSeries:
    samples: tuple[MetricsSample, ...]
    devices: tuple[PciFunction, ...]

    def to_json(self) -> dict[str, object]:
        return {"samples": [s.to_json() for s in self.samples], "devices": [d.to_json() for d in self.devices]}

    @classmethod
    def from_json(cls, msg: Json) -> MetricsSeries:
        samples = tuple(MetricsSample.from_json(s) for s in pj.get_objs(msg, "samples"))
        return cls(samples, tuple(PciFunction.from_json(d) for d in pj.get_objs(msg, "devices")))
