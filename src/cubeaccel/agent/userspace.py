"""Verdicts for the user-space layers: driver libraries, the CUDA driver API, NVML and persistence mode.

The foreign calls themselves live in cuda.py; this module decides what their answers mean for the contract.
"""

from __future__ import annotations

from cubeaccel.agent.cuda import CallTimeout, LoadedLibrary, call_with_deadline, load_library, query_cuda, query_nvml
from cubeaccel.agent.probes import ProbeContext, Verdict, timed
from cubeaccel.agent.spec import LibraryExpectation, ProbeSpec, version_matches
from cubeaccel.protocol.reports import CudaInfo, NvmlInfo, ProbeResult

Libraries = dict[str, LoadedLibrary]

# One code per layer a contract may blame a library on (spec._LAYERS): literals, so each one is catalogued.
LIBRARY_MISSING = {
    "userspace_driver": "compat.userspace_driver_library_missing",
    "cuda_runtime": "compat.cuda_runtime_library_missing",
    "kernel_driver": "compat.kernel_driver_library_missing",
    "modules_img": "compat.modules_img_library_missing",
}


def check_library(want: LibraryExpectation, ctx: ProbeContext, libs: Libraries) -> ProbeResult:
    """Load one library; if the contract names its version, the file's version must equal it."""

    def fn() -> Verdict:
        lib = libs[want.name] = load_library(want.name, ctx.lib_dirs)
        expected = want.version or "loadable"
        if lib.handle is None:
            return Verdict(False, LIBRARY_MISSING[want.layer], expected, "missing", lib.error or "")
        if want.version is not None and lib.version is not None and lib.version != want.version:
            return Verdict(False, "compat.userspace_driver_version_mismatch", expected, lib.version, lib.path or "")
        detail = lib.path or ""
        if want.version is not None and lib.version is None:
            detail = f"{detail} (version not readable from the file name)".strip()
        return Verdict(True, expected=expected, found=lib.version or "loaded", detail=detail)

    return timed(f"library:{want.name}", want.layer, fn)


def _library(name: str, ctx: ProbeContext, libs: Libraries) -> LoadedLibrary:
    if name not in libs:
        libs[name] = load_library(name, ctx.lib_dirs)
    return libs[name]


def probe_cuda(
    spec: ProbeSpec, ctx: ProbeContext, libs: Libraries, results: list[ProbeResult], initialize: bool = True
) -> CudaInfo:
    """cuDriverGetVersion / cuInit / cuDeviceGetCount through libcuda.so.1, bounded by ctx.cuda_timeout_s.
    `initialize=False` (the kernel driver refused): the driver API version only."""
    lib = _library("libcuda.so.1", ctx, libs)
    if lib.handle is None:
        miss = Verdict(False, "compat.userspace_driver_library_missing", "libcuda.so.1 loads", None, lib.error or "")
        results.append(timed("cuda", "userspace_driver", lambda: miss))
        return CudaInfo(error=lib.error)
    handle = lib.handle
    try:
        info = call_with_deadline(lambda: query_cuda(handle, initialize), ctx.cuda_timeout_s)
    except CallTimeout as exc:
        info = CudaInfo(error=f"timeout: {exc}")
    except Exception as exc:  # a missing symbol: not a CUDA driver library
        info = CudaInfo(error=f"{type(exc).__name__}: {exc}")
    results.append(timed("cuda:driver_version", "cuda_runtime", lambda: _cuda_version(spec, info)))
    if initialize:
        results.append(timed("cuda:init", "cuda_runtime", lambda: _cuda_init(info)))
        results.append(timed("cuda:device_count", "cuda_runtime", lambda: _cuda_count(info)))
    return info


def _api_text(api: int) -> str:
    return f"{api // 1000}.{api % 1000 // 10}"


def _cuda_version(spec: ProbeSpec, info: CudaInfo) -> Verdict:
    raw = info.driver_version
    expected = f">= {_api_text(spec.min_driver_api)}" if spec.min_driver_api else "any"
    if not isinstance(raw, int):
        return Verdict(False, "compat.cuda_init_failed", expected, None, info.error or "")
    if spec.min_driver_api is not None and raw < spec.min_driver_api:
        detail = f"the guest's libcuda supports CUDA {_api_text(raw)}; the contract needs {spec.cuda_version}"
        return Verdict(False, "compat.cuda_driver_api_too_old", expected, _api_text(raw), detail)
    return Verdict(True, expected=expected, found=_api_text(raw))


def _cuda_init(info: CudaInfo) -> Verdict:
    if info.init_ok:
        return Verdict(True, expected="CUDA_SUCCESS", found="CUDA_SUCCESS")
    error = info.error or ""
    code = "compat.cuda_timeout" if error.startswith("timeout") else "compat.cuda_init_failed"
    return Verdict(False, code, "CUDA_SUCCESS", error or None, error)


def _cuda_count(info: CudaInfo) -> Verdict:
    count = info.device_count
    if count is not None and count >= 1:
        return Verdict(True, expected=">= 1", found=str(count))
    found = None if count is None else str(count)
    return Verdict(False, "compat.cuda_no_device", ">= 1", found, info.error or "")


def probe_nvml(spec: ProbeSpec, ctx: ProbeContext, libs: Libraries, results: list[ProbeResult]) -> NvmlInfo:
    """NVML facts; persistence mode is switched on only if the contract asks AND the caller allows it."""
    lib = _library("libnvidia-ml.so.1", ctx, libs)
    info = NvmlInfo(error=lib.error)
    if lib.handle is not None:
        handle, allowed = lib.handle, ctx.set_persistence and spec.persistence_mode
        try:
            info = call_with_deadline(lambda: query_nvml(handle, allowed), ctx.cuda_timeout_s)
        except Exception as exc:  # CallTimeout or a missing symbol
            info = NvmlInfo(error=f"{type(exc).__name__}: {exc}")

    def nvml_verdict() -> Verdict:
        if info.device_count is None:
            return Verdict(False, "compat.nvml_failed", "NVML answers", None, info.error or "")
        return Verdict(True, expected="NVML answers", found=f"{info.device_count} device(s)")

    results.append(timed("nvml", "userspace_driver", nvml_verdict))
    if spec.persistence_mode:
        results.append(timed("persistence_mode", "userspace_driver", lambda: _persistence(ctx, info)))
    return info


def _persistence(ctx: ProbeContext, info: NvmlInfo) -> Verdict:
    devices = info.devices
    off = [str(d.index) for d in devices if d.persistence_mode is not True]
    if devices and not off:
        return Verdict(True, expected="enabled", found="enabled")
    why = "" if ctx.set_persistence else "read-only probe, not allowed to change it; "
    found = "disabled" if devices else None
    return Verdict(False, "compat.persistence_mode_off", "enabled", found, f"{why}off on device(s) {','.join(off)}")


def check_userspace_version(expected: str, libs: Libraries, nvml: NvmlInfo | None) -> ProbeResult:
    """Hand-written contracts name one user-space driver version: NVML's answer, else libcuda's file version."""

    def fn() -> Verdict:
        found = None if nvml is None else nvml.driver_version
        source = "nvmlSystemGetDriverVersion"
        for name in ("libcuda.so.1", "libnvidia-ml.so.1"):
            if found is None and name in libs and libs[name].version:
                found, source = libs[name].version, name
        if found is None:
            return Verdict(False, "compat.userspace_driver_version_mismatch", expected, None, "no version found")
        if version_matches(expected, found):
            return Verdict(True, expected=expected, found=found, detail=source)
        return Verdict(False, "compat.userspace_driver_version_mismatch", expected, found, source)

    return timed("userspace_driver", "userspace_driver", fn)
