"""The trusted scrub VM's one job: clear what the previous tenant could leave in the device, then prove it.

Two ways in, one result shape (`ScrubResult`):
- `scrub_cuda`: NVIDIA classes, through the CUDA driver API by ctypes (the guest has only the standard library and
  the driver's .so): cuMemGetInfo, cuMemAlloc in chunks until the device refuses (or `max_bytes`), cuMemsetD8 to
  zero, cuCtxSynchronize, then copy samples back (first and last page of every chunk plus random pages) and check
  every byte is zero. "Allocatable" is what the driver lets one context allocate: memory the driver keeps for
  itself (its reserved heap, page tables) is not reachable from here and not claimed cleared.
- `scrub_bar_memory`: a memory BAR with RAM behind it (the `ivshmem-plain` stand-in): all of it zeroed, all read back.
- `scrub_bar`: a device whose tenant-writable state is registers behind a memory BAR (the emulated `edu`): each
  register is written through `<device>/resource0` (mmap, 32/64-bit accesses, never memcpy) and read back.

Stdlib only (guest side). Nothing here decides whether the device may be reused: the host does, from the result.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cubeaccel.agent.cuda import CallTimeout, _cuda_error, call_with_deadline, load_library

MiB = 1024 * 1024
DEFAULT_CHUNK = 256 * MiB
MIN_CHUNK = 2 * MiB
SAMPLE = 4096
RANDOM_SAMPLES_PER_CHUNK = 4
OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY


@dataclass
class ScrubResult:
    ok: bool
    method: str
    bytes_zeroed: int = 0
    bytes_verified: int = 0
    total_bytes: int | None = None  # what the device says it has (cuMemGetInfo total; BAR: register bytes)
    free_bytes: int | None = None
    chunks: int = 0
    zero_ms: float = 0.0
    verify_ms: float = 0.0
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    truncated: bool = False  # stopped at max_bytes before the device refused an allocation
    pattern: str = "0x00"  # what was written (cuda: every byte zero; bar: each register's value, `registers`)
    pages_sampled: int = 0  # read-back samples: 4 KiB pages (cuda), registers (bar)
    pages_nonzero: int = 0  # samples that did not read back as written (all of them; `mismatches` keeps 16)

    def to_json(self) -> dict[str, object]:
        return asdict(self)


# ---- registers behind a BAR (edu) -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Register:
    """One tenant-writable register: write `value`, expect `expect` back (edu's liveness register inverts)."""

    offset: int
    width: int  # 4 or 8: the access size the device decodes
    value: int
    expect: int
    name: str


# QEMU's edu (hw/misc/edu.c, BAR0, 1 MiB): what a guest can write and read back. 0x00 (id) and 0x20 (status) are
# read-only; 0x98 (DMA command) is not written (it would start a transfer); the 4 KiB DMA buffer is reachable only by
# DMA, not through the BAR, and is not claimed here (docs/scrub.md).
EDU_REGISTERS: tuple[Register, ...] = (
    Register(0x04, 4, 0xFFFFFFFF, 0x00000000, "liveness"),  # reads back ~value
    Register(0x80, 8, 0, 0, "dma_src"),
    Register(0x88, 8, 0, 0, "dma_dst"),
    Register(0x90, 8, 0, 0, "dma_count"),
)
LAYOUTS = {"edu": EDU_REGISTERS}


def _access(buf: mmap.mmap, reg: Register) -> ctypes.c_uint32 | ctypes.c_uint64:
    """A typed view of one register: loads and stores of exactly its width (MMIO cares about access size)."""
    kind = ctypes.c_uint64 if reg.width == 8 else ctypes.c_uint32
    return kind.from_buffer(buf, reg.offset)


def enable_memory(device_dir: Path) -> None:
    """A hot-plugged function without a driver may have memory decoding off: `enable` turns it on (root only)."""
    enable = device_dir / "enable"
    if enable.exists() and enable.read_text().strip() == "0":
        enable.write_text("1")


def scrub_bar(device_dir: Path, registers: tuple[Register, ...], resource: str = "resource0") -> ScrubResult:
    out = ScrubResult(ok=False, method="bar", total_bytes=sum(r.width for r in registers), pattern="registers")
    try:
        enable_memory(device_dir)
        fd = os.open(device_dir / resource, os.O_RDWR | os.O_SYNC)
    except OSError as e:
        out.error = f"cannot open {device_dir / resource}: {e}"
        return out
    try:
        size = max(r.offset + r.width for r in registers)
        buf = mmap.mmap(fd, mmap.PAGESIZE * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))
    except OSError as e:
        os.close(fd)
        out.error = f"cannot map {resource}: {e}"
        return out
    try:
        t0 = time.perf_counter()
        for reg in registers:
            _access(buf, reg).value = reg.value
            out.bytes_zeroed += reg.width
        t1 = time.perf_counter()
        for reg in registers:
            found = _access(buf, reg).value
            out.bytes_verified += reg.width
            out.pages_sampled += 1
            if found != reg.expect:
                out.pages_nonzero += 1
                out.mismatches.append(
                    {"register": reg.name, "offset": reg.offset, "found": found, "expect": reg.expect}
                )
        out.zero_ms = round((t1 - t0) * 1000, 3)
        out.verify_ms = round((time.perf_counter() - t1) * 1000, 3)
    finally:
        buf.close()
        os.close(fd)
    out.chunks = 1
    out.ok = not out.mismatches
    if out.mismatches:
        out.error = f"{len(out.mismatches)} register(s) did not read back as written"
    return out


def read_bar(device_dir: Path, registers: tuple[Register, ...], resource: str = "resource0") -> dict[str, int]:
    """What each register holds now (a tenant's marker check; the scrub's own verify uses the same accesses)."""
    enable_memory(device_dir)
    fd = os.open(device_dir / resource, os.O_RDWR | os.O_SYNC)
    try:
        buf = mmap.mmap(fd, mmap.PAGESIZE)
        try:
            return {r.name: int(_access(buf, r).value) for r in registers}
        finally:
            buf.close()
    finally:
        os.close(fd)


def write_bar(device_dir: Path, values: dict[str, int], registers: tuple[Register, ...]) -> None:
    enable_memory(device_dir)
    fd = os.open(device_dir / "resource0", os.O_RDWR | os.O_SYNC)
    try:
        buf = mmap.mmap(fd, mmap.PAGESIZE)
        try:
            for r in registers:
                if r.name in values:
                    _access(buf, r).value = values[r.name]
        finally:
            buf.close()
    finally:
        os.close(fd)


# ---- memory behind a BAR (ivshmem-plain over a per-device file) --------------------------------------------------
BAR_CHUNK = 1 * MiB


def scrub_bar_memory(device_dir: Path, resource: str = "resource2", seed: int | None = None) -> ScrubResult:
    """Zero every byte of a memory BAR (`<dev>/<resource>`, mmap) and read every byte back: the memory is small
    (a stand-in's few MiB), so nothing is sampled. The read-back starts from a page pre-filled with 0xA5 in
    Python's own buffer, so a read that returned nothing cannot pass."""
    out = ScrubResult(ok=False, method="bar-memory")
    try:
        enable_memory(device_dir)
        fd = os.open(device_dir / resource, os.O_RDWR | os.O_SYNC)
    except OSError as e:
        out.error = f"cannot open {device_dir / resource}: {e}"
        return out
    try:
        size = os.fstat(fd).st_size or _resource_size(device_dir, resource)
        out.total_bytes = size
        buf = mmap.mmap(fd, size)
    except (OSError, ValueError) as e:
        os.close(fd)
        out.error = f"cannot map {resource}: {e}"
        return out
    try:
        t0 = time.perf_counter()
        out.bytes_zeroed = _zero(buf, size)
        t1 = time.perf_counter()
        for off in range(0, size, SAMPLE):
            page = bytearray(b"\xa5" * min(SAMPLE, size - off))
            page[:] = buf[off : off + len(page)]
            out.bytes_verified += len(page)
            out.pages_sampled += 1
            if page.count(0) != len(page):
                out.pages_nonzero += 1
                if len(out.mismatches) < 16:
                    first = next(i for i, b in enumerate(page) if b)
                    out.mismatches.append({"offset": off + first, "byte": page[first]})
        out.zero_ms = round((t1 - t0) * 1000, 3)
        out.verify_ms = round((time.perf_counter() - t1) * 1000, 3)
    finally:
        buf.close()
        os.close(fd)
    out.chunks = 1
    out.ok = out.bytes_zeroed > 0 and not out.pages_nonzero
    if out.pages_nonzero:
        out.error = f"{out.pages_nonzero} page(s) not zero after the write"
    elif not out.bytes_zeroed:
        out.error = f"{resource} has no bytes"
    return out


CANARY = b"CUBECANARY:"  # + the tenant's tag, padded to 32 bytes, repeated over all of the memory


def _map_rw(device_dir: Path, resource: str) -> tuple[int, mmap.mmap]:
    enable_memory(device_dir)
    fd = os.open(device_dir / resource, os.O_RDWR | os.O_SYNC)
    try:
        size = os.fstat(fd).st_size or _resource_size(device_dir, resource)
        return fd, mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise


def fill_canary(device_dir: Path, tag: str, resource: str = "resource2") -> int:
    """A tenant's leftovers: `CUBECANARY:<tag>` in every 32 bytes of the memory BAR. Returns the bytes written."""
    record = (CANARY + tag.encode()[:21]).ljust(32, b".")
    fd, buf = _map_rw(device_dir, resource)
    try:
        chunk = record * (min(BAR_CHUNK, len(buf)) // 32)
        for off in range(0, len(buf), len(chunk)):
            n = min(len(chunk), len(buf) - off)
            buf[off : off + n] = chunk[:n]
        buf.flush()
        return len(buf)
    finally:
        buf.close()
        os.close(fd)


def scan_canary(device_dir: Path, resource: str = "resource2") -> dict[str, Any]:
    """What the next tenant finds: every byte of the memory BAR read, canary records counted (by tag)."""
    fd, buf = _map_rw(device_dir, resource)
    try:
        data = buf[:]
    finally:
        buf.close()
        os.close(fd)
    tags: dict[str, int] = {}
    at = data.find(CANARY)
    while at >= 0:
        tag = data[at + len(CANARY) : at + 32].rstrip(b".").decode(errors="replace")
        tags[tag] = tags.get(tag, 0) + 1
        at = data.find(CANARY, at + 1)
    return {"bytes_scanned": len(data), "hits": sum(tags.values()), "tags": tags, "nonzero": len(data) - data.count(0)}


def _zero(buf: mmap.mmap, size: int) -> int:
    """Every byte of the mapping written zero, a chunk at a time; returns the bytes written."""
    zeros = bytes(min(BAR_CHUNK, size))
    for off in range(0, size, BAR_CHUNK):
        n = min(BAR_CHUNK, size - off)
        buf[off : off + n] = zeros[:n]
    buf.flush()
    return size


def _resource_size(device_dir: Path, resource: str) -> int:
    """A sysfs `resourceN` file reports size 0 on some kernels: the size from `<dev>/resource`'s line N."""
    index = int(resource.removeprefix("resource"))
    start, end, _ = (int(x, 16) for x in (device_dir / "resource").read_text().splitlines()[index].split())
    return end - start + 1 if end else 0


# ---- CUDA device memory ---------------------------------------------------------------------------------------
class _Cuda:
    """The few driver-API entry points the scrub needs, typed once (CUdeviceptr is a 64-bit integer)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        u64, p_u64, vp = ctypes.c_ulonglong, ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_void_p
        sz, p_sz = ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)
        self.init = self._fn("cuInit", ctypes.c_uint)
        self.device_get = self._fn("cuDeviceGet", ctypes.POINTER(ctypes.c_int), ctypes.c_int)
        self.ctx_create = self._fn("cuCtxCreate_v2", ctypes.POINTER(vp), ctypes.c_uint, ctypes.c_int)
        self.ctx_destroy = self._fn("cuCtxDestroy_v2", vp)
        self.mem_info = self._fn("cuMemGetInfo_v2", p_sz, p_sz)
        self.alloc = self._fn("cuMemAlloc_v2", p_u64, sz)
        self.free = self._fn("cuMemFree_v2", u64)
        self.memset = self._fn("cuMemsetD8_v2", u64, ctypes.c_ubyte, sz)
        self.dtoh = self._fn("cuMemcpyDtoH_v2", vp, u64, sz)
        self.sync = self._fn("cuCtxSynchronize")

    def _fn(self, name: str, *argtypes: Any) -> Callable[..., int]:
        fn = getattr(self.lib, name)
        fn.argtypes = list(argtypes)
        fn.restype = ctypes.c_int
        return fn  # type: ignore[no-any-return]

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what}: {_cuda_error(self.lib, rc)}")


def _sample_offsets(size: int, rng: random.Random) -> list[int]:
    """First and last page of a chunk (where allocation boundaries sit) and a few random pages in between."""
    last = max(0, size - SAMPLE)
    offsets = {0, last}
    offsets.update(rng.randrange(0, last + 1) & ~(SAMPLE - 1) for _ in range(RANDOM_SAMPLES_PER_CHUNK))
    return sorted(o for o in offsets if o <= last)


def _scrub_cuda(cu: _Cuda, device: int, max_bytes: int | None, chunk: int, seed: int) -> ScrubResult:
    out = ScrubResult(ok=False, method="cuda")
    cu.check(cu.init(0), "cuInit")
    dev = ctypes.c_int(0)
    cu.check(cu.device_get(ctypes.byref(dev), device), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    cu.check(cu.ctx_create(ctypes.byref(ctx), 0, dev.value), "cuCtxCreate")
    chunks: list[tuple[int, int]] = []
    try:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        cu.check(cu.mem_info(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
        out.free_bytes, out.total_bytes = free.value, total.value
        want = free.value if max_bytes is None else min(free.value, max_bytes)
        size = min(chunk, want) if want else 0
        t0 = time.perf_counter()
        while size > 0 and out.bytes_zeroed < want:
            size = min(size, want - out.bytes_zeroed)
            ptr = ctypes.c_ulonglong(0)
            rc = cu.alloc(ctypes.byref(ptr), size)
            if rc == OOM:  # fragmentation or the driver's own reserve: smaller chunks take what is left
                if size <= MIN_CHUNK:
                    break
                size //= 2
                continue
            cu.check(rc, f"cuMemAlloc({size})")
            chunks.append((ptr.value, size))
            cu.check(cu.memset(ptr.value, 0, size), "cuMemsetD8")
            out.bytes_zeroed += size
        cu.check(cu.sync(), "cuCtxSynchronize")  # memsets are asynchronous: done only now
        out.truncated = max_bytes is not None and out.bytes_zeroed >= max_bytes
        t1 = time.perf_counter()
        rng = random.Random(seed)
        page = ctypes.create_string_buffer(SAMPLE)
        for ptr_value, size in chunks:
            for offset in _sample_offsets(size, rng):
                n = min(SAMPLE, size - offset)
                ctypes.memset(page, 0xA5, n)  # a stale host buffer must not pass for zeroed device memory
                cu.check(cu.dtoh(page, ptr_value + offset, n), "cuMemcpyDtoH")
                out.bytes_verified += n
                out.pages_sampled += 1
                data = page.raw[:n]
                out.pages_nonzero += data.count(0) != n
                if data.count(0) != n and len(out.mismatches) < 16:
                    first = next(i for i, b in enumerate(data) if b)
                    out.mismatches.append({"chunk": ptr_value, "offset": offset + first, "byte": data[first]})
        out.zero_ms = round((t1 - t0) * 1000, 3)
        out.verify_ms = round((time.perf_counter() - t1) * 1000, 3)
        out.chunks = len(chunks)
    finally:
        for ptr_value, _ in chunks:
            cu.free(ptr_value)
        cu.ctx_destroy(ctx)
    if not chunks:
        out.error = "the device allocated nothing"
    elif out.mismatches:
        out.error = f"{len(out.mismatches)} sample(s) not zero after cuMemsetD8"
    out.ok = bool(chunks) and not out.mismatches
    return out


def scrub_cuda(
    lib_dirs: tuple[str, ...] = (),
    device: int = 0,
    max_bytes: int | None = None,
    chunk: int = DEFAULT_CHUNK,
    timeout_s: float = 600.0,
    seed: int | None = None,
) -> ScrubResult:
    """Zero device `device`'s allocatable memory (or the first `max_bytes` of it) and verify samples."""
    loaded = load_library("libcuda.so.1", lib_dirs)
    if loaded.handle is None:
        return ScrubResult(ok=False, method="cuda", error=f"libcuda.so.1 not loadable: {loaded.error}")
    cu = _Cuda(loaded.handle)
    pick = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
    try:
        return call_with_deadline(lambda: _scrub_cuda(cu, device, max_bytes, chunk, pick), timeout_s)
    except CallTimeout as e:
        return ScrubResult(ok=False, method="cuda", error=f"scrub timed out: {e}")
    except (RuntimeError, OSError) as e:
        return ScrubResult(ok=False, method="cuda", error=str(e)[:500])
