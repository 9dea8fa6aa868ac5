"""Stage 1, registration: is the template internally consistent?

Run by CubeMaster when a template is registered and by `cubeaccel template validate`. Nothing here looks
at a node or a device: only the template and the tables in `compat_tables`. Each check names the layer
an operator has to change to fix it; checks that depend on a value that is itself broken are skipped,
so one mistake produces one violation.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from cubeaccel.model.compat_tables import (
    ARCHITECTURE_MIN_DRIVER,
    CUDA_MINOR_COMPAT_MIN_DRIVER,
    CUDA_TOOLKIT_MIN_DRIVER,
    KNOWN_BACKENDS,
)
from cubeaccel.model.device import AcceleratorClass
from cubeaccel.model.limits import MAX_MEMORY_MIB, MIN_MEMORY_MIB
from cubeaccel.model.profiles import PROFILES
from cubeaccel.model.sandbox_policy import refusals
from cubeaccel.model.template_spec import CUDA_COMPAT_MODES, NO_ACCELERATOR, DeviceMatch, Template
from cubeaccel.model.versions import CudaVersion, DriverVersion, KernelVersion
from cubeaccel.model.violations import ContractViolation, Layer
from cubeaccel.protocol.errors import CubeError

L = Layer
V = ContractViolation

DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_NAME = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_TVERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_MODULE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SONAME = re.compile(r"lib[A-Za-z0-9_.+-]{1,120}\.so(?:\.[0-9]+)*")
_DEVFILE = re.compile(r"/dev/[A-Za-z0-9_./-]{1,120}")
_DIGEST_HINT = "write digests as sha256:<64 lowercase hex> (the image builder prints them)"


def check_template(t: Template) -> list[ContractViolation]:
    """All registration violations of `t`, in stack order; empty when the template is consistent."""
    out: list[ContractViolation] = []
    for check in (
        _template_layer,
        _cpu_only,
        _host_hardware,
        _backend,
        _guest_kernel,
        _modules_img,
        _kernel_driver,
        _userspace_driver,
        _cuda_runtime,
        _pinned_memory,
        _sandbox,
    ):
        out.extend(check(t))
    return out


def _parse_driver(text: str) -> DriverVersion | None:
    try:
        return DriverVersion.parse(text)
    except CubeError:
        return None


def _parse_cuda(text: str) -> CudaVersion | None:
    try:
        return CudaVersion.parse(text)
    except CubeError:
        return None


def _template_layer(t: Template) -> Iterator[ContractViolation]:
    if not _NAME.fullmatch(t.name):
        yield V(L.TEMPLATE, "compat.template_invalid_name", "a DNS label (a-z, 0-9, -; ≤ 63)", repr(t.name))
    if not _TVERSION.fullmatch(t.version):
        yield V(L.TEMPLATE, "compat.template_invalid_version", "1-64 of A-Z a-z 0-9 . _ -", repr(t.version))
    if t.accel_class not in {c.value for c in AcceleratorClass} and not t.cpu_only:
        yield V(
            L.TEMPLATE,
            "compat.template_unknown_class",
            " or ".join(c.value for c in AcceleratorClass),
            repr(t.accel_class),
        )
    if not DIGEST.fullmatch(t.guest_image_digest):
        yield V(
            L.TEMPLATE, "compat.template_image_digest_malformed", "sha256:<64 hex>", t.guest_image_digest, _DIGEST_HINT
        )
    bad = [m for m in t.probes.modules if not _MODULE.fullmatch(m)]
    bad += [f for f in t.probes.device_files if not _DEVFILE.fullmatch(f) or ".." in f]
    bad += [lib for lib in t.probes.libraries if not _SONAME.fullmatch(lib)]
    if bad:
        yield V(
            L.TEMPLATE,
            "compat.template_probe_invalid",
            "module names, /dev/ paths and library sonames",
            ", ".join(repr(b) for b in bad),
            "probes.modules: [nvidia]; probes.device_files: [/dev/nvidia0]; probes.libraries: [libcudart.so.12]",
        )


def architecture_of(d: DeviceMatch) -> str | None:
    """A device's architecture: the template's label wins, else the known profile for its ids."""
    if "architecture" in d.labels:
        return d.labels["architecture"]
    p = PROFILES.get((d.vendor_id, d.device_id))
    return p.architecture if p else None


def _cpu_only(t: Template) -> Iterator[ContractViolation]:
    """A template without an accelerator carries nothing that needs one: no devices, driver, CUDA or hot-plug."""
    if not t.cpu_only:
        return
    stack = [
        name
        for name, present in (
            ("accelerator.devices", bool(t.devices)),
            ("driver", t.kernel_driver is not None or t.userspace_driver is not None),
            ("cuda", t.cuda is not None),
            ("guest.init.persistence_mode", t.init.persistence_mode),
            ("hotplug: true", t.hotplug),
        )
        if present
    ]
    if t.backend != NO_ACCELERATOR:
        stack.insert(0, f"accelerator.backend {t.backend!r}")
    if stack:
        yield V(
            L.TEMPLATE,
            "compat.template_cpu_only_with_device_stack",
            "a CPU-only template (no spec.accelerator) with no device, driver, CUDA or hot-plug",
            ", ".join(stack),
            "remove these, or give the template an accelerator section",
        )


def _host_hardware(t: Template) -> Iterator[ContractViolation]:
    if t.cpu_only:
        return
    if not t.devices:
        yield V(
            L.HOST_HARDWARE,
            "compat.host_hardware_none_listed",
            "at least one supported device (vendor_id, device_id)",
            "none",
            "list the devices this stack was tested on under spec.accelerator.devices",
        )
        return
    if t.cuda is not None:
        not_cuda = [d for d in t.devices if (p := PROFILES.get((d.vendor_id, d.device_id))) and not p.cuda]
        if not_cuda:
            yield V(
                L.HOST_HARDWARE,
                "compat.host_hardware_not_cuda_capable",
                "CUDA-capable devices (cuda is set)",
                ", ".join(f"{d.vendor_device} ({PROFILES[(d.vendor_id, d.device_id)].model})" for d in not_cuda),
                "remove spec.cuda or the non-CUDA devices",
            )


def _backend(t: Template) -> Iterator[ContractViolation]:
    if t.cpu_only:
        return  # no device reaches the VM: there is no backend to know, nothing to hot-plug
    if t.backend not in KNOWN_BACKENDS:
        yield V(
            L.BACKEND,
            "compat.backend_unknown",
            " or ".join(sorted(KNOWN_BACKENDS)),
            repr(t.backend),
            "spec.accelerator.backend names how the device reaches the VM",
        )
    if not t.hotplug:
        yield V(
            L.BACKEND,
            "compat.coldplug_unsupported",
            "hotplug: true",
            "hotplug: false",
            "devices reach a MicroVM only by hot-plug once its agent answers; attaching at VM start is not implemented",
        )


def _guest_kernel(t: Template) -> Iterator[ContractViolation]:
    try:
        KernelVersion.parse(t.guest_kernel.version)
    except CubeError:
        yield V(
            L.GUEST_KERNEL,
            "compat.guest_kernel_invalid_version",
            "a kernel release (uname -r) like 6.1.0-27-cloud-amd64",
            repr(t.guest_kernel.version)[:80],
        )
    if not DIGEST.fullmatch(t.guest_kernel.digest):
        yield V(
            L.GUEST_KERNEL,
            "compat.guest_kernel_digest_malformed",
            "sha256:<64 hex>",
            t.guest_kernel.digest,
            _DIGEST_HINT,
        )


def _modules_img(t: Template) -> Iterator[ContractViolation]:
    if t.modules_img.kernel_version != t.guest_kernel.version:
        yield V(
            L.MODULES_IMG,
            "compat.modules_img_kernel_mismatch",
            f"modules built for {t.guest_kernel.version}",
            f"modules built for {t.modules_img.kernel_version}",
            "modules only load into the exact kernel release they were built for; rebuild modules.img",
        )
    if not DIGEST.fullmatch(t.modules_img.digest):
        yield V(
            L.MODULES_IMG, "compat.modules_img_digest_malformed", "sha256:<64 hex>", t.modules_img.digest, _DIGEST_HINT
        )


def _kernel_driver(t: Template) -> Iterator[ContractViolation]:
    kd = t.kernel_driver
    if kd is None:
        if t.cuda is not None or t.userspace_driver is not None:
            yield V(
                L.KERNEL_DRIVER,
                "compat.kernel_driver_missing",
                "spec.driver.kernel (module and version)",
                "none",
                "CUDA and user-space driver libraries need the vendor kernel module in the guest",
            )
        return
    if not _MODULE.fullmatch(kd.module):
        yield V(L.KERNEL_DRIVER, "compat.kernel_driver_invalid_module", "a module name like nvidia", repr(kd.module))
    drv = _parse_driver(kd.version)
    if drv is None:
        yield V(L.KERNEL_DRIVER, "compat.kernel_driver_invalid_version", "a driver version like 550.54.15", kd.version)
        return
    for d in t.devices:
        arch = architecture_of(d)
        support = ARCHITECTURE_MIN_DRIVER.get(arch or "")
        if support is not None and not drv.at_least(DriverVersion.parse(support.min_driver)):
            yield V(
                L.KERNEL_DRIVER,
                "compat.kernel_driver_arch_unsupported",
                f"driver >= {support.min_driver} for {arch} ({d.vendor_device})",
                kd.version,
                f"{arch} is first supported by {support.min_driver}; source: {support.source}",
            )


def _userspace_driver(t: Template) -> Iterator[ContractViolation]:
    ud, kd = t.userspace_driver, t.kernel_driver
    if ud is None and t.init.persistence_mode:
        yield V(
            L.USERSPACE_DRIVER,
            "compat.persistence_mode_needs_userspace_driver",
            "spec.driver.userspace (with libnvidia-ml.so.1)",
            "none",
            "cube-agent sets persistence mode through NVML, which the user-space driver provides",
        )
    if ud is None:
        if t.cuda is not None:
            yield V(
                L.USERSPACE_DRIVER,
                "compat.userspace_driver_missing",
                "spec.driver.userspace (version, libraries)",
                "none",
                "CUDA reaches the GPU through the user-space driver (libcuda.so.1)",
            )
        return
    if _parse_driver(ud.version) is None:
        yield V(
            L.USERSPACE_DRIVER, "compat.userspace_driver_invalid_version", "a driver version like 550.54.15", ud.version
        )
        return
    bad = [lib for lib in ud.libraries if not _SONAME.fullmatch(lib)]
    if bad:
        yield V(L.USERSPACE_DRIVER, "compat.userspace_driver_invalid_library", "library sonames", ", ".join(bad))
    if kd is not None and _parse_driver(kd.version) is not None and ud.version != kd.version:
        yield V(
            L.USERSPACE_DRIVER,
            "compat.userspace_driver_mismatch",
            f"user-space driver {kd.version} (same as the kernel module)",
            ud.version,
            "NVIDIA's user-space libraries refuse a kernel module of another version (API mismatch)",
        )


def _cuda_runtime(t: Template) -> Iterator[ContractViolation]:
    if t.cuda is None:
        return
    cuda = _parse_cuda(t.cuda.version)
    if cuda is None:
        yield V(L.CUDA_RUNTIME, "compat.cuda_invalid_version", "a CUDA version like 12.4 or 12.4.1", t.cuda.version)
        return
    if t.cuda.compatibility not in CUDA_COMPAT_MODES:
        yield V(
            L.CUDA_RUNTIME, "compat.cuda_invalid_compatibility", " or ".join(CUDA_COMPAT_MODES), t.cuda.compatibility
        )
        return
    known = sorted({f"{k[0]}.{k[1]}" for k in CUDA_TOOLKIT_MIN_DRIVER}, key=lambda s: tuple(map(int, s.split("."))))
    if t.cuda.compatibility == "minor_version":
        floor, source = CUDA_MINOR_COMPAT_MIN_DRIVER.get(cuda.major), "minor-version compatibility table"
        label = f"CUDA {cuda.major}.x (minor-version compatibility)"
    else:
        floor, source = CUDA_TOOLKIT_MIN_DRIVER.get((cuda.major, cuda.minor, cuda.update)), "toolkit driver table"
        label = f"CUDA {cuda}"
    if floor is None:
        yield V(
            L.CUDA_RUNTIME,
            "compat.cuda_unknown_version",
            f"a CUDA release in the {source}",
            str(cuda),
            f"known: {', '.join(known)} (+ .N for Update N); see docs/compatibility.md",
        )
        return
    # The user-space driver is what CUDA talks to; without one, judge the kernel module.
    source_driver = t.userspace_driver or t.kernel_driver
    drv = _parse_driver(source_driver.version) if source_driver else None
    if drv is None:
        return  # reported by the driver layers
    if not drv.at_least(DriverVersion.parse(floor)):
        hint = f"{label} needs driver >= {floor} ({source})"
        minor = CUDA_MINOR_COMPAT_MIN_DRIVER.get(cuda.major)
        if t.cuda.compatibility == "toolkit" and minor and drv.at_least(DriverVersion.parse(minor)):
            hint += "; this driver would run it with `compatibility: minor_version` (no newer-PTX JIT)"
        yield V(L.CUDA_RUNTIME, "compat.cuda_driver_too_old", f"driver >= {floor} for {label}", str(drv), hint)


def _pinned_memory(t: Template) -> Iterator[ContractViolation]:
    if not MIN_MEMORY_MIB <= t.memory_mib <= MAX_MEMORY_MIB:
        want = f"{MIN_MEMORY_MIB} MiB .. {MAX_MEMORY_MIB >> 20} TiB"
        yield V(L.PINNED_MEMORY, "compat.pinned_memory_size_invalid", want, f"{t.memory_mib} MiB")
    backend = KNOWN_BACKENDS.get(t.backend)
    if backend is not None and backend.dma and not t.pin_memory:
        yield V(
            L.PINNED_MEMORY,
            "compat.pinned_memory_required",
            "memory.pinned: true",
            "memory.pinned: false",
            f"a {t.backend} device can DMA into any guest page: all memory must be allocated and locked "
            "before the device is attached (hot-plugged or not)",
        )


def _sandbox(t: Template) -> Iterator[ContractViolation]:
    """`spec.sandbox`: network, files, and the cases a sandbox with a passed-through device never offers."""
    for r in refusals(t.sandbox, t.accel_class):
        yield V(L.TEMPLATE, r.code, r.expected, r.found, r.hint)
