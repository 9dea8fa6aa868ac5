"""Backend protocol: backends describe and act on devices; Cubelet decides (STYLE §5)."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from cubeaccel.host.pci.base import Holder
from cubeaccel.model.device import DeviceRecord, DiscoveredDevice, PciAddress
from cubeaccel.model.reset_ladder import ResetAttempt


@dataclass(frozen=True)
class Problem:
    """Why a device is not (or no longer) safe to hand out. `code` becomes the device's reason."""

    code: str
    message: str
    hard: bool = True  # hard → unhealthy; soft → quarantine (safety unproven)
    # Held: the device is sound but this release will not serve it on this host (an NVSwitch fabric it does not
    # manage). It stays `initialized` with this reason, never bound or advertised, re-checked on every reconcile.
    held: bool = False


@dataclass(frozen=True)
class AttachSpec:
    """What the VMM needs to attach the device (QMP device_add arguments)."""

    driver: str
    properties: dict[str, str]
    memory_file: tuple[str, int] | None = None  # (host path, bytes): device memory kept across VMMs (a stand-in's)


class Backend(Protocol):
    name: str

    def readiness(self) -> list[Problem]:
        """Host-wide prerequisites for this backend (VFIO: IOMMU, vfio-pci, no PVM; emulated: QEMU installed).

        Empty when the host can serve the backend at all. Cubelet runs it before it validates or advertises any
        device, and again on every reconcile; codes are `host.*`."""
        ...

    def discover(self) -> list[DiscoveredDevice]:
        """Accelerators this backend would manage on this host, with labels."""
        ...

    def validate(self, device: DeviceRecord) -> list[Problem]:
        """Host prerequisites for handing the device out: present, same identity, driver, group, holders."""
        ...

    def health(self, device: DeviceRecord) -> list[Problem]:
        """Cheap periodic check; empty when healthy."""
        ...

    def holders(self, device: DeviceRecord) -> list[Holder]: ...

    def cleanup(self, device: DeviceRecord) -> list[Problem]:
        """Between tenants: reset and verify. Empty on success."""
        ...

    def attach_spec(self, device: DeviceRecord) -> AttachSpec: ...


@dataclass(frozen=True)
class HostPreparation:
    """What `HostBinding.prepare` did. Cubelet persists `original_driver` to restore the device later."""

    address: PciAddress
    original_driver: str | None
    changed: bool
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@runtime_checkable
class HostBinding(Protocol):
    """A backend that binds devices to a host driver before validating them (VFIO: vfio-pci) and can give them
    back. Backends with nothing to bind (emulated) lack it; their devices expect no driver."""

    expected_driver: str

    def prepare(self, device: DiscoveredDevice) -> HostPreparation:
        """Bind the device unless it already is; refuse while anyone holds it open."""
        ...

    def restore_host(self, device: DeviceRecord, original_driver: str | None) -> list[Problem]:
        """Hand the device back to its original host driver (None: leave it unbound)."""
        ...


@runtime_checkable
class AerBaselines(Protocol):
    """A backend that judges devices by fatal AER counts above a baseline. The baselines are facts a restart
    needs: the backend keeps them in memory, Cubelet persists and seeds them (`cubelet/backend_facts.py`)."""

    def aer_baselines(self) -> dict[PciAddress, int]: ...

    def set_aer_baseline(self, address: PciAddress, count: int) -> None: ...

    def accept_aer(self, address: PciAddress) -> int | None:
        """An operator's `recover` acknowledges the errors seen so far; returns the new baseline (None: unknown)."""
        ...


@runtime_checkable
class HostSnapshots(Protocol):
    """A backend whose host reads can be answered from one snapshot for a reconcile pass (VFIO: each function,
    group and config space read once per pass, not once per device)."""

    def snapshot(self) -> AbstractContextManager[None]: ...


@runtime_checkable
class DeviceNodes(Protocol):
    """A backend whose devices have host nodes handed to a sandbox's VMM uid for its lifetime (VFIO: the group
    node /dev/vfio/N, chowned by the shim). The release rules take them back before a device leaves `releasing`."""

    def reclaim_nodes(self, device: DeviceRecord) -> list[Problem]:
        """Give the device's nodes back to root, owner-only; a problem for each node that could not be."""
        ...


@dataclass(frozen=True)
class ResetContext:
    """What the release path knows that the host does not, for the reset ladder (model/reset_ladder.py)."""

    unclean_exit: bool = False  # the tenant's VMM did not end cleanly (killed, or no final release report)
    reserved: Mapping[PciAddress, str] = field(default_factory=dict)  # other devices a tenant holds, and why


@dataclass(frozen=True)
class ResetResult:
    problems: list[Problem]
    attempts: list[ResetAttempt]  # one per rung tried or refused: evidence for the release's event


@runtime_checkable
class ResetLadder(Protocol):
    """A backend that resets a device rung by rung (function, then bus within the IOMMU group, then quarantine)
    and checks identity and health after each rung. Backends without it are reset with `cleanup`."""

    def reset_ladder(self, device: DeviceRecord, context: ResetContext) -> ResetResult: ...


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do beyond `Backend`, decided once, when Cubelet is given the backend: call sites ask
    `cubelet.capabilities`, never the backend object what methods it happens to have."""

    binding: HostBinding | None
    aer: AerBaselines | None
    snapshots: HostSnapshots | None = None
    nodes: DeviceNodes | None = None
    ladder: ResetLadder | None = None

    @classmethod
    def of(cls, backend: Backend) -> Capabilities:
        return cls(
            binding=backend if isinstance(backend, HostBinding) else None,
            aer=backend if isinstance(backend, AerBaselines) else None,
            snapshots=backend if isinstance(backend, HostSnapshots) else None,
            nodes=backend if isinstance(backend, DeviceNodes) else None,
            ladder=backend if isinstance(backend, ResetLadder) else None,
        )
