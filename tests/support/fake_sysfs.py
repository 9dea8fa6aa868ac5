"""A fake sysfs (plus /dev and /proc) tree on disk, built from a short declarative description.

The layout copies what the kernel makes, symlinks included:

    sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/        real device directory (nested under its bridge)
    sys/bus/pci/devices/0000:01:00.0 -> ../../../devices/pci0000:00/0000:00:01.0/0000:01:00.0
    <device>/driver                  -> ../../../../bus/pci/drivers/nvidia         (relative, like the kernel)
    <device>/iommu_group             -> ../../../../kernel/iommu_groups/12
    sys/kernel/iommu_groups/12/devices/0000:01:00.0 -> ../../../../devices/...
    sys/bus/pci/drivers/<name>/{bind,unbind,new_id,remove_id} and <name>/<bdf> -> the device

`SysfsPciHost` reads it through its real code. Its writes land in the plain files; `FakeSysfs.kernel`
(passed as the host's `on_write`) records every write in order and then plays the kernel's part:
drivers_probe moves the `driver` link, unbind removes it, a reset may fail or change the device.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from pathlib import Path

from cubeaccel.host.pci.sysfs import SysfsPciHost
from cubeaccel.model.device import PciAddress

DRIVER_FILES = ("bind", "unbind", "new_id", "remove_id", "uevent")


@dataclass
class Dev:
    """One PCI function. `driver` is what is bound now; `native` is what drivers_probe binds by default."""

    address: str
    vendor: int = 0x10DE
    device: int = 0x2331  # H100 PCIe, what the shipped GPU templates name
    class_code: int = 0x030200
    subsystem_vendor: int = 0x10DE
    subsystem_device: int = 0x1839
    revision: int = 0xA1
    numa_node: int = 0
    iommu_group: int | None = None
    driver: str | None = "nvidia"
    native: str | None = "nvidia"
    parent: str | None = None
    bars: tuple[int, ...] = (16 << 20, 0, 128 << 30, 0, 32 << 20, 0)
    reset_method: tuple[str, ...] = ("flr", "bus")
    aer_fatal: int | None = 0
    serial: int | None = None
    link_speed: str | None = "32.0 GT/s PCIe"
    link_width: str | None = "16"
    sriov_totalvfs: int | None = None
    boot_vga: bool | None = None


@dataclass
class FakeSysfs:
    base: Path
    devices: dict[str, Dev] = field(default_factory=dict)
    writes: list[tuple[str, str]] = field(default_factory=list)
    reset_fails: set[str] = field(default_factory=set)  # writing `reset` → EIO
    reset_kills: set[str] = field(default_factory=set)  # after reset, config space reads 0xffff
    after_reset: dict[str, int] = field(default_factory=dict)  # after reset, a new device id answers
    probe_ignored: set[str] = field(default_factory=set)  # drivers_probe binds nothing
    resets: dict[str, int] = field(default_factory=dict)
    # a function-level reset "does not take" (config space reads 0xffff after it); a bus reset brings it back
    flr_ineffective: set[str] = field(default_factory=set)
    reset_log: list[tuple[str, str]] = field(default_factory=list)  # (address, the reset_method it ran under)

    @property
    def sys(self) -> Path:
        return self.base / "sys"

    @property
    def dev(self) -> Path:
        return self.base / "dev"

    @property
    def proc(self) -> Path:
        return self.base / "proc"

    # ---- building ------------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        base: Path,
        devices: list[Dev],
        drivers: tuple[str, ...] = ("nvidia", "vfio-pci", "snd_hda_intel", "pcieport"),
        iommu: bool = True,
        modules: tuple[str, ...] = ("vfio_pci", "vfio_iommu_type1", "kvm_intel"),
        dev_files: tuple[str, ...] = ("vfio/vfio", "iommu", "kvm"),
        ecap: int | None = 0xF020DF,  # intel-iommu ecap with bit 3 (interrupt remapping) set
        cmdline: str = "BOOT_IMAGE=/vmlinuz intel_iommu=on iommu=pt",
    ) -> FakeSysfs:
        fake = cls(base=base)
        bus = fake.sys / "bus" / "pci"
        (bus / "devices").mkdir(parents=True)
        (bus / "drivers").mkdir()
        for name in ("drivers_probe", "rescan", "drivers_autoprobe"):
            (bus / name).write_text("")
        for d in drivers:
            fake.add_driver(d)
        if iommu:
            (fake.sys / "kernel" / "iommu_groups").mkdir(parents=True)
            unit = fake.sys / "class" / "iommu" / "dmar0" / "intel-iommu"
            unit.mkdir(parents=True)
            if ecap is not None:
                (unit / "ecap").write_text(f"{ecap:x}\n")
        else:
            (fake.sys / "kernel" / "iommu_groups").mkdir(parents=True)  # the kernel makes it, empty
        for m in modules:
            (fake.sys / "module" / m / "parameters").mkdir(parents=True)
        for name in dev_files:
            p = fake.dev / name
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text("")
        fake.proc.mkdir(parents=True)
        (fake.proc / "cmdline").write_text(cmdline + "\n")
        (fake.proc / "cpuinfo").write_text("processor\t: 0\nflags\t\t: fpu vmx\n")
        (fake.proc / "modules").write_text("".join(f"{m} 16384 0 - Live 0x0\n" for m in modules))
        for dev in devices:
            fake.add_device(dev)
        return fake

    def add_driver(self, name: str) -> None:
        ddir = self.sys / "bus" / "pci" / "drivers" / name
        ddir.mkdir(parents=True, exist_ok=True)
        for f in DRIVER_FILES:
            (ddir / f).write_text("")

    def devdir(self, address: str) -> Path:
        d = self.devices[address]
        if d.parent is not None:
            return self.devdir(d.parent) / address
        a = PciAddress.parse(address)
        return self.sys / "devices" / f"pci{a.domain:04x}:{a.bus:02x}" / address

    def _link(self, link: Path, target: Path) -> None:
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink():
            link.unlink()
        link.symlink_to(os.path.relpath(target, link.parent))

    def add_device(self, d: Dev) -> None:
        self.devices[d.address] = d
        path = self.devdir(d.address)
        path.mkdir(parents=True)
        self._write_identity(d)
        files = {
            "subsystem_vendor": f"0x{d.subsystem_vendor:04x}",
            "subsystem_device": f"0x{d.subsystem_device:04x}",
            "revision": f"0x{d.revision:02x}",
            "numa_node": str(d.numa_node),
            "driver_override": "(null)",
            "resource": "".join(_resource_line(i, s) for i, s in enumerate(d.bars))
            + "0x0000000000000000 0x0000000000000000 0x0000000000000000\n" * (13 - len(d.bars)),
            "enable": "0",
            "power_state": "D0",
            "remove": "",
            "rescan": "",
            "reset_method": " ".join(d.reset_method),
        }
        if d.reset_method:  # the kernel hides `reset` when the function has no reset method
            files["reset"] = ""
        if d.aer_fatal is not None:
            files["aer_dev_fatal"] = _aer("TOTAL_ERR_FATAL", d.aer_fatal)
            files["aer_dev_nonfatal"] = _aer("TOTAL_ERR_NONFATAL", 0)
        if d.link_speed is not None:
            files["current_link_speed"] = d.link_speed
        if d.link_width is not None:
            files["current_link_width"] = d.link_width
        if d.sriov_totalvfs is not None:
            files["sriov_totalvfs"] = str(d.sriov_totalvfs)
            files["sriov_numvfs"] = "0"
        if d.boot_vga is not None:
            files["boot_vga"] = "1" if d.boot_vga else "0"
        for name, text in files.items():
            (path / name).write_text(text + ("\n" if text and not text.endswith("\n") else ""))
        self._link(self.sys / "bus" / "pci" / "devices" / d.address, path)
        if d.iommu_group is not None:
            gdir = self.sys / "kernel" / "iommu_groups" / str(d.iommu_group)
            (gdir / "devices").mkdir(parents=True, exist_ok=True)
            self._link(path / "iommu_group", gdir)
            self._link(gdir / "devices" / d.address, path)
        if d.driver is not None:
            self._bind_link(d.address, d.driver)

    def _write_identity(self, d: Dev) -> None:
        path = self.devdir(d.address)
        (path / "vendor").write_text(f"0x{d.vendor:04x}\n")
        (path / "device").write_text(f"0x{d.device:04x}\n")
        (path / "class").write_text(f"0x{d.class_code:06x}\n")
        (path / "config").write_bytes(_config(d))

    def _bind_link(self, address: str, driver: str) -> None:
        ddir = self.sys / "bus" / "pci" / "drivers" / driver
        self._link(self.devdir(address) / "driver", ddir)
        self._link(ddir / address, self.devdir(address))
        self.devices[address].driver = driver

    def _unbind_link(self, address: str) -> None:
        d = self.devices[address]
        if d.driver is None:
            return
        (self.devdir(address) / "driver").unlink()
        (self.sys / "bus" / "pci" / "drivers" / d.driver / address).unlink(missing_ok=True)
        d.driver = None

    # ---- what tests do to the "hardware" -------------------------------------------------------
    def remove_device(self, address: str) -> None:
        """The function vanishes (surprise removal, fell off the bus): every link to it goes."""
        d = self.devices[address]
        self._unbind_link(address)
        (self.sys / "bus" / "pci" / "devices" / address).unlink()
        if d.iommu_group is not None:
            (self.sys / "kernel" / "iommu_groups" / str(d.iommu_group) / "devices" / address).unlink()
        _rmtree(self.devdir(address))
        del self.devices[address]

    def change_identity(self, address: str, device_id: int) -> None:
        d = self.devices[address]
        d.device = device_id
        self._write_identity(d)

    def set_aer_fatal(self, address: str, count: int) -> None:
        (self.devdir(address) / "aer_dev_fatal").write_text(_aer("TOTAL_ERR_FATAL", count))

    def host(self, read_only: bool = False) -> SysfsPciHost:
        return SysfsPciHost(self.sys, proc_root=self.proc, dev_root=self.dev, read_only=read_only, on_write=self.kernel)

    def write_log(self) -> list[str]:
        return [f"{p}={v.strip()}" for p, v in self.writes]

    # ---- the kernel's side of a write ----------------------------------------------------------
    def kernel(self, path: Path, data: str) -> None:
        rel = path.relative_to(self.sys).as_posix()
        self.writes.append((rel, data))
        parts = rel.split("/")
        value = data.strip()
        if parts[:3] == ["bus", "pci", "devices"] and len(parts) == 5:
            address, attr = parts[3], parts[4]
            if attr == "driver_override":
                path.write_text((value or "(null)") + "\n")
            elif attr == "reset":
                self._reset(address)
        elif parts[:3] == ["bus", "pci", "drivers"] and len(parts) == 5 and parts[4] == "unbind":
            d = self.devices.get(value)
            if d is None or d.driver != parts[3]:
                raise OSError(errno.ENODEV, "No such device")
            self._unbind_link(value)
        elif rel == "bus/pci/drivers_probe":
            self._probe(value)

    def _probe(self, address: str) -> None:
        d = self.devices.get(address)
        if d is None:
            raise OSError(errno.ENODEV, "No such device")
        if d.driver is not None or address in self.probe_ignored:
            return
        override = (self.devdir(address) / "driver_override").read_text().strip()
        target = d.native if override == "(null)" else override
        if target and (self.sys / "bus" / "pci" / "drivers" / target).is_dir():
            self._bind_link(address, target)

    def _reset(self, address: str) -> None:
        if address in self.reset_fails:
            raise OSError(errno.EIO, "Input/output error")
        self.resets[address] = self.resets.get(address, 0) + 1
        methods = (self.devdir(address) / "reset_method").read_text().split()
        self.reset_log.append((address, " ".join(methods)))
        if address in self.flr_ineffective:
            if methods and methods[0] in ("bus", "cxl_bus"):
                self._write_identity(self.devices[address])  # the bus reset brings it back
            else:
                (self.devdir(address) / "config").write_bytes(b"\xff" * 256)
        if address in self.reset_kills:
            (self.devdir(address) / "config").write_bytes(b"\xff" * 256)
        if address in self.after_reset:
            self.change_identity(address, self.after_reset[address])


def _resource_line(index: int, size: int) -> str:
    if size == 0:
        return "0x0000000000000000 0x0000000000000000 0x0000000000000000\n"
    start = 0x38000000000 + index * (1 << 40)
    return f"0x{start:016x} 0x{start + size - 1:016x} 0x000000000014220c\n"


def _aer(total_key: str, count: int) -> str:
    return f"Undefined 0\nDataLinkProtocol 0\n{total_key} {count}\n"


def _config(d: Dev) -> bytes:
    data = bytearray(4096 if d.serial is not None else 256)
    data[0:2] = d.vendor.to_bytes(2, "little")
    data[2:4] = d.device.to_bytes(2, "little")
    data[8] = d.revision
    data[9:12] = d.class_code.to_bytes(3, "little")
    if d.serial is not None:
        data[0x100:0x104] = (0x0003 | (1 << 16)).to_bytes(4, "little")  # DSN, version 1, last cap
        data[0x104:0x10C] = d.serial.to_bytes(8, "little")
    return bytes(data)


def _rmtree(path: Path) -> None:
    for child in path.iterdir():
        if child.is_symlink() or child.is_file():
            child.unlink()
        else:
            _rmtree(child)
    path.rmdir()
