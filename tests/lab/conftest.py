"""The VFIO lab guest (tests/lab/harness.py): built once per session, booted once per plan.

Skipped only where QEMU itself is missing, and then only without CUBEACCEL_REQUIRE_VM (CI sets it: fail).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.lab.harness import QEMU, LabImage, LabParts, build_lab_image, lab_parts


def _require_qemu() -> None:
    if shutil.which(QEMU) is None:
        if os.environ.get("CUBEACCEL_REQUIRE_VM"):
            pytest.fail(f"{QEMU} missing but CUBEACCEL_REQUIRE_VM is set (CI must run the VM tests)")
        pytest.skip(f"{QEMU} missing: run scripts/install-system-deps.sh")


@pytest.fixture(scope="session")
def lab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lab")


@pytest.fixture(scope="session")
def lab_base(lab_dir: Path) -> LabParts:
    _require_qemu()
    return lab_parts(lab_dir)


@pytest.fixture(scope="session")
def lab_image(lab_dir: Path, lab_base: LabParts) -> LabImage:
    return build_lab_image(lab_dir, parts=lab_base)


@pytest.fixture(scope="session")
def lab_vmm_image(lab_dir: Path, lab_base: LabParts) -> LabImage:
    """The lab image plus QEMU and the Cubelet's closure (~95 MB initrd)."""
    return build_lab_image(lab_dir, with_qemu=True, parts=lab_base)
