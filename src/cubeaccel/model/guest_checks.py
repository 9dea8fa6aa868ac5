"""Stage 5, guest: does what cube-agent saw inside the VM match the contract?

The agent sends raw facts (`GuestReport`); the host judges them again here, independently of the agent's
own verdicts, because the guest is not trusted to grade itself. Violations come bottom-up (kernel before
modules before driver before CUDA) so the first one is usually the cause of the rest.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from cubeaccel.model.device import DeviceRecord, parse_hex_id
from cubeaccel.model.template_spec import Template
from cubeaccel.model.versions import CudaVersion
from cubeaccel.model.violations import ContractViolation, Layer
from cubeaccel.protocol.errors import CubeError
from cubeaccel.protocol.reports import CudaInfo, GuestPciDevice, GuestReport, LibraryInfo, NvmlInfo

L = Layer
V = ContractViolation


def module_key(name: str) -> str:
    """/proc/modules spells `nvidia-uvm` as `nvidia_uvm`; compare in that form."""
    return name.replace("-", "_")


def min_driver_api(t: Template) -> int | None:
    """The lowest `cuDriverGetVersion` that can run the template's CUDA, or None without CUDA."""
    if t.cuda is None:
        return None
    try:
        cuda = CudaVersion.parse(t.cuda.version)
    except CubeError:
        return None
    return cuda.major * 1000 if t.cuda.compatibility == "minor_version" else cuda.driver_api


def _sane(r: GuestReport) -> GuestReport:
    """The report crossed a trust boundary: keep only well-typed facts, so a malformed field reads as
    "not reported" (and fails its check) instead of crashing the host-side judge."""

    def dict_of(value: object) -> dict[Any, Any]:
        return value if isinstance(value, dict) else {}

    def seq(value: object) -> tuple[Any, ...]:
        return tuple(value) if isinstance(value, list | tuple) else ()

    return GuestReport(
        agent_version=r.agent_version if isinstance(r.agent_version, int) else 0,
        kernel_release=r.kernel_release if isinstance(r.kernel_release, str) else "",
        modules_loaded=tuple(m for m in seq(r.modules_loaded) if isinstance(m, str)),
        module_failures={k: str(v) for k, v in dict_of(r.module_failures).items() if isinstance(k, str)},
        driver_refusal=r.driver_refusal if isinstance(r.driver_refusal, str) else None,
        pci_devices=tuple(d for d in seq(r.pci_devices) if isinstance(d, GuestPciDevice)),
        device_files={k: v is True for k, v in dict_of(r.device_files).items() if isinstance(k, str)},
        kernel_driver_version=r.kernel_driver_version if isinstance(r.kernel_driver_version, str) else None,
        libraries={k: v for k, v in dict_of(r.libraries).items() if isinstance(k, str) and isinstance(v, LibraryInfo)},
        cuda=r.cuda if isinstance(r.cuda, CudaInfo) else None,
        nvml=r.nvml if isinstance(r.nvml, NvmlInfo) else None,
    )


def check_guest_template(t: Template, report: GuestReport, device: DeviceRecord | None) -> list[ContractViolation]:
    out: list[ContractViolation] = []
    clean = _sane(report)
    for part in (_kernel, _pci, _modules, _kernel_driver, _userspace, _cuda):
        out.extend(part(t, clean, device))
    return out


def _kernel(t: Template, r: GuestReport, _: DeviceRecord | None) -> Iterator[ContractViolation]:
    if r.kernel_release != t.guest_kernel.version:
        yield V(
            L.GUEST_KERNEL,
            "compat.guest_kernel_mismatch",
            t.guest_kernel.version,
            r.kernel_release or "empty",
            "the VM booted another kernel than the template's; check the kernel path the shim used",
        )


def _pci_ids(entry: GuestPciDevice) -> tuple[int, int] | None:
    try:
        return parse_hex_id(entry.vendor_id or ""), parse_hex_id(entry.device_id or "")
    except CubeError:
        return None


def _pci(t: Template, r: GuestReport, device: DeviceRecord | None) -> Iterator[ContractViolation]:
    if device is not None:
        wanted = {(device.identity.vendor_id, device.identity.device_id)}
    else:
        wanted = {(d.vendor_id, d.device_id) for d in t.devices}
    if not wanted:
        return
    seen = {ids for e in r.pci_devices if (ids := _pci_ids(e)) is not None}
    if not wanted & seen:
        yield V(
            L.HOST_HARDWARE,
            "compat.device_not_visible_in_guest",
            "PCI device " + " or ".join(sorted(f"{v:04x}:{d:04x}" for v, d in wanted)),
            ", ".join(sorted(f"{v:04x}:{d:04x}" for v, d in seen)) or "no PCI devices",
            "hot-plug did not reach the guest: check the root port and ACPI hot-plug in the guest kernel",
        )


def _modules(t: Template, r: GuestReport, _: DeviceRecord | None) -> Iterator[ContractViolation]:
    loaded = {module_key(m) for m in r.modules_loaded}
    failures = {module_key(k): v for k, v in r.module_failures.items()}
    driver = module_key(t.kernel_driver.module) if t.kernel_driver else None
    for name in dict.fromkeys([*([t.kernel_driver.module] if t.kernel_driver else []), *t.probes.modules]):
        key = module_key(name)
        if key == driver and r.driver_refusal is not None:
            continue  # in modules.img and built for this kernel: the driver's own refusal (_kernel_driver)
        if key in failures:
            yield V(
                L.MODULES_IMG,
                "compat.modules_img_module_failed",
                f"module {name} loads",
                failures[key][:200] or "load failed",
                f"modules.img must be built for {t.guest_kernel.version} and contain {name}",
            )
        elif key not in loaded and key != driver and r.driver_refusal is None:  # else: it needs the refused driver
            yield V(
                L.MODULES_IMG,
                "compat.modules_img_module_missing",
                f"module {name} in /proc/modules",
                "not loaded",
                "the agent did not load it and reported no error: is it in modules.img?",
            )


def _kernel_driver(t: Template, r: GuestReport, _: DeviceRecord | None) -> Iterator[ContractViolation]:
    kd = t.kernel_driver
    if kd is not None and r.driver_refusal is not None:
        yield V(
            L.KERNEL_DRIVER,
            "compat.kernel_driver_load_failed",
            f"{kd.module} {kd.version} loads and binds the device",
            r.driver_refusal[:300],
            "the module is in modules.img and built for this kernel; the driver refused (no supported device?)",
        )
        return  # no device files and no version without a loaded driver: consequences, not more failures
    if kd is not None:
        key = module_key(kd.module)
        loaded = key in {module_key(m) for m in r.modules_loaded}
        failed = key in {module_key(m) for m in r.module_failures}
        if not loaded and not failed:  # a failure is already reported by the modules_img layer
            yield V(L.KERNEL_DRIVER, "compat.kernel_driver_not_loaded", f"{kd.module} in /proc/modules", "absent")
        if loaded and r.kernel_driver_version != kd.version:
            yield V(
                L.KERNEL_DRIVER,
                "compat.kernel_driver_version_mismatch",
                kd.version,
                r.kernel_driver_version or "not reported",
                f"/sys/module/{kd.module}/version differs: modules.img carries another driver build",
            )
    for path in t.probes.device_files:
        if not r.device_files.get(path, False):
            yield V(
                L.KERNEL_DRIVER,
                "compat.kernel_driver_device_file_missing",
                f"{path} exists",
                "missing" if path in r.device_files else "not probed",
                "device nodes appear once the driver binds the device (nvidia-modprobe / udev in the guest)",
            )


def _library(r: GuestReport, name: str) -> tuple[bool, str | None, str]:
    info = r.libraries.get(name)
    if info is None:
        return False, None, ""
    return info.loaded, info.version, info.error or ""


def _userspace(t: Template, r: GuestReport, _: DeviceRecord | None) -> Iterator[ContractViolation]:
    ud = t.userspace_driver
    if ud is None:
        return
    for name in ud.libraries:
        ok, version, error = _library(r, name)
        if not ok:
            found = error[:200] or ("not loaded" if name in r.libraries else "not probed")
            yield V(L.USERSPACE_DRIVER, "compat.userspace_driver_library_missing", f"{name} loads", found)
        elif version is None:
            yield V(
                L.USERSPACE_DRIVER,
                "compat.userspace_driver_version_unknown",
                f"{name} {ud.version}",
                f"{name} loaded, version not reported",
                "a pinned driver version must be proven, not assumed",
            )
        elif version != ud.version:
            yield V(
                L.USERSPACE_DRIVER,
                "compat.userspace_driver_version_mismatch",
                f"{name} {ud.version}",
                f"{name} {version}",
                "the guest image carries another driver's user-space libraries than the template says",
            )


def _cuda(t: Template, r: GuestReport, _: DeviceRecord | None) -> Iterator[ContractViolation]:
    for name in t.probes.libraries:
        ok, _v, error = _library(r, name)
        if not ok:
            found = error[:200] or ("not loaded" if name in r.libraries else "not probed")
            yield V(L.CUDA_RUNTIME, "compat.cuda_runtime_library_missing", f"{name} loads", found)
    need = min_driver_api(t)
    if t.cuda is None or need is None:
        return
    c = r.cuda
    if c is None:
        yield V(L.CUDA_RUNTIME, "compat.cuda_not_probed", f"a CUDA probe (cuInit) for CUDA {t.cuda.version}", "none")
        return
    if r.driver_refusal is not None:  # cuInit needs the kernel driver: only the driver API version is judged
        yield from _driver_api(t, c, need)
        return
    if c.init_ok is not True:
        yield V(L.CUDA_RUNTIME, "compat.cuda_init_failed", "cuInit(0) == CUDA_SUCCESS", (c.error or "failed")[:200])
        return
    violations = list(_driver_api(t, c, need))
    yield from violations
    if any(v.code == "compat.cuda_driver_api_invalid" for v in violations):
        return
    count = c.device_count
    if count is None or count < 1:
        yield V(L.CUDA_RUNTIME, "compat.cuda_no_device", "cuDeviceGetCount >= 1", repr(count)[:40])


def _driver_api(t: Template, c: CudaInfo, need: int) -> Iterator[ContractViolation]:
    """cuDriverGetVersion's answer against the CUDA version the workload was built for (needs no device)."""
    raw = c.driver_version
    try:
        api = CudaVersion.from_driver_api(raw)
    except CubeError:
        yield V(L.CUDA_RUNTIME, "compat.cuda_driver_api_invalid", "cuDriverGetVersion like 12040", repr(raw)[:80])
        return
    if api.driver_api < need:
        built_for = t.cuda.version if t.cuda is not None else "?"
        yield V(
            L.CUDA_RUNTIME,
            "compat.cuda_driver_api_too_old",
            f"driver API >= {need // 1000}.{need % 1000 // 10}",
            f"{api.major}.{api.minor}",
            f"the guest's libcuda supports CUDA {api.major}.{api.minor}; the workload was built for {built_for}",
        )
