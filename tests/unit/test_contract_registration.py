"""Stage 1 (registration): one broken template per layer, each producing exactly that layer and code."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from cubeaccel.model.compat_tables import (
    ARCHITECTURE_MIN_DRIVER,
    CUDA_MINOR_COMPAT_MIN_DRIVER,
    CUDA_TOOLKIT_MIN_DRIVER,
)
from cubeaccel.model.contract import Layer, check_template
from cubeaccel.model.template_spec import CudaSpec, KernelDriver
from cubeaccel.model.versions import CudaVersion, DriverVersion
from tests.support.contract_builders import EDU_FILE, H100_FILE, edu, h100, template

B200 = [{"vendor_id": "10de", "device_id": "2901", "labels": {"model": "B200-180GB"}}]
A100 = [{"vendor_id": "10de", "device_id": "20b2", "labels": {"model": "A100-SXM4-80GB"}}]

# (layer, code, edits to the shipped cuda12-h100 example)
ONE_PER_LAYER: list[tuple[Layer, str, dict[str, Any]]] = [
    (Layer.HOST_HARDWARE, "compat.host_hardware_none_listed", {"spec__accelerator__devices": []}),
    (Layer.BACKEND, "compat.backend_unknown", {"spec__accelerator__backend": "sriov"}),
    (Layer.TEMPLATE, "compat.template_image_digest_malformed", {"spec__guest__image__digest": "sha256:abc123"}),
    (Layer.GUEST_KERNEL, "compat.guest_kernel_digest_malformed", {"spec__guest__kernel__digest": "md5:0f0f"}),
    (
        Layer.MODULES_IMG,
        "compat.modules_img_kernel_mismatch",
        {"spec__guest__modules_img__kernel_version": "6.1.0-26-cloud-amd64"},
    ),
    (Layer.KERNEL_DRIVER, "compat.kernel_driver_arch_unsupported", {"spec__accelerator__devices": B200}),
    (Layer.USERSPACE_DRIVER, "compat.userspace_driver_mismatch", {"spec__driver__userspace__version": "550.54.14"}),
    (Layer.CUDA_RUNTIME, "compat.cuda_driver_too_old", {"spec__cuda__version": "12.6"}),
    (Layer.PINNED_MEMORY, "compat.pinned_memory_required", {"spec__memory__pinned": False}),
]


def test_the_shipped_examples_are_consistent() -> None:
    assert check_template(h100()) == []
    assert check_template(edu()) == []


def test_every_layer_has_a_broken_template_case() -> None:
    assert {layer for layer, _, _ in ONE_PER_LAYER} == set(Layer)


@pytest.mark.parametrize(("layer", "code", "edits"), ONE_PER_LAYER, ids=[c for _, c, _ in ONE_PER_LAYER])
def test_a_template_broken_in_one_layer_reports_exactly_that_layer(
    layer: Layer, code: str, edits: dict[str, Any]
) -> None:
    violations = check_template(template(H100_FILE, **edits))
    assert [(v.layer, v.code) for v in violations] == [(layer, code)]
    v = violations[0]
    assert v.expected and v.found and v.code.startswith("compat.")


def test_cuda_12_4_needs_the_driver_from_nvidias_table() -> None:
    cuda = {"version": "12.4", "compatibility": "toolkit"}
    ok = template(
        H100_FILE,
        spec__driver__kernel__version="550.54.14",
        spec__driver__userspace__version="550.54.14",
        spec__cuda=cuda,
    )
    assert check_template(ok) == []
    old = template(
        H100_FILE,
        spec__driver__kernel__version="535.104.05",
        spec__driver__userspace__version="535.104.05",
        spec__cuda=cuda,
    )
    (v,) = check_template(old)
    assert (v.layer, v.code) == (Layer.CUDA_RUNTIME, "compat.cuda_driver_too_old")
    assert "550.54.14" in v.expected and v.found == "535.104.05"
    assert "minor_version" in v.hint  # 535 would run CUDA 12.4 under minor-version compatibility


def test_minor_version_compatibility_accepts_an_older_driver_of_the_same_major() -> None:
    t = template(
        H100_FILE,
        spec__driver__kernel__version="535.104.05",
        spec__driver__userspace__version="535.104.05",
        spec__cuda={"version": "12.4", "compatibility": "minor_version"},
    )
    assert check_template(t) == []


def test_minor_version_compatibility_still_needs_the_majors_floor() -> None:
    t = template(
        H100_FILE,
        spec__accelerator__devices=A100,
        spec__driver__kernel__version="520.61.05",
        spec__driver__userspace__version="520.61.05",
        spec__cuda={"version": "12.4", "compatibility": "minor_version"},
    )
    (v,) = check_template(t)
    assert (v.layer, v.code) == (Layer.CUDA_RUNTIME, "compat.cuda_driver_too_old")
    assert "525.60.13" in v.expected


@pytest.mark.parametrize(("cuda", "driver"), sorted(CUDA_TOOLKIT_MIN_DRIVER.items()))
def test_each_toolkit_row_passes_at_its_minimum_driver(cuda: tuple[int, int, int], driver: str) -> None:
    version = str(CudaVersion(*cuda))
    t = template(
        H100_FILE,
        spec__accelerator__devices=A100,  # ampere: supported by every driver in the table
        spec__driver__kernel__version=driver,
        spec__driver__userspace__version=driver,
        spec__cuda__version=version,
    )
    assert check_template(t) == []


def test_tables_parse_and_minor_floors_are_below_every_toolkit_minimum_of_their_major() -> None:
    for (major, _, _), driver in CUDA_TOOLKIT_MIN_DRIVER.items():
        floor = CUDA_MINOR_COMPAT_MIN_DRIVER.get(major)
        if floor is not None and major >= 12:
            assert DriverVersion.parse(driver) >= DriverVersion.parse(floor)
    for support in ARCHITECTURE_MIN_DRIVER.values():
        DriverVersion.parse(support.min_driver)


def test_blackwell_passes_with_a_570_driver_and_cuda_12_8() -> None:
    t = template(
        H100_FILE,
        spec__accelerator__devices=B200,
        spec__driver__kernel__version="570.124.06",
        spec__driver__userspace__version="570.124.06",
        spec__cuda__version="12.8",
    )
    assert check_template(t) == []


@pytest.mark.parametrize(
    ("edits", "expected"),
    [
        ({"spec__cuda__version": "12.7"}, [(Layer.CUDA_RUNTIME, "compat.cuda_unknown_version")]),
        ({"spec__cuda__version": "twelve"}, [(Layer.CUDA_RUNTIME, "compat.cuda_invalid_version")]),
        ({"metadata__name": "Bad_Name"}, [(Layer.TEMPLATE, "compat.template_invalid_name")]),
        ({"spec__accelerator__class": "fpga"}, [(Layer.TEMPLATE, "compat.template_unknown_class")]),
        ({"spec__probes__device_files": ["/etc/passwd"]}, [(Layer.TEMPLATE, "compat.template_probe_invalid")]),
        ({"spec__probes__libraries": ["../libevil.so"]}, [(Layer.TEMPLATE, "compat.template_probe_invalid")]),
        ({"spec__memory__size_mib": 0}, [(Layer.PINNED_MEMORY, "compat.pinned_memory_size_invalid")]),
        (
            {"spec__guest__modules_img__digest": "sha256:" + "A" * 64},
            [(Layer.MODULES_IMG, "compat.modules_img_digest_malformed")],
        ),
        (
            {
                "spec__guest__kernel__version": "linux-latest",
                "spec__guest__modules_img__kernel_version": "linux-latest",
            },
            [(Layer.GUEST_KERNEL, "compat.guest_kernel_invalid_version")],
        ),
        (
            {"spec__driver__kernel__version": "R550", "spec__driver__userspace__version": "R550"},
            [
                (Layer.KERNEL_DRIVER, "compat.kernel_driver_invalid_version"),
                (Layer.USERSPACE_DRIVER, "compat.userspace_driver_invalid_version"),
            ],
        ),
        (
            {"spec__driver": None},
            [
                (Layer.KERNEL_DRIVER, "compat.kernel_driver_missing"),
                (Layer.USERSPACE_DRIVER, "compat.userspace_driver_missing"),
            ],
        ),
        (
            {"spec__driver__userspace__libraries": ["libcuda.so.1", "cuda"]},
            [(Layer.USERSPACE_DRIVER, "compat.userspace_driver_invalid_library")],
        ),
    ],
)
def test_other_registration_codes(edits: dict[str, Any], expected: list[tuple[Layer, str]]) -> None:
    assert [(v.layer, v.code) for v in check_template(template(H100_FILE, **edits))] == expected


def test_cuda_on_a_device_without_cuda_is_a_host_hardware_violation() -> None:
    t = template(EDU_FILE, spec__cuda={"version": "12.4"})
    codes = [(v.layer, v.code) for v in check_template(t)]
    assert (Layer.HOST_HARDWARE, "compat.host_hardware_not_cuda_capable") in codes


def test_an_emulated_device_may_be_hot_plugged_without_pinning() -> None:
    assert check_template(template(EDU_FILE, spec__memory__pinned=False, spec__hotplug=True)) == []


def test_a_cold_plug_template_is_refused_at_registration_with_layer_backend() -> None:
    """hotplug: false would mean devices on the VMM command line at start; nothing implements that."""
    (v,) = check_template(template(EDU_FILE, spec__hotplug=False))
    assert (v.layer, v.code, v.expected, v.found) == (
        Layer.BACKEND,
        "compat.coldplug_unsupported",
        "hotplug: true",
        "hotplug: false",
    )


def test_persistence_mode_needs_the_userspace_driver() -> None:
    (v,) = check_template(template(EDU_FILE, spec__guest__init={"persistence_mode": True}))
    assert (v.layer, v.code) == (Layer.USERSPACE_DRIVER, "compat.persistence_mode_needs_userspace_driver")
    assert check_template(template(H100_FILE, spec__guest__init={"persistence_mode": True})) == []


def test_codes_only_reachable_from_code_built_templates() -> None:
    t = dataclasses.replace(
        h100(),
        version="v 2",
        kernel_driver=KernelDriver("nvidia.ko", "535.309.01"),
        cuda=CudaSpec("12.4", "forward"),
    )
    assert [(v.layer, v.code) for v in check_template(t)] == [
        (Layer.TEMPLATE, "compat.template_invalid_version"),
        (Layer.KERNEL_DRIVER, "compat.kernel_driver_invalid_module"),
        (Layer.CUDA_RUNTIME, "compat.cuda_invalid_compatibility"),
    ]
