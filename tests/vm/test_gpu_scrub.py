"""NVIDIA's `cuda` scrub, run for real: the scrub VM boots the NVIDIA guest image (its driver, libcuda) through the
Cubelet's own scrub runner and the shim's scrub mode, and the agent's `cuda` method runs.

Without an NVIDIA GPU it cannot zero anything, so what this pins is where it stops and how it says so: the image's
driver modules are loaded first and refuse in the kernel's own words ("NVRM: No NVIDIA GPU found"), the scrub
fails (never a pass), the outcome is a scrub failure (quarantine, not a VM that did not boot), and the evidence
names the method and the GPU image's digest. On a node with a GPU the same path zeroes its memory
(docs/scrub.md; `cube-agent scrub --cuda --max-bytes` on a lent GPU machine).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from cubeaccel.backends.emulated import EmulatedBackend
from cubeaccel.backends.scrub_methods import CUDA
from cubeaccel.cubelet import scrub as scrub_module
from cubeaccel.cubelet.scrub import VM_NOT_STARTED, ProcessScrubRunner
from cubeaccel.images.manifest import Manifest
from cubeaccel.model.device import DeviceRecord
from cubeaccel.model.states import DeviceState

pytestmark = pytest.mark.vm


def _device(backend: EmulatedBackend) -> DeviceRecord:
    found = backend.discover()[0]
    return DeviceRecord(
        id=backend.device_id(0),
        address=found.address,
        identity=found.identity,
        accel_class=found.accel_class,
        backend=backend.name,
        numa_node=0,
        iommu_group=None,
        expected_driver=None,
        labels=found.labels,
        state=DeviceState.RELEASED,
        generation=1,
        reason="release.scrub_pending",
        sandbox_id="tenant-a",
        updated_at=0.0,
    )


def test_the_cuda_scrub_boots_the_gpu_image_and_stops_at_the_missing_gpu(
    tmp_path: Path, gpu_image: Manifest, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = EmulatedBackend(f"gs{uuid.uuid4().hex[:8]}", slots=1)
    device = _device(backend)
    # the stand-in takes the NVIDIA class's method: what the registry gives a 10de GPU (backends/scrub_methods.py)
    monkeypatch.setattr(scrub_module, "scrub_method", lambda _d: CUDA)
    runner = ProcessScrubRunner(tmp_path / "state", start_mode="cold")
    outcome = runner.run(device, backend.attach_spec(device), timeout_s=600)
    details = outcome.details
    assert not outcome.ok and outcome.reason != VM_NOT_STARTED, (outcome, details)
    assert details["image_digest"] == gpu_image.image_digest  # the GPU image, not the CPU one
    agent = details["agent"]
    assert agent["method"] == "cuda" and agent["ok"] is False and agent["bytes_zeroed"] == 0
    assert "NVRM: No NVIDIA GPU found" in agent["error"], agent
