"""The VFIO lab guest (tests/lab/harness.py): built once per session, booted once per plan.

Skipped only where QEMU itself is missing, and then only without CUBEACCEL_REQUIRE_VM (CI sets it: fail).
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.lab.harness import QEMU, LabImage, build_lab_image


@pytest.fixture(scope="session")
def lab_image(tmp_path_factory: pytest.TempPathFactory) -> LabImage:
    if shutil.which(QEMU) is None:
        if os.environ.get("CUBEACCEL_REQUIRE_VM"):
            pytest.fail(f"{QEMU} missing but CUBEACCEL_REQUIRE_VM is set (CI must run the VM tests)")
        pytest.skip(f"{QEMU} missing: run scripts/install-system-deps.sh")
    return build_lab_image(tmp_path_factory.mktemp("lab"))
