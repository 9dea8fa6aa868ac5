"""SysfsPciHost: the `PciHost` of a real Linux kernel, read from (and rarely written to) sysfs.

Every path is `<root>/bus/pci/devices/<PciAddress>/<attribute>` with a validated `PciAddress` and an
attribute name from a fixed set, or `<root>/bus/pci/drivers/<driver>/{unbind}` with a validated
driver name, or `<root>/bus/pci/drivers_probe`. Nothing else is ever opened for writing, and nothing
is ever created (no O_CREAT): a write to an attribute that does not exist fails as on a real kernel.

Writes are exactly four kinds — `driver_override`, `unbind`, `drivers_probe` to move a device
between drivers, `reset` for a reset, and `reset_method` around a reset of one rung of the reset ladder (the
methods that rung may use, then the function's own list back; names from the kernel's fixed set only).
`new_id`, `bind`, `remove`, `rescan` and `sriov_numvfs` are never written. With `read_only=True` any write raises
`host.read_only` before touching the file system (used by discovery scripts on production hosts).

`on_write` exists for fake trees only: a stand-in for the kernel's reaction to a write (move the
`driver` link on drivers_probe, fail a reset). It runs after the bytes landed in the file, and an
OSError it raises is treated exactly like the kernel refusing the write.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Final

from cubeaccel.host.pci import procfs
from cubeaccel.host.pci.base import Holder, HostError, PciFunction, host_error
from cubeaccel.host.pci.sysfs_parse import (
    driver_from_link,
    is_driver_name,
    parse_aer_total,
    parse_config_serial,
    parse_config_vendor,
    parse_driver_override,
    parse_hex,
    parse_int,
    parse_reset_method,
    valid_driver_name,
)
from cubeaccel.model.bars import parse_resource
from cubeaccel.model.device import PciAddress
from cubeaccel.model.reset_ladder import KNOWN_METHODS
from cubeaccel.protocol.errors import invalid

# The only per-device attributes we read; the subset in _WRITABLE is the only one we write.
DEVICE_ATTRS: Final = frozenset(
    {
        "vendor", "device", "subsystem_vendor", "subsystem_device", "class", "revision", "numa_node",
        "driver_override", "resource", "current_link_speed", "current_link_width", "sriov_totalvfs",
        "sriov_numvfs", "reset_method", "aer_dev_fatal", "aer_dev_nonfatal", "enable", "power_state",
        "config", "reset", "driver", "iommu_group", "vfio-dev", "physfn", "boot_vga",
    }
)  # fmt: skip
_WRITABLE: Final = frozenset({"driver_override", "reset", "reset_method"})
VFIO_PCI: Final = "vfio-pci"
VFIO_DEVICE_FD: Final = "anon_inode:[vfio-device]"  # /proc/PID/fd target of a VFIO device fd
CONFIG_READ_BYTES: Final = 4096

WriteHook = Callable[[Path, str], None]


class SysfsPciHost:
    """Implements `PciHost` (and `restore_driver`) over a sysfs tree rooted at `root`."""

    def __init__(
        self,
        root: str | os.PathLike[str] = "/sys",
        *,
        proc_root: str | os.PathLike[str] = "/proc",
        dev_root: str | os.PathLike[str] = "/dev",
        read_only: bool = False,
        on_write: WriteHook | None = None,
        exempt_pids: frozenset[int] = frozenset(),
    ) -> None:
        self.root = Path(root)
        # Processes an operator declared harmless although their fds cannot be read (e.g. a sandbox
        # runtime's more privileged PID 1): without this, each is an unknown holder of every device.
        self.exempt_pids = exempt_pids
        self.proc_root = Path(proc_root)
        self.dev_root = Path(dev_root)
        self.read_only = read_only
        self.on_write = on_write
        self._devices = self.root / "bus" / "pci" / "devices"  # every read starts here: joined once

    # ---- paths: the only places a path is built ------------------------------------------------
    def device_path(self, address: PciAddress, attr: str | None = None) -> Path:
        if not isinstance(address, PciAddress):
            raise invalid("device.invalid_address", f"not a PciAddress: {address!r}", layer="host_hardware")
        base = self._devices / str(address)
        if attr is None:
            return base
        if attr not in DEVICE_ATTRS:
            raise invalid("host.invalid_attribute", f"not a known sysfs attribute: {attr!r}", layer="host_hardware")
        return base / attr

    def driver_path(self, driver: str, attr: str | None = None) -> Path:
        base = self.root / "bus" / "pci" / "drivers" / valid_driver_name(driver)
        if attr is None:
            return base
        if attr != "unbind":
            raise invalid("host.invalid_attribute", f"not a driver attribute we use: {attr!r}", layer="host_hardware")
        return base / attr

    # ---- reads ----------------------------------------------------------------------------------
    def _read(self, address: PciAddress, attr: str) -> str | None:
        try:
            return self.device_path(address, attr).read_text(errors="replace")
        except OSError:  # absent on this kernel/device, or vanished meanwhile
            return None

    def _link_name(self, address: PciAddress, attr: str) -> str | None:
        try:
            return os.path.basename(os.readlink(self.device_path(address, attr)))
        except OSError:
            return None

    def _config(self, address: PciAddress) -> bytes:
        try:
            with open(self.device_path(address, "config"), "rb") as fh:
                return fh.read(CONFIG_READ_BYTES)
        except OSError:
            return b""

    def functions(self) -> list[PciFunction]:
        try:
            names = sorted(os.listdir(self._devices))
        except OSError:
            return []
        out = []
        for name in names:
            try:
                address = PciAddress.parse(name)
            except Exception:  # not a BDF: never turn it into a path
                continue
            f = self.function(address)
            if f is not None:
                out.append(f)
        return out

    def function(self, address: PciAddress) -> PciFunction | None:
        vendor = parse_hex(self._read(address, "vendor"))
        device = parse_hex(self._read(address, "device"))
        if vendor is None or device is None:
            return None
        driver = self._link_name(address, "driver")
        group = self._link_name(address, "iommu_group")
        numa = parse_int(self._read(address, "numa_node"))
        config = self._config(address)
        extra: dict[str, str] = {}
        enable = parse_int(self._read(address, "enable"))
        if enable is not None:
            extra["enable_count"] = str(enable)
        power_state = (self._read(address, "power_state") or "").strip()
        if power_state:
            extra["power_state"] = power_state
        vfio_dev = self._vfio_cdev(address)
        if vfio_dev is not None:
            extra["vfio_cdev"] = vfio_dev
        physfn = self._link_name(address, "physfn")
        if physfn is not None:
            extra["physfn"] = physfn
        boot_vga = (self._read(address, "boot_vga") or "").strip()
        if boot_vga:
            extra["boot_vga"] = boot_vga
        return PciFunction(
            address=address,
            vendor_id=vendor,
            device_id=device,
            subsystem_vendor_id=parse_hex(self._read(address, "subsystem_vendor")) or 0,
            subsystem_device_id=parse_hex(self._read(address, "subsystem_device")) or 0,
            class_code=parse_hex(self._read(address, "class")) or 0,
            revision=parse_hex(self._read(address, "revision")) or 0,
            numa_node=-1 if numa is None else numa,
            iommu_group=int(group) if group is not None and group.isdigit() else None,
            driver=driver_from_link(driver),
            driver_override=parse_driver_override(self._read(address, "driver_override")),
            bars=parse_resource(self._read(address, "resource")),
            link_speed=(self._read(address, "current_link_speed") or "").strip() or None,
            link_width=(self._read(address, "current_link_width") or "").strip() or None,
            sriov_totalvfs=parse_int(self._read(address, "sriov_totalvfs")),
            sriov_numvfs=parse_int(self._read(address, "sriov_numvfs")),
            reset_method=parse_reset_method(self._read(address, "reset_method")),
            aer_fatal=parse_aer_total(self._read(address, "aer_dev_fatal"), "TOTAL_ERR_FATAL"),
            aer_nonfatal=parse_aer_total(self._read(address, "aer_dev_nonfatal"), "TOTAL_ERR_NONFATAL"),
            # `enable` counts pci_enable_device() users; vfio-pci only enables on open, so an idle
            # vfio device reads 0. What says "the kernel gave up on it" is power_state `error`.
            enabled=power_state != "error",
            serial=parse_config_serial(config),
            extra=extra,
        )

    def _vfio_cdev(self, address: PciAddress) -> str | None:
        """`vfioN` when vfio-pci exposes the iommufd cdev (`/dev/vfio/devices/vfioN`, Linux 6.2+)."""
        try:
            names = os.listdir(self.device_path(address, "vfio-dev"))
        except OSError:
            return None
        for n in names:
            if n.startswith("vfio") and n[4:].isdigit():
                return n
        return None

    def iommu_group_members(self, group: int) -> list[PciAddress]:
        if not isinstance(group, int) or group < 0:
            raise invalid("host.invalid_iommu_group", f"not an IOMMU group number: {group!r}", layer="host_hardware")
        try:
            names = os.listdir(self.root / "kernel" / "iommu_groups" / str(group) / "devices")
        except OSError:
            return []
        out = []
        for name in sorted(names):
            try:
                out.append(PciAddress.parse(name))
            except Exception:
                continue
        return out

    def config_vendor_id(self, address: PciAddress) -> int:
        return parse_config_vendor(self._config(address)[:2])

    def driver_available(self, driver: str) -> bool:
        return self.driver_path(driver).is_dir()

    def iommu_groups_present(self) -> bool:
        try:
            return any(n.isdigit() for n in os.listdir(self.root / "kernel" / "iommu_groups"))
        except OSError:
            return False

    # ---- holders --------------------------------------------------------------------------------
    def device_files(self, address: PciAddress) -> list[str]:
        """Device files that give access to this function: its VFIO group, its iommufd cdev, its nvidia node."""
        if self._read(address, "vendor") is None:  # no such function (what `function` answers None for)
            return []
        files = []
        group = self._link_name(address, "iommu_group")  # the two facts needed, not the whole function
        if group is not None and group.isdigit():
            files.append(str(self.dev_root / "vfio" / group))
        vfio_cdev = self._vfio_cdev(address)
        if vfio_cdev is not None:
            # sysfs names vfio-dev/vfioN from Linux 6.1, the /dev node exists only from 6.6 (CONFIG_VFIO_DEVICE_CDEV)
            cdev = self.dev_root / "vfio" / "devices" / vfio_cdev
            if cdev.exists():
                files.append(str(cdev))
        minor = self._nvidia_minor(address)
        if minor is not None:
            files.append(str(self.dev_root / f"nvidia{minor}"))
        return files

    def _nvidia_minor(self, address: PciAddress) -> int | None:
        info = self.proc_root / "driver" / "nvidia" / "gpus" / str(address) / "information"
        try:
            text = info.read_text(errors="replace")
        except OSError:
            return None
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Device Minor":
                return parse_int(value)
        return None

    def holders(self, address: PciAddress) -> list[Holder]:
        """fd holders of the device files; for a vfio-pci device also the kernel's own count of open device fds.

        A VMM may close its group fd and keep only the device fd (`anon_inode:[vfio-device]`, which on 6.1 does not
        say which device), and a holder outside our PID namespace has no /proc entry here at all. vfio-pci enables
        the device on the first open and disables it on the last close, so `enable` > 0 with no fd holder found
        means a holder we cannot name: every process with a VFIO device fd, or else an unknown one (fail closed).
        """
        files = self.device_files(address)
        found = self._not_exempt(procfs.find_holders(procfs.exact(files), self.proc_root) if files else [])
        return found or self._not_exempt(self._enabled_holders(address))

    def _not_exempt(self, holders: list[Holder]) -> list[Holder]:
        return [h for h in holders if not (h.unknown and h.pid in self.exempt_pids)]

    def _enabled_holders(self, address: PciAddress) -> list[Holder]:
        if self._link_name(address, "driver") != VFIO_PCI:
            return []  # other drivers enable their devices while bound: the count says nothing about users
        count = parse_int(self._read(address, "enable"))
        if not count:
            return []
        # unreadable processes were judged by the first scan already (unknown holders, or exempt)
        candidates = [h for h in procfs.find_holders(procfs.exact([VFIO_DEVICE_FD]), self.proc_root) if not h.unknown]
        if candidates:
            return candidates
        path = f"{self.device_path(address, 'enable')}={count} (no process visible here)"
        return [Holder(pid=0, command="?", path=path, unknown=True)]

    # ---- writes ---------------------------------------------------------------------------------
    def _write(self, path: Path, data: str) -> None:
        if self.read_only:
            raise host_error("host.read_only", f"refusing to write {path.name}: this host is opened read-only")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.write(fd, data.encode())
            finally:
                os.close(fd)
            if self.on_write is not None:
                self.on_write(path, data)
        except OSError as e:
            raise host_error(
                "host.write_failed", f"writing {data.strip()!r} to {path} failed: {e.strerror or e}", path=str(path)
            ) from e

    def _require(self, address: PciAddress) -> PciFunction:
        f = self.function(address)
        if f is None:
            raise host_error("host.device_missing", f"no PCI function at {address}", address=str(address))
        return f

    def _move(self, address: PciAddress, override: str, probe: bool, f: PciFunction | None = None) -> str | None:
        """driver_override, then unbind from the current driver, then (optionally) drivers_probe. `f`: the function
        as the caller just read it (not read again)."""
        f = f or self._require(address)
        if f.driver is not None and not is_driver_name(f.driver):  # checked before the first write
            raise host_error("host.bind_failed", f"{address} is bound to a driver we cannot name: {f.driver!r}")
        self._write(self.device_path(address, "driver_override"), override)
        if f.driver is not None:
            self._write(self.driver_path(f.driver, "unbind"), str(address))
        if probe:
            self._write(self.root / "bus" / "pci" / "drivers_probe", str(address))
        return self._link_name(address, "driver")

    def bind(self, address: PciAddress, driver: str) -> None:
        """Bind to `driver` via driver_override + unbind + drivers_probe (never new_id).

        The override stays set afterwards, so a later rescan or hot-replug cannot hand the device back
        to its host driver behind our back.
        """
        valid_driver_name(driver)
        current = self._require(address)
        if current.driver == driver:  # already there: only pin it, never bounce a bound device
            if current.driver_override != driver:
                self._write(self.device_path(address, "driver_override"), driver + "\n")
            return
        now = self._move(address, driver + "\n", probe=True, f=current)
        if now != driver:
            raise host_error(
                "host.bind_failed", f"{address} is bound to {now}, not {driver}, after drivers_probe", bound=now
            )

    def restore_driver(self, address: PciAddress, driver: str | None) -> None:
        """Undo `bind`: clear driver_override, unbind, and let `driver` (None: no driver) take it."""
        if driver is not None:
            valid_driver_name(driver)
        now = self._move(address, "\n", probe=driver is not None)
        if now is None and driver is not None:
            # A driver without an id table (uio_pci_generic, pci-stub) binds only by override, as it was bound
            # before: name it in driver_override (left set, as an operator's binding had it) and probe again.
            self._write(self.device_path(address, "driver_override"), driver + "\n")
            self._write(self.root / "bus" / "pci" / "drivers_probe", str(address))
            now = self._link_name(address, "driver")
        if now != driver:
            raise host_error("host.restore_failed", f"{address} is bound to {now}, expected {driver}", bound=now)

    def bus_reach(self, address: PciAddress) -> list[PciAddress] | None:
        """Every function a secondary bus reset of `address`'s bus would reset (itself included): the functions
        under the bridge above it, at any depth. None when no bridge is above it (a root bus: nothing to reset)."""
        try:
            real = self.device_path(address).resolve(strict=True)
        except OSError:
            return None
        bridge = real.parent
        try:
            PciAddress.parse(bridge.name)
        except Exception:
            return None  # pci0000:00 — a root bus
        reached = []
        for link in sorted(self._devices.iterdir()):
            try:
                other = PciAddress.parse(link.name)
                target = link.resolve(strict=True)
            except Exception:
                continue
            if bridge in target.parents:
                reached.append(other)
        return reached

    def reset(self, address: PciAddress, methods: tuple[str, ...] = ()) -> None:
        """One write of `1` to `reset`. With `methods` (a rung of the reset ladder), the function's `reset_method`
        is narrowed to them for this reset and its own list written back afterwards; without, the kernel picks."""
        self._require(address)
        unknown = [m for m in methods if m not in KNOWN_METHODS]
        if unknown:
            raise invalid("host.invalid_reset_method", f"not a kernel reset method: {unknown!r}", layer="host_hardware")
        if not self.read_only and not self.device_path(address, "reset").exists():
            # The kernel hides `reset` when the function has no reset method (no FLR, PM or bus reset possible).
            raise host_error(
                "host.no_reset_method",
                f"{address} has no reset method (no `reset` attribute): it cannot be reset between tenants",
                address=str(address),
            )
        saved = (self._read(address, "reset_method") or "").strip()
        narrowed = bool(methods) and saved.split() != list(methods)
        try:
            if narrowed:
                self._write(self.device_path(address, "reset_method"), " ".join(methods))
            self._write(self.device_path(address, "reset"), "1")
        except HostError as e:
            if e.code == "host.read_only":
                raise
            message = f"reset of {address} failed: {e.message}"
            raise host_error("host.reset_failed", message, address=str(address), methods=list(methods)) from e
        finally:
            if narrowed and saved and not self.read_only:
                # the reset's own outcome is what the caller needs; a failed write-back shows in the next read
                with contextlib.suppress(HostError):
                    self._write(self.device_path(address, "reset_method"), saved)
