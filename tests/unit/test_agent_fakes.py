"""Fakes for cube-agent tests, at the agent's own boundary: a guest root on disk and driver .so files.

A fake guest root is a temp dir laid out like /proc, /sys and /dev; the driver libraries are real shared
objects compiled with gcc at test time, so the agent's real ctypes loading code runs against them. Their
behaviour is steered by FAKE_* environment variables read at call time.

The tests in this module check the fakes themselves, so a broken fake fails here and not as a puzzling
agent failure elsewhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

EDU = ("1234", "11e8")
DRIVER_VERSION = "550.54.15"

LIBCUDA_C = r"""
#include <stdlib.h>
#include <unistd.h>
static int env_int(const char *k, int d) { const char *v = getenv(k); return v ? atoi(v) : d; }
int cuDriverGetVersion(int *v) { *v = env_int("FAKE_CUDA_VERSION", 12040); return env_int("FAKE_CUDA_VERSION_RC", 0); }
int cuInit(unsigned int flags) {
    int hang = env_int("FAKE_CUDA_INIT_HANG_MS", 0);
    if (hang) usleep(hang * 1000);
    return flags ? 1 : env_int("FAKE_CUDA_INIT_RC", 0);
}
int cuDeviceGetCount(int *n) { *n = env_int("FAKE_CUDA_COUNT", 1); return 0; }
"""

LIBNVML_C = r"""
#include <stdio.h>
#include <stdlib.h>
typedef struct { unsigned long long total, free, used; } mem_t;
static int env_int(const char *k, int d) { const char *v = getenv(k); return v ? atoi(v) : d; }
static int read_mode(void) {
    const char *p = getenv("FAKE_NVML_STATE"); int m = 0; FILE *f;
    if (p && (f = fopen(p, "r"))) { if (fscanf(f, "%d", &m) != 1) m = 0; fclose(f); }
    return m;
}
int nvmlInit_v2(void) { return env_int("FAKE_NVML_INIT_RC", 0); }
int nvmlShutdown(void) { return 0; }
int nvmlSystemGetDriverVersion(char *b, unsigned int n) {
    const char *v = getenv("FAKE_NVML_DRIVER"); snprintf(b, n, "%s", v ? v : "550.54.15"); return 0;
}
int nvmlDeviceGetCount_v2(unsigned int *n) { *n = env_int("FAKE_NVML_COUNT", 1); return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned int i, void **h) { *h = (void *)(long)(i + 1); return 0; }
int nvmlDeviceGetName(void *h, char *b, unsigned int n) { snprintf(b, n, "NVIDIA H100 80GB HBM3"); return 0; }
int nvmlDeviceGetMemoryInfo(void *h, mem_t *m) { m->total = 85520809984ULL; m->free = m->total; m->used = 0; return 0; }
int nvmlDeviceGetPersistenceMode(void *h, int *mode) { *mode = read_mode(); return 0; }
int nvmlDeviceSetPersistenceMode(void *h, int mode) {
    const char *p = getenv("FAKE_NVML_STATE"); FILE *f;
    if (!p || !(f = fopen(p, "w"))) return 4;
    fprintf(f, "%d\n", mode); fclose(f); return 0;
}
"""


@dataclass
class FakeGuest:
    """A guest root directory; each method adds one fact the way the kernel would show it."""

    root: Path

    def __post_init__(self) -> None:
        for d in ("proc/sys/kernel/random", "proc/driver", "sys/bus/pci/devices", "sys/module", "dev"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        (self.root / "proc/modules").touch()
        self.kernel("6.1.0-27-amd64")
        (self.root / "proc/sys/kernel/random/boot_id").write_text("0f6a3c3e-1111-2222-3333-444455556666\n")

    def kernel(self, release: str) -> FakeGuest:
        (self.root / "proc/sys/kernel/osrelease").write_text(release + "\n")
        return self

    def module(self, name: str) -> FakeGuest:
        with (self.root / "proc/modules").open("a") as f:
            f.write(f"{name} 16384 0 - Live 0xffffffffc0000000\n")
        (self.root / "sys/module" / name).mkdir(exist_ok=True)
        return self

    def pci(self, address: str, vendor: str, device: str, cls: str = "0x00ff00") -> FakeGuest:
        """The function appears whole, as the kernel's sysfs shows a new device: built aside, then renamed into
        place (a hot-plug waiter polling the directory must never see it without its class)."""
        devices = self.root / "sys/bus/pci/devices"
        devices.mkdir(parents=True, exist_ok=True)
        staging = devices.parent / f".new-{address}"
        staging.mkdir()
        for name, value in (("vendor", f"0x{vendor}"), ("device", f"0x{device}"), ("class", cls)):
            (staging / name).write_text(value + "\n")
        staging.rename(devices / address)
        return self

    def dev(self, *paths: str) -> FakeGuest:
        for p in paths:
            target = self.root / p.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()
        return self

    def nvidia_driver(self, version: str = DRIVER_VERSION) -> FakeGuest:
        self.module("nvidia")
        (self.root / "sys/module/nvidia/version").write_text(version + "\n")
        (self.root / "proc/driver/nvidia").mkdir(parents=True, exist_ok=True)
        (self.root / "proc/driver/nvidia/version").write_text(
            f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {version}  Thu Feb 22 01:44:30 UTC 2024\n"
            "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
        )
        return self

    def modprobe(self, failing: dict[str, str] | None = None) -> str:
        """A modprobe stand-in: appends to proc/modules like the kernel would, or fails with modprobe's text."""
        script = self.root / "modprobe.sh"
        cases = "".join(f'  {m}) echo "{msg}" >&2; exit 1;;\n' for m, msg in (failing or {}).items())
        script.write_text(
            "#!/bin/sh\n"
            f'case "$1" in\n{cases}esac\n'
            f'name=$(echo "$1" | tr - _)\n'
            f'echo "$name 16384 0 - Live 0x0" >> "{self.root}/proc/modules"\n'
        )
        script.chmod(0o755)
        return str(script)


def compile_driver_libs(out: Path) -> Path:
    """libcuda.so.550.54.15 + libnvidia-ml.so.550.54.15 with the sonames and symlinks a driver install has."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is needed to build the fake driver libraries")
    out.mkdir(parents=True, exist_ok=True)
    for stem, source in (("libcuda", LIBCUDA_C), ("libnvidia-ml", LIBNVML_C)):
        c_file = out / f"{stem}.c"
        c_file.write_text(source)
        real = out / f"{stem}.so.{DRIVER_VERSION}"
        subprocess.run(
            [gcc, "-shared", "-fPIC", "-O1", f"-Wl,-soname,{stem}.so.1", "-o", str(real), str(c_file)],
            check=True,
            capture_output=True,
        )
        os.symlink(real.name, out / f"{stem}.so.1")
    return out


def test_fake_guest_lays_out_proc_sys_dev(tmp_path: Path) -> None:
    g = FakeGuest(tmp_path).module("virtio_pci").pci("0000:01:00.0", *EDU).dev("/dev/nvidia0")
    assert (tmp_path / "proc/modules").read_text().startswith("virtio_pci ")
    assert (tmp_path / "sys/bus/pci/devices/0000:01:00.0/vendor").read_text() == "0x1234\n"
    assert (tmp_path / "dev/nvidia0").exists()
    assert g.root == tmp_path


def test_fake_modprobe_loads_or_fails_like_modprobe(tmp_path: Path) -> None:
    g = FakeGuest(tmp_path)
    script = g.modprobe({"nvidia": "modprobe: FATAL: Module nvidia not found"})
    assert subprocess.run([script, "nvidia-uvm"], check=False).returncode == 0
    failed = subprocess.run([script, "nvidia"], capture_output=True, check=False)
    assert failed.returncode == 1 and b"not found" in failed.stderr
    assert "nvidia_uvm 16384" in (tmp_path / "proc/modules").read_text()


def test_fake_driver_libraries_compile_with_driver_sonames(tmp_path: Path) -> None:
    libs = compile_driver_libs(tmp_path / "lib")
    assert os.readlink(libs / "libcuda.so.1") == f"libcuda.so.{DRIVER_VERSION}"
    assert (libs / f"libnvidia-ml.so.{DRIVER_VERSION}").stat().st_size > 0
