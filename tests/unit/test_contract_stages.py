"""Stages 2, 3 and 5: scheduling (check_node), reservation (check_device), guest (check_guest)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cubeaccel.model.contract import Layer, NodeSummary, check_device, check_guest, check_node, freeze
from cubeaccel.model.device import AcceleratorClass
from cubeaccel.model.node_facts import HOTPLUG_PCIE_ROOT_PORT_ACPI, pinned_image
from cubeaccel.model.profiles import labels_for
from cubeaccel.protocol.reports import CudaInfo
from cubeaccel.wire.templates import parse_template
from tests.support.contract_builders import (
    EDU_FILE,
    device,
    edu,
    example_doc,
    good_edu_report,
    good_h100_report,
    h100,
    set_path,
    template,
)

H100_LABELS = labels_for(0x10DE, 0x2331)


def pairs(violations: list[Any]) -> list[tuple[Layer, str]]:
    return [(v.layer, v.code) for v in violations]


# --- reservation: check_device ----------------------------------------------------------------------------


def test_the_reserved_h100_matches_the_h100_contract() -> None:
    assert check_device(freeze(h100()), device()) == []
    assert check_device(h100(), device(), pinnable_memory_mib=65536) == []


@pytest.mark.parametrize(
    ("dev", "expected"),
    [
        (device(0x10DE, 0x20B2), (Layer.HOST_HARDWARE, "compat.device_not_supported")),
        (device(backend="emulated"), (Layer.BACKEND, "compat.device_backend_mismatch")),
        (device(accel_class=AcceleratorClass.ACCELERATOR), (Layer.HOST_HARDWARE, "compat.device_class_mismatch")),
        (
            device(labels={**H100_LABELS, "model": "H100-PCIe-64GB"}),
            (Layer.HOST_HARDWARE, "compat.device_label_mismatch"),
        ),
        (device(labels={**H100_LABELS, "memory_gib": "64"}), (Layer.HOST_HARDWARE, "compat.device_memory_too_small")),
    ],
    ids=["other-gpu", "other-backend", "other-class", "other-model-label", "less-memory"],
)
def test_a_device_that_no_longer_matches_is_refused_with_its_layer(dev: Any, expected: tuple[Layer, str]) -> None:
    violations = check_device(freeze(h100()), dev)
    assert pairs(violations) == [expected]


def test_a_device_refusal_names_what_was_expected_and_found() -> None:
    (v,) = check_device(freeze(h100()), device(0x10DE, 0x20B2))
    assert v.expected == "10de:2331 or 10de:2321"
    assert v.found == "10de:20b2 (A100-SXM4-80GB)"


def test_reservation_refuses_when_the_node_cannot_lock_the_guest_memory() -> None:
    (v,) = check_device(freeze(h100()), device(), pinnable_memory_mib=32768)
    assert (v.layer, v.code) == (Layer.PINNED_MEMORY, "compat.pinned_memory_insufficient")
    assert v.expected == "65536 MiB lockable" and v.found == "32768 MiB"


def test_the_edu_contract_accepts_the_emulated_edu_device() -> None:
    edu_dev = device(0x1234, 0x11E8, backend="emulated", accel_class=AcceleratorClass.ACCELERATOR)
    assert check_device(freeze(edu()), edu_dev, pinnable_memory_mib=1024) == []  # 256 MiB pinned fits


# --- scheduling: check_node -------------------------------------------------------------------------------


def node(**changes: Any) -> NodeSummary:
    fields: dict[str, Any] = {
        "backends": {"vfio", "emulated"},
        "devices": [H100_LABELS, labels_for(0x10DE, 0x20B2)],
        "pinnable_memory_mib": 200_000,
        "guest_images": (pinned_image(h100()), pinned_image(edu())),
        "hotplug": {HOTPLUG_PCIE_ROOT_PORT_ACPI},
        "name": "node-a",
    }
    fields.update(changes)
    return NodeSummary(**fields)


def test_a_node_with_a_free_h100_can_host_the_template() -> None:
    assert check_node(h100(), node()) == []
    assert check_node(freeze(h100()), node()) == []


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"backends": {"emulated"}}, (Layer.BACKEND, "compat.node_backend_unavailable")),
        ({"devices": [labels_for(0x10DE, 0x20B2)]}, (Layer.HOST_HARDWARE, "compat.node_no_matching_device")),
        ({"devices": []}, (Layer.HOST_HARDWARE, "compat.node_no_matching_device")),
        ({"pinnable_memory_mib": 1024}, (Layer.PINNED_MEMORY, "compat.node_pinned_memory_insufficient")),
        ({"hotplug": set()}, (Layer.BACKEND, "compat.node_hotplug_unsupported")),
        (
            {"guest_images": (replace(pinned_image(h100()), kernel_release="6.1.0-58-amd64"),)},
            (Layer.GUEST_KERNEL, "compat.node_guest_kernel_unavailable"),
        ),
        (
            {"guest_images": (replace(pinned_image(h100()), kernel_digests=("sha256:" + "4" * 64,)),)},
            (Layer.GUEST_KERNEL, "compat.node_guest_kernel_unavailable"),
        ),
        (
            {"guest_images": (replace(pinned_image(h100()), digest="sha256:" + "3" * 64),)},
            (Layer.TEMPLATE, "compat.node_guest_image_unavailable"),
        ),
        (
            {"guest_images": (replace(pinned_image(h100()), modules_img_digest="sha256:" + "3" * 64),)},
            (Layer.MODULES_IMG, "compat.node_modules_img_unavailable"),
        ),
    ],
)
def test_a_node_is_rejected_with_one_reason_per_missing_piece(
    changes: dict[str, Any], expected: tuple[Layer, str]
) -> None:
    assert pairs(check_node(h100(), node(**changes))) == [expected]


def test_a_node_with_no_guest_images_hosts_no_template_and_says_so() -> None:
    kernel, image = check_node(h100(), node(guest_images=()))
    assert (kernel.layer, kernel.found) == (Layer.GUEST_KERNEL, "no guest images")
    assert kernel.expected == f"6.1.0-57-amd64 ({h100().guest_kernel.digest})"
    assert (image.layer, image.found) == (Layer.TEMPLATE, "no guest images")


def test_node_rejection_lists_the_models_it_has() -> None:
    (v,) = check_node(h100(), node(devices=[labels_for(0x10DE, 0x20B2), labels_for(0x10DE, 0x1EB8)]))
    assert v.found == "A100-SXM4-80GB, T4-16GB"
    assert "10de:2331" in v.expected and "model=H100-PCIe-80GB" in v.expected


def test_a_free_device_labelled_for_another_backend_does_not_count() -> None:
    (v,) = check_node(h100(), node(devices=[{**H100_LABELS, "backend": "emulated"}]))
    assert v.code == "compat.node_no_matching_device"


# --- guest: check_guest -----------------------------------------------------------------------------------


def test_a_healthy_h100_guest_passes() -> None:
    assert check_guest(freeze(h100()), good_h100_report()) == []


def test_a_healthy_edu_guest_passes() -> None:
    assert check_guest(freeze(edu()), good_edu_report()) == []


LIBS_OK = good_h100_report().libraries
CUDA_OK: dict[str, Any] = {"driver_version": 12020, "init_ok": True, "device_count": 1, "error": None}


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"kernel_release": "6.1.0-58-amd64"}, (Layer.GUEST_KERNEL, "compat.guest_kernel_mismatch")),
        (
            {"modules_loaded": ("nvidia",), "module_failures": {"nvidia-uvm": "modprobe: FATAL: Module not found"}},
            (Layer.MODULES_IMG, "compat.modules_img_module_failed"),
        ),
        ({"modules_loaded": ("nvidia",)}, (Layer.MODULES_IMG, "compat.modules_img_module_missing")),
        ({"modules_loaded": ("nvidia_uvm",)}, (Layer.KERNEL_DRIVER, "compat.kernel_driver_not_loaded")),
        ({"kernel_driver_version": "535.104.05"}, (Layer.KERNEL_DRIVER, "compat.kernel_driver_version_mismatch")),
        ({"kernel_driver_version": None}, (Layer.KERNEL_DRIVER, "compat.kernel_driver_version_mismatch")),
        (
            {"device_files": {"/dev/nvidiactl": True, "/dev/nvidia0": False, "/dev/nvidia-uvm": True}},
            (Layer.KERNEL_DRIVER, "compat.kernel_driver_device_file_missing"),
        ),
        ({"pci_devices": ()}, (Layer.HOST_HARDWARE, "compat.device_not_visible_in_guest")),
        (
            {"libraries": {**LIBS_OK, "libcuda.so.1": {"loaded": False, "version": None, "error": "not found"}}},
            (Layer.USERSPACE_DRIVER, "compat.userspace_driver_library_missing"),
        ),
        (
            {"libraries": {**LIBS_OK, "libnvidia-ml.so.1": {"loaded": True, "version": "550.90.07", "error": None}}},
            (Layer.USERSPACE_DRIVER, "compat.userspace_driver_version_mismatch"),
        ),
        ({"cuda": None}, (Layer.CUDA_RUNTIME, "compat.cuda_not_probed")),
        (
            {"cuda": {**CUDA_OK, "init_ok": False, "error": "CUDA_ERROR_NO_DEVICE"}},
            (Layer.CUDA_RUNTIME, "compat.cuda_init_failed"),
        ),
        ({"cuda": {**CUDA_OK, "driver_version": 12010}}, (Layer.CUDA_RUNTIME, "compat.cuda_driver_api_too_old")),
        ({"cuda": {**CUDA_OK, "driver_version": "banana"}}, (Layer.CUDA_RUNTIME, "compat.cuda_driver_api_invalid")),
        ({"cuda": {**CUDA_OK, "device_count": 0}}, (Layer.CUDA_RUNTIME, "compat.cuda_no_device")),
        # What a guest leaves out or fudges is not a pass (found by review):
        ({"cuda": {**CUDA_OK, "device_count": None}}, (Layer.CUDA_RUNTIME, "compat.cuda_no_device")),
        ({"cuda": {**CUDA_OK, "init_ok": "no"}}, (Layer.CUDA_RUNTIME, "compat.cuda_init_failed")),
        (
            {"libraries": {**LIBS_OK, "libcuda.so.1": {"loaded": True, "version": None, "error": None}}},
            (Layer.USERSPACE_DRIVER, "compat.userspace_driver_version_unknown"),
        ),
    ],
)
def test_a_guest_report_broken_in_one_layer_is_judged_in_that_layer(
    changes: dict[str, Any], expected: tuple[Layer, str]
) -> None:
    assert pairs(check_guest(freeze(h100()), good_h100_report(**changes))) == [expected]


def test_a_runtime_library_the_template_probes_for_and_the_guest_lacks_is_layer_cuda_runtime() -> None:
    t = parse_template(set_path(example_doc(), "spec.probes.libraries", ["libcudart.so.12"]))
    cudart = {"libcudart.so.12": {"loaded": False, "version": None, "error": "not found"}}
    report = good_h100_report(libraries={**LIBS_OK, **cudart})
    assert pairs(check_guest(freeze(t), report)) == [(Layer.CUDA_RUNTIME, "compat.cuda_runtime_library_missing")]


def test_a_driver_that_refused_its_device_is_one_kernel_driver_failure_in_the_kernels_words() -> None:
    """modules.img held it, built for this kernel; its init said no: what needs the driver is not judged again."""
    refusal = "modprobe: can't load module nvidia: No such device | kernel: NVRM: No NVIDIA GPU found."
    report = good_h100_report(
        modules_loaded=("virtio_console",),
        module_failures={"nvidia": "modprobe: can't load module nvidia: No such device"},
        driver_refusal=refusal,
        kernel_driver_version=None,
        device_files={},
        cuda={"driver_version": 12020, "init_ok": False, "device_count": None, "error": "cuInit not called"},
    )
    violations = check_guest(freeze(h100()), report)
    assert pairs(violations) == [(Layer.KERNEL_DRIVER, "compat.kernel_driver_load_failed")]
    assert "No NVIDIA GPU found" in violations[0].found
    too_old = replace(report, cuda=CudaInfo(driver_version=11080))
    assert pairs(check_guest(freeze(h100()), too_old))[-1] == (Layer.CUDA_RUNTIME, "compat.cuda_driver_api_too_old")


def test_a_failed_driver_module_is_reported_once_as_modules_img_with_the_error_text() -> None:
    report = good_h100_report(
        modules_loaded=(), module_failures={"nvidia": "Invalid module format"}, kernel_driver_version=None
    )
    violations = check_guest(freeze(h100()), report)
    assert pairs(violations)[:2] == [
        (Layer.MODULES_IMG, "compat.modules_img_module_failed"),
        (Layer.MODULES_IMG, "compat.modules_img_module_missing"),  # nvidia_uvm: not loaded, no error
    ]
    assert violations[0].found == "Invalid module format"
    assert (Layer.KERNEL_DRIVER, "compat.kernel_driver_not_loaded") not in pairs(violations)


def test_driver_api_may_be_reported_as_a_version_string() -> None:
    assert check_guest(h100(), good_h100_report(cuda={**CUDA_OK, "driver_version": "12.4"})) == []


def test_minor_version_contract_accepts_an_older_driver_api_of_the_same_major() -> None:
    t = template(
        spec__cuda={"version": "12.6", "compatibility": "minor_version"},
    )
    assert check_guest(t, good_h100_report(cuda={**CUDA_OK, "driver_version": 12040})) == []
    (v,) = check_guest(t, good_h100_report(cuda={**CUDA_OK, "driver_version": 11080}))
    assert v.code == "compat.cuda_driver_api_too_old" and v.expected == "driver API >= 12.0"


def test_with_the_reserved_device_the_guest_must_show_exactly_that_device() -> None:
    contract = freeze(h100())
    assert check_guest(contract, good_h100_report(), device=device()) == []
    other = good_h100_report(pci_devices=({"vendor_id": "10de", "device_id": "2321"},))
    (v,) = check_guest(contract, other, device=device())
    assert (v.layer, v.code, v.found) == (Layer.HOST_HARDWARE, "compat.device_not_visible_in_guest", "10de:2321")


def test_garbage_pci_entries_from_the_guest_are_ignored_not_fatal() -> None:
    report = good_edu_report(pci_devices=({"vendor_id": "zz"}, {}, {"vendor_id": "1234", "device_id": "11e8"}))
    assert check_guest(edu(), report) == []


def test_an_edu_guest_without_the_device_fails_in_host_hardware() -> None:
    (v,) = check_guest(template(EDU_FILE), good_edu_report(pci_devices=()))
    assert (v.layer, v.code, v.found) == (Layer.HOST_HARDWARE, "compat.device_not_visible_in_guest", "no PCI devices")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner, max_size=3),
    max_leaves=8,
)
report_fields = st.sampled_from(
    [
        "kernel_release",
        "modules_loaded",
        "module_failures",
        "pci_devices",
        "device_files",
        "kernel_driver_version",
        "libraries",
        "cuda",
    ]
)


@settings(max_examples=300, deadline=None)
@given(changes=st.dictionaries(report_fields, json_values, max_size=4))
def test_a_malformed_guest_report_yields_violations_never_a_crash(changes: dict[str, Any]) -> None:
    report = good_h100_report(**changes)  # the guest is untrusted: any JSON may arrive in any field
    violations = check_guest(freeze(h100()), report)
    assert all(v.code.startswith("compat.") and isinstance(v.layer, Layer) for v in violations)
