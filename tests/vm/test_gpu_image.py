"""The NVIDIA GPU image in a real MicroVM: cube-agent validates with the real driver, and without an NVIDIA GPU the
verdict stops exactly at `kernel_driver`, in the kernel's own words, with every layer below it checked and passed.

That is the boundary a real GPU crosses: the same image on a node with an H100/H200 passes it (docs/gpu-image.md).
The stand-in device takes the template's device entry so the PCI layer is judged too; nothing else is faked.
"""

from __future__ import annotations

import copy
from typing import Any

from cubeaccel.images.manifest import Manifest, pin_template_document
from cubeaccel.master.up import EXAMPLES
from cubeaccel.model.contract import freeze
from cubeaccel.wire.templates import loads_document, parse_template

GPU_GUEST_MIB = 1024  # the initrd (~310 MB: userland, libcuda, NVML, GSP firmware) and its unpacked rootfs


def stand_in_contract(image: Manifest) -> dict[str, Any]:
    """The shipped CUDA template, pinned to this run's image, admitting the stand-in device (edu) instead of an
    H100: the frozen contract Cubelet would hand the shim."""
    doc = loads_document((EXAMPLES / "cuda12-h100.yaml").read_text())
    assert isinstance(doc, dict)
    doc = pin_template_document(doc, image)
    device = copy.deepcopy(doc["spec"]["accelerator"]["devices"][0])
    device.update(vendor_id="1234", device_id="11e8")
    doc["spec"]["accelerator"]["devices"] = [device]
    doc["spec"]["memory"]["size_mib"] = GPU_GUEST_MIB
    return freeze(parse_template(doc)).to_json()


def test_gpu_image_carries_the_driver_stack_it_records(gpu_image: Manifest) -> None:
    vendor = gpu_image.vendor
    assert vendor is not None and vendor.stack == "nvidia"
    assert vendor.modules == ("nvidia", "nvidia_uvm")
    assert {"nvidia", "nvidia_uvm"} <= set(gpu_image.modules)  # in modules.img, with their kernel dependencies
    assert vendor.versions["cuda_driver_api"].startswith("12.")  # read from libcuda itself at build time
    names = {p["name"]: p["version"] for p in vendor.packages}
    assert names["libcuda1"].startswith(vendor.driver_version + "-")
    assert names["nvidia-kernel-dkms"].startswith(vendor.driver_version + "-")
    assert names[f"linux-headers-{gpu_image.kernel_release}"] == gpu_image.kernel_package_version
    assert not gpu_image.verify()


def test_cuda_image_validation_stops_exactly_at_the_kernel_driver(shim_factory: Any, gpu_image: Manifest) -> None:
    vendor = gpu_image.vendor
    assert vendor is not None
    run = shim_factory(
        start="cold", contract=stand_in_contract(gpu_image), image=gpu_image, memory_mib=GPU_GUEST_MIB
    ).start()
    failed = run.wait_for("guest_validation_failed", timeout_s=240)["details"]
    assert failed["failed_layers"] == ["kernel_driver"], failed
    probes = {p["name"]: p for p in failed["report"]["probes"]}
    passed = {name for name, p in probes.items() if p["ok"]}
    # every layer below the driver: the kernel, modules.img's build of the driver, the device, the libraries
    assert {"guest_kernel", "module_build:nvidia", "pci", "library:libcuda.so.1", "library:libnvidia-ml.so.1"} <= passed
    assert probes["module_build:nvidia"]["found"] == gpu_image.kernel_release  # vermagic = the running kernel
    assert probes["module_build:nvidia_uvm"]["ok"]
    assert probes["library:libcuda.so.1"]["found"] == vendor.driver_version
    assert probes["library:libnvidia-ml.so.1"]["found"] == vendor.driver_version
    assert probes["cuda:driver_version"]["found"] == vendor.versions["cuda_driver_api"]  # no device needed
    assert "cuda:init" not in probes and "nvml" not in probes  # they would only restate the driver's failure
    assert probes["modprobe:nvidia_uvm"]["layer"] == "kernel_driver"  # needs nvidia: not attempted
    refused = probes["modprobe:nvidia"]
    assert not refused["ok"] and refused["layer"] == "kernel_driver"
    assert refused["code"] == "compat.kernel_driver_load_failed"
    assert "NVRM: No NVIDIA GPU found" in refused["detail"], refused  # the driver's own words, from the kernel log
    assert [v["code"] for v in failed["violations"]] == ["compat.kernel_driver_load_failed"]
    assert failed["report"]["driver_refusal"] == refused["detail"]
    assert failed["report"]["module_failures"].keys() == {"nvidia"}
    run.wait_for("shim_exiting")
    assert run.proc is not None and run.proc.wait(60) == 1
