"""User-space driver probes through ctypes: libcuda's driver API and, optionally, NVML.

ctypes (not a CUDA Python package) because the guest has only the standard library and the driver's
own .so files. Foreign calls run in a daemon thread with a deadline: a wedged cuInit must not wedge
the agent's protocol loop. Nothing here writes to the device except nvmlDeviceSetPersistenceMode, and
only when the caller passes `set_persistence=True`.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from cubeaccel.protocol.reports import CudaInfo, LibraryInfo, NvmlDevice, NvmlInfo

T = TypeVar("T")

CUDA_ERRORS = {
    0: "CUDA_SUCCESS",
    1: "CUDA_ERROR_INVALID_VALUE",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED",
    35: "CUDA_ERROR_INSUFFICIENT_DRIVER",
    100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE",
    304: "CUDA_ERROR_OPERATING_SYSTEM",
    804: "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
    999: "CUDA_ERROR_UNKNOWN",
}
NVML_SUCCESS = 0


class CallTimeout(Exception):
    """A foreign call did not return within its deadline; its thread is left behind (daemon)."""


def call_with_deadline(fn: Callable[[], T], timeout_s: float) -> T:
    """Run `fn` in a daemon thread; raise CallTimeout if it is still running after `timeout_s`."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, name="cube-agent-ffi", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise CallTimeout(f"no answer within {timeout_s:g}s")
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value


@dataclass
class LoadedLibrary:
    name: str
    handle: ctypes.CDLL | None
    path: str | None = None
    version: str | None = None
    error: str | None = None

    def info(self) -> LibraryInfo:
        return LibraryInfo(self.handle is not None, self.path, self.version, self.error)


def _version_from_path(name: str, path: str | None) -> str | None:
    """`libcuda.so.1` → realpath `libcuda.so.550.54.15` → `550.54.15` (the driver's own version)."""
    if path is None:
        return None
    base = os.path.basename(os.path.realpath(path))
    stem = name.split(".so")[0] + ".so."
    if not base.startswith(stem):
        return None
    version = base[len(stem) :]
    return version if version and version != name[len(stem) :] else None


def _mapped_path(name: str) -> str | None:
    """Where the dynamic linker found `name`: the first matching file in /proc/self/maps."""
    stem = name.split(".so")[0] + ".so"
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                parts = line.split(None, 5)
                if len(parts) == 6 and os.path.basename(parts[5].strip()).startswith(stem):
                    return parts[5].strip()
    except OSError:
        return None
    return None


def load_library(name: str, lib_dirs: tuple[str, ...] = ()) -> LoadedLibrary:
    """Load `name` from `lib_dirs` first, then via the dynamic linker's search; never raises."""
    errors = []
    for directory in lib_dirs:
        candidate = Path(directory) / name
        if not candidate.exists():
            continue
        try:
            handle = ctypes.CDLL(str(candidate))
        except OSError as exc:
            errors.append(str(exc))
            continue
        resolved = os.path.realpath(candidate)
        return LoadedLibrary(name, handle, resolved, _version_from_path(name, resolved))
    try:
        handle = ctypes.CDLL(name)
    except OSError as exc:
        errors.append(str(exc))
        return LoadedLibrary(name, None, error="; ".join(errors)[-500:])
    mapped = _mapped_path(name)
    real = os.path.realpath(mapped) if mapped else None
    return LoadedLibrary(name, handle, real, _version_from_path(name, real))


def _cuda_error(lib: ctypes.CDLL, rc: int) -> str:
    try:
        fn = lib.cuGetErrorName
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        fn.restype = ctypes.c_int
        out = ctypes.c_char_p()
        if fn(rc, ctypes.byref(out)) == 0 and out.value:
            return out.value.decode(errors="replace")
    except AttributeError:
        pass
    return CUDA_ERRORS.get(rc, f"CUresult {rc}")


def query_cuda(lib: ctypes.CDLL, initialize: bool = True) -> CudaInfo:
    """cuDriverGetVersion, cuInit(0), cuDeviceGetCount — the minimum that proves CUDA answers
    (`initialize=False`: the version only, which needs no device and no kernel driver)."""
    get_version, init, get_count = lib.cuDriverGetVersion, lib.cuInit, lib.cuDeviceGetCount
    get_version.argtypes = [ctypes.POINTER(ctypes.c_int)]
    init.argtypes = [ctypes.c_uint]
    get_count.argtypes = [ctypes.POINTER(ctypes.c_int)]
    for fn in (get_version, init, get_count):
        fn.restype = ctypes.c_int
    raw = ctypes.c_int(0)
    rc = get_version(ctypes.byref(raw))
    if rc != 0:
        return CudaInfo(error=f"cuDriverGetVersion: {_cuda_error(lib, rc)}")
    # 12040 = CUDA 12.4, as cuDriverGetVersion returns it
    out = CudaInfo(driver_version=raw.value, driver_version_text=f"{raw.value // 1000}.{(raw.value % 1000) // 10}")
    if not initialize:
        return replace(out, error="cuInit not called: the kernel driver did not load")
    started = time.perf_counter()
    rc = init(0)
    # the probe's own timer only judges
    out = replace(out, init_ms=round((time.perf_counter() - started) * 1000.0, 3), init_result=rc)
    if rc != 0:
        return replace(out, error=f"cuInit: {_cuda_error(lib, rc)}")
    count = ctypes.c_int(0)
    rc = get_count(ctypes.byref(count))
    if rc != 0:
        return replace(out, init_ok=True, error=f"cuDeviceGetCount: {_cuda_error(lib, rc)}")
    return replace(out, init_ok=True, device_count=count.value)


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _nvml(lib: ctypes.CDLL, symbol: str, *argtypes: Any) -> Callable[..., int]:
    fn = getattr(lib, symbol)
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def query_nvml(lib: ctypes.CDLL, set_persistence: bool) -> NvmlInfo:
    """Driver version, device count, name, memory and persistence mode; turns persistence on only if asked."""
    rc = _nvml(lib, "nvmlInit_v2")()
    if rc != NVML_SUCCESS:
        return NvmlInfo(error=f"nvmlInit_v2 returned {rc}")
    try:
        version = None
        buf = ctypes.create_string_buffer(96)
        if _nvml(lib, "nvmlSystemGetDriverVersion", ctypes.c_char_p, ctypes.c_uint)(buf, 96) == NVML_SUCCESS:
            version = buf.value.decode(errors="replace")
        count = ctypes.c_uint(0)
        rc = _nvml(lib, "nvmlDeviceGetCount_v2", ctypes.POINTER(ctypes.c_uint))(ctypes.byref(count))
        if rc != NVML_SUCCESS:
            return NvmlInfo(driver_version=version, error=f"nvmlDeviceGetCount_v2 returned {rc}")
        devices = tuple(_nvml_device(lib, index, set_persistence) for index in range(min(count.value, 64)))
        return NvmlInfo(driver_version=version, device_count=count.value, devices=devices)
    finally:
        _nvml(lib, "nvmlShutdown")()


def _nvml_device(lib: ctypes.CDLL, index: int, set_persistence: bool) -> NvmlDevice:
    handle = ctypes.c_void_p()
    rc = _nvml(lib, "nvmlDeviceGetHandleByIndex_v2", ctypes.c_uint, ctypes.POINTER(ctypes.c_void_p))(
        index, ctypes.byref(handle)
    )
    if rc != NVML_SUCCESS:
        return NvmlDevice(index, error=f"nvmlDeviceGetHandleByIndex_v2 returned {rc}")
    dev = NvmlDevice(index)
    name = ctypes.create_string_buffer(96)
    if _nvml(lib, "nvmlDeviceGetName", ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint)(handle, name, 96) == 0:
        dev = replace(dev, name=name.value.decode(errors="replace"))
    memory = _Memory()
    if (
        _nvml(lib, "nvmlDeviceGetMemoryInfo", ctypes.c_void_p, ctypes.POINTER(_Memory))(handle, ctypes.byref(memory))
        == 0
    ):
        dev = replace(dev, memory_total_bytes=memory.total)
    get_mode = _nvml(lib, "nvmlDeviceGetPersistenceMode", ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))
    mode = ctypes.c_int(-1)
    if get_mode(handle, ctypes.byref(mode)) == 0:
        dev = replace(dev, persistence_mode=mode.value == 1)
    if set_persistence and dev.persistence_mode is False:
        rc = _nvml(lib, "nvmlDeviceSetPersistenceMode", ctypes.c_void_p, ctypes.c_int)(handle, 1)
        dev = replace(dev, persistence_set_result=rc)
        if rc == NVML_SUCCESS and get_mode(handle, ctypes.byref(mode)) == 0:
            dev = replace(dev, persistence_mode=mode.value == 1)
    return dev
