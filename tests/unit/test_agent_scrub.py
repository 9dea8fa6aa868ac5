"""The scrub op against a fake libcuda with device memory (compiled with gcc at test time) and a fake BAR file.

The fake allocates host memory that starts out holding the "previous tenant's" bytes (0xAB), so a scrub that did not
zero, or zeroed only part, is visible in what cuMemcpyDtoH copies back; FAKE_* variables steer it at call time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cubeaccel.agent import scrub as agent_scrub
from cubeaccel.agent.probes import ProbeContext
from cubeaccel.agent.protocol import Agent
from cubeaccel.agent.scrub import (
    EDU_REGISTERS,
    MiB,
    Register,
    fill_canary,
    read_bar,
    scan_canary,
    scrub_bar,
    scrub_bar_memory,
    scrub_cuda,
)

LIBCUDA_MEM_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
typedef unsigned long long u64;
static u64 env_u64(const char *k, u64 d) { const char *v = getenv(k); return v ? strtoull(v, 0, 10) : d; }
static u64 used;
static void note(const char *what, u64 n) {
    const char *p = getenv("FAKE_CUDA_LOG"); if (!p) return;
    FILE *f = fopen(p, "a"); if (f) { fprintf(f, "%s %llu\n", what, n); fclose(f); }
}
int cuInit(unsigned int flags) { return (int)env_u64("FAKE_CUDA_INIT_RC", 0); }
int cuDeviceGet(int *d, int i) { *d = i; return i < 1 ? 0 : 101; }
int cuCtxCreate_v2(void **c, unsigned int f, int d) { *c = (void *)0x1; note("ctx_create", 0); return 0; }
int cuCtxDestroy_v2(void *c) { note("ctx_destroy", 0); return 0; }
int cuCtxSynchronize(void) { note("sync", 0); return 0; }
int cuMemGetInfo_v2(size_t *free_, size_t *total) {
    *total = env_u64("FAKE_MEM_TOTAL", 64ull << 20);
    *free_ = env_u64("FAKE_MEM_FREE", *total) - used;
    return 0;
}
int cuMemAlloc_v2(u64 *p, size_t n) {
    /* what the driver really hands out: less than cuMemGetInfo says is free */
    u64 limit = env_u64("FAKE_MEM_ALLOCATABLE", env_u64("FAKE_MEM_FREE", env_u64("FAKE_MEM_TOTAL", 64ull << 20)));
    if (used + n > limit) return 2;
    unsigned char *m = malloc(n + 16); if (!m) return 2;
    *(u64 *)m = n;
    memset(m + 16, 0xAB, n);  /* the previous tenant's bytes */
    used += n; *p = (u64)(m + 16); note("alloc", n); return 0;
}
int cuMemFree_v2(u64 p) {
    unsigned char *m = (unsigned char *)p - 16;
    used -= *(u64 *)m; free(m); note("free", 0); return 0;
}
int cuMemsetD8_v2(u64 p, unsigned char v, size_t n) {
    memset((void *)p, v, n);
    if (getenv("FAKE_MEMSET_STUCK")) ((unsigned char *)p)[n - 1] = 0xAB;  /* a byte that does not clear */
    note("memset", n); return 0;
}
int cuMemcpyDtoH_v2(void *dst, u64 src, size_t n) { memcpy(dst, (void *)src, n); return 0; }
"""


@pytest.fixture(scope="module")
def libdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is needed to build the fake libcuda")
    out = tmp_path_factory.mktemp("cudamem")
    (out / "libcuda.c").write_text(LIBCUDA_MEM_C)
    real = out / "libcuda.so.550.54.15"
    subprocess.run(
        [gcc, "-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1", "-o", str(real), str(out / "libcuda.c")],
        check=True,
        capture_output=True,
    )
    os.symlink(real.name, out / "libcuda.so.1")
    return out


@pytest.fixture
def log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for key in [k for k in os.environ if k.startswith("FAKE_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("FAKE_CUDA_LOG", str(tmp_path / "cuda.log"))
    return tmp_path / "cuda.log"


def calls(log: Path, what: str) -> list[int]:
    return [int(n) for w, n in (line.split() for line in log.read_text().splitlines()) if w == what]


def test_every_allocatable_byte_is_zeroed_in_chunks_and_samples_read_back_zero(libdir: Path, log: Path) -> None:
    r = scrub_cuda((str(libdir),), chunk=16 * MiB, seed=1)
    assert r.ok, r
    assert (r.total_bytes, r.free_bytes, r.bytes_zeroed) == (64 * MiB, 64 * MiB, 64 * MiB)
    assert calls(log, "alloc") == [16 * MiB] * 4 and calls(log, "memset") == calls(log, "alloc")
    assert r.chunks == 4 and r.bytes_verified >= 4 * 2 * 4096  # first and last page of every chunk at least
    assert calls(log, "sync") and len(calls(log, "free")) == 4 and calls(log, "ctx_destroy")
    assert not r.truncated and r.mismatches == []


def test_what_the_driver_refuses_is_taken_in_smaller_chunks(
    libdir: Path, log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MEM_ALLOCATABLE", str(60 * MiB))  # cuMemGetInfo says 64 free; the driver keeps 4
    r = scrub_cuda((str(libdir),), chunk=16 * MiB, seed=1)
    assert r.ok and r.bytes_zeroed == 60 * MiB, r
    assert calls(log, "alloc") == [16 * MiB] * 3 + [8 * MiB, 4 * MiB]


def test_max_bytes_bounds_the_scrub_for_measuring_on_a_real_gpu(libdir: Path, log: Path) -> None:
    r = scrub_cuda((str(libdir),), max_bytes=5 * MiB, chunk=4 * MiB, seed=1)
    assert r.ok and r.bytes_zeroed == 5 * MiB and r.truncated, r
    assert calls(log, "alloc") == [4 * MiB, 1 * MiB]


def test_a_byte_that_does_not_clear_fails_the_scrub(libdir: Path, log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_MEMSET_STUCK", "1")
    r = scrub_cuda((str(libdir),), chunk=16 * MiB, seed=1)
    assert not r.ok and r.error and "not zero" in r.error
    assert r.mismatches[0]["byte"] == 0xAB and r.mismatches[0]["offset"] == 16 * MiB - 1
    assert len(calls(log, "free")) == 4  # freed even when it failed


def test_driver_errors_fail_the_scrub_without_raising(libdir: Path, log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_CUDA_INIT_RC", "100")
    r = scrub_cuda((str(libdir),))
    assert not r.ok and r.error is not None and r.error.startswith("cuInit")


def test_cli_scrub_is_runnable_standalone_on_a_bounded_buffer(libdir: Path, log: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    cmd = [sys.executable, "-m", "cubeaccel.agent", "scrub", "--cuda", "--max-bytes", str(3 * MiB)]
    cmd += ["--chunk-mib", "2", "--lib-path", str(libdir)]
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    assert body["ok"] and body["bytes_zeroed"] == 3 * MiB and body["truncated"]
    assert body["zero_gib_per_s"] is None or body["zero_gib_per_s"] > 0


def fake_bar(tmp_path: Path, content: bytes = b"\xab" * 4096) -> Path:
    dev = tmp_path / "sys/bus/pci/devices/0000:01:00.0"
    dev.mkdir(parents=True)
    (dev / "resource0").write_bytes(content)
    (dev / "enable").write_text("0\n")
    return dev


PLAIN = (Register(0x80, 8, 0, 0, "a"), Register(0x88, 8, 0, 0, "b"), Register(0x10, 4, 0, 0, "c"))


def test_bar_registers_are_written_and_read_back(tmp_path: Path) -> None:
    dev = fake_bar(tmp_path)
    r = scrub_bar(dev, PLAIN)
    assert r.ok and r.bytes_zeroed == r.bytes_verified == 20, r
    assert read_bar(dev, PLAIN) == {"a": 0, "b": 0, "c": 0}
    assert (dev / "resource0").read_bytes()[0x80:0x90] == b"\0" * 16
    assert (dev / "enable").read_text() == "1"  # memory decoding turned on first


def test_a_register_that_does_not_read_back_fails(tmp_path: Path) -> None:
    """A plain file does not invert edu's liveness register the way the device does: exactly what a device whose
    register ignores writes looks like to the verify step."""
    r = scrub_bar(fake_bar(tmp_path), EDU_REGISTERS)
    assert not r.ok
    assert [m["register"] for m in r.mismatches] == ["liveness"]


def test_agent_scrub_request_checks_its_parameters(tmp_path: Path) -> None:
    fake_bar(tmp_path)
    agent = Agent(ctx=ProbeContext(root=tmp_path))
    bad = agent.handle_line(
        json.dumps({"id": 1, "method": "scrub", "params": {"method": "bar", "address": "../x"}}).encode()
    )
    assert bad is not None and bad["error"]["code"] == "agent.invalid_params"
    ok = agent.handle_line(
        json.dumps({"id": 2, "method": "scrub", "params": {"method": "bar", "address": "0000:01:00.0"}}).encode()
    )
    assert ok is not None and ok["ok"] and ok["result"]["method"] == "bar"
    assert [m["register"] for m in ok["result"]["mismatches"]] == ["liveness"]


# ---- bar-memory: the ivshmem-plain stand-in's memory BAR (resource2), all of it ----------------------------------
def fake_memory_bar(tmp_path: Path, size: int = 64 * 1024) -> Path:
    dev = tmp_path / "sys/bus/pci/devices/0000:02:00.0"
    dev.mkdir(parents=True)
    (dev / "resource2").write_bytes(bytes(size))
    (dev / "enable").write_text("0\n")
    return dev


def test_a_tenants_canaries_are_found_by_the_next_scan_and_gone_after_the_scrub(tmp_path: Path) -> None:
    dev = fake_memory_bar(tmp_path)
    assert fill_canary(dev, "tenant-a") == 64 * 1024
    found = scan_canary(dev)
    assert found["hits"] == 64 * 1024 // 32 and found["tags"] == {"tenant-a": 2048}  # the scan bites
    r = scrub_bar_memory(dev)
    assert r.ok and r.method == "bar-memory" and r.bytes_zeroed == r.bytes_verified == r.total_bytes == 64 * 1024
    assert r.pages_sampled == 16 and r.pages_nonzero == 0
    assert scan_canary(dev) == {"bytes_scanned": 64 * 1024, "hits": 0, "tags": {}, "nonzero": 0}
    assert (dev / "resource2").read_bytes() == bytes(64 * 1024)


def test_memory_that_does_not_take_the_zeros_fails_the_scrub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A BAR that ignores writes (here: the zeroing step does nothing) leaves the canaries: every page is read back,
    so the scrub fails and says how many pages were not zero."""
    dev = fake_memory_bar(tmp_path, 16 * 1024)
    fill_canary(dev, "tenant-a")
    monkeypatch.setattr(agent_scrub, "_zero", lambda buf, size: size)  # writes that do not land
    r = scrub_bar_memory(dev)
    assert not r.ok and r.pages_nonzero == 4 and "4 page(s) not zero" in (r.error or "")


def test_agent_scrub_bar_memory_request_checks_its_parameters(tmp_path: Path) -> None:
    fill_canary(fake_memory_bar(tmp_path), "t")
    agent = Agent(ctx=ProbeContext(root=tmp_path))
    bad = agent.handle_line(
        json.dumps(
            {"id": 1, "method": "scrub", "params": {"method": "bar-memory", "address": "0000:02:00.0", "resource": "x"}}
        ).encode()
    )
    assert bad is not None and bad["error"]["code"] == "agent.invalid_params"
    ok = agent.handle_line(
        json.dumps({"id": 2, "method": "scrub", "params": {"method": "bar-memory", "address": "0000:02:00.0"}}).encode()
    )
    assert ok is not None and ok["ok"] and ok["result"]["ok"] and ok["result"]["bytes_verified"] == 64 * 1024
