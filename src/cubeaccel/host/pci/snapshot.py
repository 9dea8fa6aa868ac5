"""One reconcile pass reads the host once: a read-through cache over a `PciHost` for the pass's own thread.

Reconcile validates every device; each validation asks for the device's function, its IOMMU group's members
(a walk of every function), its config space and its holders. Within one pass the answers are the pass's
snapshot: each function is read once, the group walk uses the one function list, and a write (bind, reset,
restore) drops the cache so nothing the pass changed is answered from before the change.
"""

from __future__ import annotations

from cubeaccel.host.pci.base import Holder, PciFunction, PciHost, SupportsRestore
from cubeaccel.model.device import PciAddress

_MISSING = object()


class SnapshotHost:
    """Implements `PciHost` over `inner`, caching reads; a write reads again what it may have changed."""

    def __init__(self, inner: PciHost) -> None:
        self.inner = inner
        self._drop()

    def _drop(self) -> None:
        self._functions: dict[PciAddress, PciFunction] | None = None  # the listing, in its order
        self._by_address: dict[PciAddress, PciFunction | None] = {}
        self._groups: dict[int, list[PciAddress]] | None = None
        self._vendor: dict[PciAddress, int] = {}
        self._holders: dict[PciAddress, list[Holder]] = {}

    def functions(self) -> list[PciFunction]:
        if self._functions is None:
            self._functions = {f.address: f for f in self.inner.functions()}
            self._by_address.update(self._functions)
        return list(self._functions.values())

    def function(self, address: PciAddress) -> PciFunction | None:
        if address not in self._by_address:
            if self._functions is None:
                self.functions()
            if address not in self._by_address:  # not listed (a companion the list omits): asked directly
                self._by_address[address] = self.inner.function(address)
        return self._by_address[address]

    def iommu_group_members(self, group: int) -> list[PciAddress]:
        if self._groups is None:
            groups: dict[int, list[PciAddress]] = {}
            for f in self.functions():
                if f.iommu_group is not None:
                    groups.setdefault(f.iommu_group, []).append(f.address)
            self._groups = groups
        if group not in self._groups:  # a group the list does not show: the inner host's own answer
            self._groups[group] = self.inner.iommu_group_members(group)
        return list(self._groups[group])

    def config_vendor_id(self, address: PciAddress) -> int:
        if address not in self._vendor:
            self._vendor[address] = self.inner.config_vendor_id(address)
        return self._vendor[address]

    def holders(self, address: PciAddress) -> list[Holder]:
        if address not in self._holders:
            self._holders[address] = self.inner.holders(address)
        return list(self._holders[address])

    def driver_available(self, driver: str) -> bool:
        return self.inner.driver_available(driver)

    def _reread(self, address: PciAddress) -> None:
        """After a driver change of `address`: its own answers read again, the rest of the snapshot kept."""
        self._holders.pop(address, None)
        self._vendor.pop(address, None)
        fresh = self.inner.function(address)
        self._by_address[address] = fresh
        if self._functions is not None and address in self._functions:  # a function the listing omits stays out
            if fresh is None:
                del self._functions[address]
            else:
                self._functions[address] = fresh

    def bind(self, address: PciAddress, driver: str) -> None:
        try:
            self.inner.bind(address, driver)
        finally:
            self._reread(address)

    def reset(self, address: PciAddress, methods: tuple[str, ...] = ()) -> None:
        self._drop()
        try:
            self.inner.reset(address, methods)
        finally:
            self._drop()

    def restore_driver(self, address: PciAddress, driver: str | None) -> None:
        assert isinstance(self.inner, SupportsRestore)
        try:
            self.inner.restore_driver(address, driver)
        finally:
            self._reread(address)
