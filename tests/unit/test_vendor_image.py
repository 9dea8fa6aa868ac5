"""GPU image pieces that need no build: apt's answers, the vendor stack's rootfs links, pins and imports."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.images import packages, vendor
from cubeaccel.images.builder import stack_named
from cubeaccel.images.importer import import_image, mismatches
from cubeaccel.images.manifest import GUEST_PINS, VENDOR_PINS, Artifact, Manifest, pinned_paths, sha256_file
from cubeaccel.images.nvidia import NVIDIA
from cubeaccel.images.vendor import VendorBuild
from cubeaccel.master.up import EXAMPLES
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.templates import loads_document

POLICY = """libcuda1:
  Installed: (none)
  Candidate: 535.309.01-0+deb12u1
  Version table:
     535.309.01-0+deb12u1 500
        500 http://deb.debian.org/debian-security bookworm-security/non-free amd64 Packages
     535.261.03-1 500
        500 http://deb.debian.org/debian bookworm/non-free amd64 Packages
nvidia-smi:
  Installed: 535.261.03-1
  Candidate: 535.309.01-0+deb12u1
  Version table:
     535.309.01-0+deb12u1 500
        500 http://deb.debian.org/debian-security bookworm-security/non-free amd64 Packages
 *** 535.261.03-1 100
        100 /var/lib/dpkg/status
"""


def test_an_unknown_vendor_stack_is_refused_by_name_before_any_build() -> None:
    with pytest.raises(CubeError) as e:
        stack_named("amd")
    assert (e.value.code, e.value.status) == ("image.vendor_unknown", 422) and e.value.details["known"] == ["nvidia"]
    assert stack_named("nvidia") is NVIDIA and stack_named(None) is None


def test_apt_policy_gives_candidates_and_every_listed_version() -> None:
    candidates, table = packages.parse_policy(POLICY)
    assert candidates == {"libcuda1": "535.309.01-0+deb12u1", "nvidia-smi": "535.309.01-0+deb12u1"}
    assert table["libcuda1"] == ["535.309.01-0+deb12u1", "535.261.03-1"]
    assert table["nvidia-smi"] == ["535.309.01-0+deb12u1", "535.261.03-1"]  # the installed row too


@given(
    st.from_regex(r"[0-9]{1,3}(\.[0-9]{1,3}){1,3}", fullmatch=True),
    st.from_regex(r"[0-9]{1,2}(\+deb12u[0-9])?(~[a-z0-9]{1,4})?", fullmatch=True),
    st.sampled_from(["", "1:", "2:"]),
)
def test_upstream_version_drops_epoch_and_debian_revision(upstream: str, revision: str, epoch: str) -> None:
    assert packages.upstream_version(f"{epoch}{upstream}-{revision}") == upstream
    assert packages.upstream_version(upstream) == upstream


def test_the_stack_links_sonames_to_the_versioned_files_update_alternatives_would(tmp_path: Path) -> None:
    cur = tmp_path / "usr/lib/x86_64-linux-gnu/nvidia/current"
    cur.mkdir(parents=True)
    for lib in ("libcuda", "libnvidia-ptxjitcompiler", "libnvidia-ml", "libnvidia-cfg"):
        (cur / f"{lib}.so.{NVIDIA.driver_version}").write_bytes(b"\x7fELF")
    (tmp_path / "usr/lib/nvidia/current").mkdir(parents=True)
    (tmp_path / "usr/lib/nvidia/current/nvidia-smi").write_bytes(b"\x7fELF")
    (tmp_path / "usr/lib/nvidia/current/nvidia-smi.1.gz").write_bytes(b"man")
    vendor.install_rootfs(NVIDIA, tmp_path)
    link = tmp_path / "usr/lib/x86_64-linux-gnu/libcuda.so.1"
    assert link.is_symlink() and link.resolve().name == f"libcuda.so.{NVIDIA.driver_version}"
    assert not Path(str(link.readlink())).is_absolute()  # resolves inside the guest, not on the host
    assert (tmp_path / "usr/bin/nvidia-smi").resolve() == (tmp_path / "usr/lib/nvidia/current/nvidia-smi")
    assert not (tmp_path / "usr/lib/nvidia/current/nvidia-smi.1.gz").exists()


def test_a_stack_file_the_packages_did_not_provide_fails_the_build_naming_it(tmp_path: Path) -> None:
    with pytest.raises(CubeError) as e:
        vendor.install_rootfs(NVIDIA, tmp_path)
    assert e.value.code == "image.vendor_file_missing" and "libcuda.so" in e.value.message
    assert e.value.layer == "userspace_driver"


def _image(tmp_path: Path, driver: str = "535.309.01") -> Manifest:
    d = tmp_path / "img"
    d.mkdir()
    for name, body in (("vmlinux", b"k"), ("modules.img", b"m"), ("rootfs.cpio", b"r"), ("initrd.img", b"rm")):
        (d / name).write_bytes(body)

    def art(name: str) -> Artifact:
        return Artifact(name, sha256_file(d / name))

    m = Manifest(
        key="nvidia-0123456789abcdef",
        kernel_package="linux-image-6.1.0-57-amd64",
        kernel_package_version="6.1.192-3",
        kernel_release="6.1.0-57-amd64",
        vmlinuz_sha256="",
        vmlinux=art("vmlinux"),
        modules_img=art("modules.img"),
        modules=("nvidia", "nvidia_uvm"),
        rootfs=art("rootfs.cpio"),
        initrd=art("initrd.img"),
        packages=(),
        agent_sha256="sha256:" + "0" * 64,
        cmdline="console=ttyS0",
        directory=d,
        vendor=VendorBuild("nvidia", "nvidia", driver, ("nvidia",), "nvidia", (), {}, {"cuda_driver_api": "12.2"}),
    )
    m.save()
    return m


def _cuda_template() -> dict[str, object]:
    doc = loads_document((EXAMPLES / "cuda12-h100.yaml").read_text())
    assert isinstance(doc, dict)
    return doc


def test_a_gpu_image_pins_driver_and_cuda_versions_too(tmp_path: Path) -> None:
    m = _image(tmp_path)
    assert pinned_paths(_cuda_template(), m) == GUEST_PINS + VENDOR_PINS
    assert Manifest.load(m.directory / "manifest.json") == m  # the vendor section round-trips


def test_an_import_whose_image_is_not_the_templates_is_refused_naming_each_layer(tmp_path: Path) -> None:
    m = _image(tmp_path, driver="535.261.03")
    diff = {d["field"]: d["layer"] for d in mismatches(_cuda_template(), m)}
    assert diff["spec.guest.image.digest"] == "template"
    assert diff["spec.guest.modules_img.digest"] == "modules_img"
    assert diff["spec.driver.kernel.version"] == "kernel_driver"
    assert diff["spec.driver.userspace.version"] == "userspace_driver"
    with pytest.raises(CubeError) as e:
        import_image(m.directory, _cuda_template(), tmp_path / "cache")
    assert e.value.code == "image.import_mismatch" and not (tmp_path / "cache" / "images").exists()


def test_an_image_matching_its_template_is_imported_and_a_corrupt_one_is_not(tmp_path: Path) -> None:
    m = _image(tmp_path)
    doc = json.loads(json.dumps(_cuda_template()))
    guest = doc["spec"]["guest"]
    guest["image"]["digest"] = m.image_digest
    guest["kernel"]["digest"] = m.vmlinux.sha256
    guest["modules_img"]["digest"] = m.modules_img.sha256
    imported = import_image(m.directory, doc, tmp_path / "cache")
    assert imported.image_digest == m.image_digest and not imported.verify()
    assert imported.directory.parent == tmp_path / "cache" / "images"

    shutil.rmtree(imported.directory)
    (m.directory / "rootfs.cpio").write_bytes(b"tampered")
    with pytest.raises(CubeError) as e:
        import_image(m.directory, doc, tmp_path / "cache")
    assert e.value.code == "image.import_mismatch" and "rootfs.cpio" in e.value.message
