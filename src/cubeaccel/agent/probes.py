"""Guest facts read from /proc, /sys and /dev, and the timed per-probe verdicts built from them.

Every path is taken relative to a configurable root so tests can lay out a fake guest in a temp dir;
module loading runs a configurable modprobe command so the same code runs in a guest and in tests.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import stat
import subprocess
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from pathlib import Path

from cubeaccel.agent.spec import ProbeSpec, version_matches
from cubeaccel.protocol.agent_protocol import CUDA_TIMEOUT_S, MODPROBE_TIMEOUT_S, deadline_scale
from cubeaccel.protocol.reports import GuestPciDevice, ProbeResult

_NVRM = re.compile(r"Kernel Module(?: for [^\s]+)?\s+(\d+(?:\.\d+)+)")
_MAX_ERROR_TEXT = 500


@dataclass(frozen=True)
class ProbeContext:
    """Where and how to probe. Defaults are the guest's; the CLI and tests override them."""

    root: Path = Path("/")
    lib_dirs: tuple[str, ...] = ()  # tried before the dynamic linker's own search
    modprobe: tuple[str, ...] = ("modprobe",)
    load_modules: bool = False  # run modprobe for the contract's modules before checking them
    set_persistence: bool = False  # allowed to turn on NVML persistence mode when the contract asks
    modprobe_timeout_s: float = MODPROBE_TIMEOUT_S
    cuda_timeout_s: float = CUDA_TIMEOUT_S

    def path(self, absolute: str) -> Path:
        return self.root / absolute.lstrip("/")

    def stretched(self, host_scale: float | None) -> ProbeContext:
        """The step timeouts stretched with the load: the larger of the host's figure (a TCG guest runs as fast
        as its host lets it, which the guest's own load does not show) and this guest's own 1-minute load."""
        scale = max(host_scale or 1.0, self.own_load_scale())
        if scale == 1.0:
            return self
        return replace(
            self, modprobe_timeout_s=self.modprobe_timeout_s * scale, cuda_timeout_s=self.cuda_timeout_s * scale
        )

    def own_load_scale(self) -> float:
        """deadline_scale of this guest's /proc/loadavg; 1 where it cannot be read (a test's fake root)."""
        try:
            load = float(self.path("/proc/loadavg").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return 1.0
        return deadline_scale(load, os.cpu_count() or 1)


@dataclass(frozen=True)
class Verdict:
    """What a probe function returns; `timed` adds the name, layer and duration."""

    ok: bool
    code: str = ""
    expected: str | None = None
    found: str | None = None
    detail: str = ""


def timed(name: str, layer: str, fn: Callable[[], Verdict]) -> ProbeResult:
    """Run one probe, measure it, and turn an unexpected exception into a failed probe, not a dead agent."""
    start = time.monotonic()
    try:
        v = fn()
    except Exception as exc:  # a probe bug must not hide the other probes' results
        v = Verdict(False, "agent.probe_crashed", detail=f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_TEXT])
    ms = round((time.monotonic() - start) * 1000.0, 3)
    return ProbeResult(name, v.ok, layer, "" if v.ok else v.code, v.expected, v.found, ms, v.detail)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def normalize_module(name: str) -> str:
    """modprobe accepts `nvidia-uvm`; /proc/modules lists `nvidia_uvm`."""
    return name.replace("-", "_")


# ---- facts -------------------------------------------------------------------------------------


def kernel_release(ctx: ProbeContext) -> str:
    text = _read(ctx.path("/proc/sys/kernel/osrelease"))
    if text is None and ctx.root == Path("/"):
        return os.uname().release
    return (text or "").strip()


def loaded_modules(ctx: ProbeContext) -> tuple[str, ...]:
    text = _read(ctx.path("/proc/modules")) or ""
    return tuple(line.split()[0] for line in text.splitlines() if line.strip())


def pci_devices(ctx: ProbeContext) -> tuple[GuestPciDevice, ...]:
    """Every PCI function the guest kernel knows, straight from sysfs (no lspci parsing)."""
    base = ctx.path("/sys/bus/pci/devices")
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return ()

    def hex_of(name: str, file: str) -> str:
        raw = (_read(base / name / file) or "").strip().lower()
        return raw[2:] if raw.startswith("0x") else raw

    return tuple(GuestPciDevice(n, hex_of(n, "vendor"), hex_of(n, "device"), hex_of(n, "class")) for n in names)


def device_files(ctx: ProbeContext, paths: tuple[str, ...]) -> dict[str, bool]:
    return {p: os.path.exists(ctx.path(p)) for p in paths}


def kernel_driver_version(ctx: ProbeContext, module: str = "nvidia") -> str | None:
    """The driver module's version: /sys/module/<module>/version, else NVIDIA's /proc/driver/nvidia/version."""
    text = _read(ctx.path(f"/sys/module/{normalize_module(module)}/version"))
    if text and text.strip():
        return text.strip()
    text = _read(ctx.path("/proc/driver/nvidia/version"))
    if text:
        m = _NVRM.search(text)
        if m:
            return m[1]
    return None


def module_file(ctx: ProbeContext, release: str, module: str) -> Path | None:
    """The module's .ko as modules.img's modules.dep names it, if it is there."""
    moddir = ctx.path(f"/lib/modules/{release}")
    want = normalize_module(module) + ".ko"
    for line in (_read(moddir / "modules.dep") or "").splitlines():
        rel = line.split(":", 1)[0].strip()
        if rel and normalize_module(Path(rel).name) == want:
            return moddir / rel
    return None


def module_vermagic(path: Path) -> str:
    """The `vermagic=` string of a module's .modinfo section (what the kernel checks before loading it)."""
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    i = data.find(b"\0vermagic=")
    if i < 0:
        return ""
    end = data.find(b"\0", i + 1)
    return data[i + len(b"\0vermagic=") : end].decode(errors="replace")


def check_module_build(ctx: ProbeContext, release: str, module: str) -> ProbeResult:
    """modules.img carries the module, built for the running kernel: the layer below the driver's own probe."""

    def fn() -> Verdict:
        path = module_file(ctx, release, module)
        if path is None:
            return Verdict(False, "compat.modules_img_module_missing", "in modules.dep", "absent")
        magic = module_vermagic(path)
        if not magic.startswith(release + " "):
            return Verdict(False, "compat.modules_img_module_failed", release, magic or "unreadable", str(path))
        return Verdict(True, expected=release, found=magic.split(" ", 1)[0], detail=str(path))

    return timed(f"module_build:{module}", "modules_img", fn)


class KernelLog:
    """Kernel log records written after `mark()`, read from /dev/kmsg: a driver says why it refused a device
    there (NVIDIA: "NVRM: No NVIDIA GPU found."), not in modprobe's errno text."""

    def __init__(self, ctx: ProbeContext) -> None:
        self._fd: int | None = None
        try:
            self._fd = os.open(ctx.path("/dev/kmsg"), os.O_RDONLY | os.O_NONBLOCK)
            os.lseek(self._fd, 0, os.SEEK_END)
        except OSError:
            self.close()

    def lines(self) -> list[str]:
        out: list[str] = []
        while self._fd is not None:
            try:
                record = os.read(self._fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # overwritten while we read: skip to what is still there
                    continue
                break
            if not record:
                break
            text = record.decode(errors="replace").split(";", 1)[-1].split("\n", 1)[0].strip()
            if text:
                out.append(text)
        return out

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def module_needs(ctx: ProbeContext, release: str, module: str) -> set[str]:
    """The modules `module` depends on, per modules.img's modules.dep (names normalised)."""
    moddir = ctx.path(f"/lib/modules/{release}")
    want = normalize_module(module) + ".ko"
    for line in (_read(moddir / "modules.dep") or "").splitlines():
        rel, _, deps = line.partition(":")
        if rel.strip() and normalize_module(Path(rel.strip()).name) == want:
            return {normalize_module(Path(d).name).removesuffix(".ko") for d in deps.split()}
    return set()


@dataclass
class Modprobe:
    """What loading the contract's modules gave: each failure's text, the probes, the driver's refusal (the
    kernel's words) and the modules not attempted because they need the refused driver."""

    failures: dict[str, str]
    results: list[ProbeResult]
    refusal: str | None = None
    not_attempted: set[str] = field(default_factory=set)


def run_modprobe(ctx: ProbeContext, modules: tuple[str, ...], driver: str | None = None, release: str = "") -> Modprobe:
    """modprobe each module on its own so every failure is reported, not just the first.

    With `driver` and `release` known, each module's build is
    checked first (in modules.img, vermagic = the running kernel: layer modules_img). When the driver passed that
    and still does not load, the driver itself refused (no device it supports, firmware, ...): layer kernel_driver,
    with the kernel's own words. Modules that need the refused driver are then not attempted (same layer): their
    load could only fail for the same reason."""
    failures: dict[str, str] = {}
    results: list[ProbeResult] = []
    refusal: str | None = None
    not_attempted: set[str] = set()
    driver_key = normalize_module(driver) if driver else None
    for module in modules:
        is_driver = normalize_module(module) == driver_key
        build = check_module_build(ctx, release, module) if driver_key and release else None
        if build is not None:
            results.append(build)
        if refusal is not None and driver_key in module_needs(ctx, release, module):
            blocked = Verdict(
                False, "compat.kernel_driver_load_failed", "loaded", "not attempted", f"needs {driver}, which refused"
            )

            def blocked_verdict(v: Verdict = blocked) -> Verdict:
                return v

            results.append(timed(f"modprobe:{module}", "kernel_driver", blocked_verdict))
            not_attempted.add(module)
            continue
        log = KernelLog(ctx) if is_driver else None

        def one(module: str = module, build: ProbeResult | None = build, log: KernelLog | None = log) -> Verdict:
            nonlocal refusal
            error = _modprobe_one(ctx, module)
            kernel_says = log.lines() if log is not None else []
            if error is None:
                return Verdict(True, expected="loaded", found="loaded")
            failures[module] = error
            if log is not None and build is not None and build.ok:
                said = " | ".join(kernel_says[-6:])
                refusal = (f"{error} | kernel: {said}" if said else error)[-_MAX_ERROR_TEXT:]
                return Verdict(False, "compat.kernel_driver_load_failed", "loaded", "refused", refusal)
            return Verdict(False, "compat.modules_img_module_failed", "loaded", "failed", error)

        layer = "kernel_driver" if is_driver and build is not None and build.ok else "modules_img"
        results.append(timed(f"modprobe:{module}", layer, one))
        if log is not None:
            log.close()
    return Modprobe(failures, results, refusal, not_attempted)


def _modprobe_one(ctx: ProbeContext, module: str) -> str | None:
    """None on success, else modprobe's own error text. A hung modprobe is killed with its whole group."""
    try:
        proc = subprocess.Popen(
            [*ctx.modprobe, module],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except FileNotFoundError:
        return f"modprobe command not found: {ctx.modprobe[0]}"
    except OSError as exc:
        return f"modprobe could not run: {exc}"
    try:
        out, err = proc.communicate(timeout=ctx.modprobe_timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return f"modprobe timed out after {ctx.modprobe_timeout_s:g}s"
    if proc.returncode == 0:
        return None
    text = (err or out).decode(errors="replace").strip()
    return (text or f"modprobe exited with status {proc.returncode}")[-_MAX_ERROR_TEXT:]


# ---- verdicts ----------------------------------------------------------------------------------
# Codes match the contract's own check_guest (model/guest_checks.py) so both judges speak alike.


def check_kernel(spec: ProbeSpec, release: str) -> ProbeResult:
    def fn() -> Verdict:
        expected = spec.guest_kernel or ""
        ok = release == expected if spec.kernel_exact else version_matches(expected, release)
        if ok:
            return Verdict(True, expected=expected, found=release)
        return Verdict(False, "compat.guest_kernel_mismatch", expected, release or None)

    return timed("guest_kernel", "guest_kernel", fn)


def check_modules(
    ctx: ProbeContext,
    spec: ProbeSpec,
    loaded: tuple[str, ...],
    failures: dict[str, str],
    not_attempted: Collection[str] = (),
) -> list[ProbeResult]:
    """One probe per module. A module that failed to load, or was not attempted because it needs a driver that
    refused, was already reported by its modprobe probe."""
    present = {normalize_module(m) for m in loaded}
    driver = normalize_module(spec.driver_module) if spec.driver_module else None
    results = []
    for module in spec.modules:
        name = normalize_module(module)
        if module in failures or module in not_attempted:
            continue
        layer, code = (
            ("kernel_driver", "compat.kernel_driver_not_loaded")
            if name == driver
            else (
                "modules_img",
                "compat.modules_img_module_missing",
            )
        )

        def fn(module: str = module, name: str = name, code: str = code) -> Verdict:
            if name in present:
                return Verdict(True, expected="loaded", found="loaded")
            if ctx.path(f"/sys/module/{name}").is_dir():
                return Verdict(True, expected="loaded", found="built-in")
            return Verdict(False, code, "loaded", "absent", f"{module} not in /proc/modules")

        results.append(timed(f"module:{module}", layer, fn))
    return results


def check_pci(spec: ProbeSpec, devices: tuple[GuestPciDevice, ...]) -> ProbeResult:
    """Any one of the contract's vendor:device pairs must be in the guest's PCI tree; `found` names where."""

    def fn() -> Verdict:
        wanted = {(w.vendor_id, w.device_id) for w in spec.pci}
        matches = [f"{d.vendor_id}:{d.device_id}@{d.address}" for d in devices if (d.vendor_id, d.device_id) in wanted]
        expected = " or ".join(w.label for w in spec.pci)
        if matches:
            return Verdict(True, expected=expected, found=",".join(matches))
        seen = ",".join(sorted({f"{d.vendor_id}:{d.device_id}" for d in devices})) or None
        return Verdict(False, "compat.device_not_visible_in_guest", expected, seen, "hot-plug did not reach the guest")

    return timed("pci", "host_hardware", fn)


def check_device_files(ctx: ProbeContext, spec: ProbeSpec) -> list[ProbeResult]:
    results = []
    for path in spec.device_files:

        def fn(path: str = path) -> Verdict:
            try:
                mode = os.stat(ctx.path(path)).st_mode
            except OSError as exc:
                return Verdict(
                    False, "compat.kernel_driver_device_file_missing", "present", "absent", exc.strerror or ""
                )
            kind = "char device" if stat.S_ISCHR(mode) else "block device" if stat.S_ISBLK(mode) else "file"
            return Verdict(True, expected="present", found="present", detail=kind)

        results.append(timed(f"device_file:{path}", "kernel_driver", fn))
    return results


def check_kernel_driver(spec: ProbeSpec, version: str | None) -> ProbeResult:
    def fn() -> Verdict:
        expected = spec.kernel_driver or ""
        if version is None:
            detail = f"no /sys/module/{spec.driver_module}/version or /proc/driver/nvidia/version"
            return Verdict(False, "compat.kernel_driver_not_loaded", expected, None, detail)
        ok = version == expected if spec.kernel_exact else version_matches(expected, version)
        if ok:
            return Verdict(True, expected=expected, found=version)
        return Verdict(False, "compat.kernel_driver_version_mismatch", expected, version)

    return timed("kernel_driver", "kernel_driver", fn)
