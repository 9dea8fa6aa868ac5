"""The real scrub runner's answer to "can this node boot the scrub image of this stack?" over a temporary image
cache: missing (never built, or built by another release's agent), mismatched (a file no longer matches the digest
its manifest pins), or present and intact; each image hashed once per change of its files, across restarts too."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from cubeaccel.backends.base import AttachSpec
from cubeaccel.backends.scrub_methods import CUDA, EDU_REGISTERS, VMM_EXIT
from cubeaccel.cli import app
from cubeaccel.cubelet.scrub import IMAGE_UNAVAILABLE, ProcessScrubRunner
from cubeaccel.images.builder import agent_digest
from cubeaccel.images.manifest import Artifact, Manifest
from cubeaccel.images.scrub_image import MISMATCH, MISSING
from cubeaccel.images.vendor import VendorBuild
from tests.support.cubelet_harness import Node
from tests.support.fake_sysfs import Dev, FakeSysfs

FILES = ("vmlinux", "modules.img", "rootfs.cpio", "initrd.img")


def _image(cache: Path, name: str, agent: str, stack: str = "") -> Manifest:
    """A built image whose files are real and match the digests its manifest pins."""
    d = cache / "images" / name
    d.mkdir(parents=True)
    arts = []
    for f in FILES:
        (d / f).write_bytes(f"{name}/{f}".encode())
        arts.append(Artifact(f, "sha256:" + hashlib.sha256(f"{name}/{f}".encode()).hexdigest()))
    vendor = None
    if stack:
        vendor = VendorBuild(stack, "nvidia", "535.247.01", ("nvidia",), "nvidia", (), {}, {})
    m = Manifest(
        key=name, kernel_package="linux-image-6.1.0-57-amd64", kernel_package_version="6.1.192-3",
        kernel_release="6.1.0-57-amd64", vmlinuz_sha256="", vmlinux=arts[0], modules_img=arts[1], modules=(),
        rootfs=arts[2], initrd=arts[3], packages=(), agent_sha256=agent, cmdline="", directory=d, vendor=vendor,
    )  # fmt: skip
    m.save()
    return m


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CUBEACCEL_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "state").mkdir()
    return tmp_path / "cache"


def test_no_gpu_image_built_is_missing_and_names_the_build(cache: Path, tmp_path: Path) -> None:
    runner = ProcessScrubRunner(tmp_path / "state")
    _image(cache, "cpu", agent_digest())  # a CPU-only image does not scrub a GPU
    p = runner.image_problem(CUDA)
    assert p is not None and (p.code, p.held, p.hard) == (MISSING, True, False)
    assert "`cubeaccel image build --vendor nvidia`" in p.message
    assert runner.image_problem(EDU_REGISTERS) is None  # the CPU-only image is there for edu
    assert runner.image_problem(VMM_EXIT) is None  # boots no VM: needs no image


def test_an_image_built_by_the_release_before_an_upgrade_is_missing(cache: Path, tmp_path: Path) -> None:
    _image(cache, "nvidia-old", "sha256:" + "0" * 64, stack="nvidia")
    p = ProcessScrubRunner(tmp_path / "state").image_problem(CUDA)
    assert p is not None and p.code == MISSING and "built by another release: rebuild after an upgrade" in p.message


def test_a_file_that_no_longer_matches_its_pinned_digest_is_a_mismatch(cache: Path, tmp_path: Path) -> None:
    m = _image(cache, "nvidia", agent_digest(), stack="nvidia")
    runner = ProcessScrubRunner(tmp_path / "state")
    assert runner.image_problem(CUDA) is None
    (m.directory / "rootfs.cpio").write_bytes(b"not what was built")
    p = runner.image_problem(CUDA)
    assert p is not None and p.code == MISMATCH and "rootfs.cpio" in p.message and m.image_digest in p.message


def test_a_scrub_without_a_usable_image_starts_nothing_and_is_retried_later(
    cache: Path, tmp_path: Path, node: Node
) -> None:
    runner = ProcessScrubRunner(tmp_path / "state")
    d = node.device("vfio-0000:10:00.0")
    out = runner.run(d, AttachSpec("vfio-pci", {"host": "0000:10:00.0"}), 5.0)
    assert (out.ok, out.reason, out.details["image_problem"]) == (False, IMAGE_UNAVAILABLE, MISSING)
    shims = tmp_path / "state" / "shims"
    assert not shims.exists() or not any(shims.iterdir())


def test_an_image_is_hashed_once_per_change_and_not_again_after_a_restart(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = _image(cache, "nvidia", agent_digest(), stack="nvidia")
    hashed: list[str] = []
    verify = Manifest.verify

    def counted(self: Manifest) -> list[str]:
        hashed.append(self.key)
        return verify(self)

    monkeypatch.setattr(Manifest, "verify", counted)
    runner = ProcessScrubRunner(tmp_path / "state")
    for _ in range(3):
        assert runner.image_problem(CUDA) is None
    assert hashed == ["nvidia"]
    again = ProcessScrubRunner(tmp_path / "state")  # a restarted Cubelet: the memo is in its state directory
    assert again.image_problem(CUDA) is None and hashed == ["nvidia"]
    (m.directory / "initrd.img").write_bytes(b"changed")
    assert again.image_problem(CUDA) is not None and hashed == ["nvidia", "nvidia"]


def _host_check(fake: FakeSysfs) -> tuple[int, dict[str, Any]]:
    args = ["host", "check", "--json", "--sysfs-root", str(fake.sys), "--dev-root", str(fake.dev)]
    result = CliRunner().invoke(app, [*args, "--proc-root", str(fake.proc)])
    return result.exit_code, json.loads(result.output)


def test_host_check_names_a_missing_gpu_scrub_image_and_the_one_it_finds(cache: Path, tmp_path: Path) -> None:
    fake = FakeSysfs.build(tmp_path / "fake", [Dev(f"0000:{0x18 + i:02x}:00.0", iommu_group=10 + i) for i in range(2)])
    code, report = _host_check(fake)
    line = next(c for c in report["checks"] if c["name"] == "scrub_image_nvidia")
    assert (line["status"], line["code"]) == ("warn", MISSING) and "2 device(s) (10de:2331)" in line["reason"]
    assert code == 0 and report["ready"] is True  # the host passes devices through; the Cubelet holds these
    assert report["facts"]["scrub_images"] == {"nvidia": None}
    m = _image(cache, "nvidia", agent_digest(), stack="nvidia")
    code, report = _host_check(fake)
    line = next(c for c in report["checks"] if c["name"] == "scrub_image_nvidia")
    assert (line["status"], line["code"]) == ("pass", "") and report["facts"]["scrub_images"] == {
        "nvidia": m.image_digest
    }
