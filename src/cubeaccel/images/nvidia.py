"""NVIDIA's guest stack from Debian's own packages: the kernel modules (DKMS), GSP firmware, libcuda, NVML,
nvidia-smi and nvidia-persistenced, all at one driver version.

Why this build: bookworm's open modules (`nvidia-open-kernel-dkms` 535.261.03, contrib) no longer compile against
bookworm's own kernel (6.1.0-57, 6.1.192: `pci_resize_resource` gained an argument; measured here), and the
security update 535.309.01 exists only for the proprietary modules, whose user space it also updates. So the stack
is `nvidia-kernel-dkms` 535.309.01 (non-free; H100/H200 supported, GSP firmware used on Hopper), with every
user-space package at that version. `module_source_package` is the one line an open-module build changes once
Debian carries a version that compiles. Only `nvidia` and `nvidia-uvm` are built (compute needs no modeset or
DRM), which also halves the compile. Debian installs the libraries under `nvidia/current/` and leaves their
SONAME links to update-alternatives, which never runs in an image build: the links are made here.
"""

from __future__ import annotations

from cubeaccel.images.vendor import VendorStack

DRIVER_VERSION = "535.309.01"
_LIB = "usr/lib/x86_64-linux-gnu"
_CUR = f"{_LIB}/nvidia/current"

NVIDIA = VendorStack(
    name="nvidia",
    vendor="nvidia",
    driver_version=DRIVER_VERSION,
    components=("main", "contrib", "non-free", "non-free-firmware"),
    module_source_package="nvidia-kernel-dkms",
    module_source_glob="usr/src/nvidia-current-[0-9]*",
    make_args=("NV_KERNEL_MODULES=nvidia nvidia-uvm",),
    modules=("nvidia", "nvidia_uvm"),
    driver_module="nvidia",
    versioned_packages=(
        "firmware-nvidia-gsp",
        "libcuda1",
        "libnvidia-ptxjitcompiler1",
        "libnvidia-pkcs11-openssl3",
        "libnvidia-ml1",
        "libnvidia-cfg1",
        "nvidia-smi",
    ),
    other_packages=(
        "nvidia-modprobe",  # creates /dev/nvidia* for libcuda when no udev runs (a guest has none)
        "nvidia-persistenced",
        "libtirpc3",
        "libtirpc-common",
        "libgssapi-krb5-2",
        "libkrb5-3",
        "libk5crypto3",
        "libkrb5support0",
        "libcom-err2",
        "libkeyutils1",
    ),
    links=(
        (f"/{_LIB}/libcuda.so.1", f"{_CUR}/libcuda.so.{DRIVER_VERSION}"),
        (f"/{_LIB}/libcuda.so", f"{_CUR}/libcuda.so.{DRIVER_VERSION}"),
        (f"/{_LIB}/libnvidia-ptxjitcompiler.so.1", f"{_CUR}/libnvidia-ptxjitcompiler.so.{DRIVER_VERSION}"),
        (f"/{_LIB}/libnvidia-ml.so.1", f"{_CUR}/libnvidia-ml.so.{DRIVER_VERSION}"),
        (f"/{_LIB}/libnvidia-cfg.so.1", f"{_CUR}/libnvidia-cfg.so.{DRIVER_VERSION}"),
        ("/usr/bin/nvidia-smi", "usr/lib/nvidia/current/nvidia-smi"),
    ),
    drop=("usr/lib/nvidia/current/*.gz", "etc/init.d", "lib/systemd"),
    checked_elves=(
        f"{_CUR}/libcuda.so.{DRIVER_VERSION}",
        f"{_CUR}/libnvidia-ml.so.{DRIVER_VERSION}",
        "usr/lib/nvidia/current/nvidia-smi",
        "usr/bin/nvidia-persistenced",
        "usr/bin/nvidia-modprobe",
    ),
    # cuDriverGetVersion needs no GPU and no kernel module: the CUDA driver API this libcuda implements.
    version_script=(
        "import ctypes, json\n"
        "lib = ctypes.CDLL('libcuda.so.1')\n"
        "v = ctypes.c_int(0)\n"
        "rc = lib.cuDriverGetVersion(ctypes.byref(v))\n"
        "print(json.dumps({'cuda_driver_api': f'{v.value // 1000}.{v.value % 1000 // 10}'} if rc == 0 else {}))\n"
    ),
)
