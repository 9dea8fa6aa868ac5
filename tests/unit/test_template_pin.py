"""`cubeaccel template pin`: the digests of this host's image written into a template, comments and layout kept."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cubeaccel.cli.template import pin_yaml_text
from cubeaccel.images.manifest import Artifact, Manifest
from cubeaccel.master.up import EXAMPLES
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.templates import loads_document


def fake_image(cache: Path) -> Manifest:
    d = cache / "images" / "k1"
    d.mkdir(parents=True)
    m = Manifest(
        key="k1",
        kernel_package="linux-image-6.1.0-99-amd64",
        kernel_package_version="6.1.999-1",
        kernel_release="6.1.0-99-amd64",
        vmlinuz_sha256="sha256:" + "1" * 64,
        vmlinux=Artifact("vmlinux", "sha256:" + "2" * 64),
        modules_img=Artifact("modules.img", "sha256:" + "3" * 64),
        modules=("virtio_pci",),
        rootfs=Artifact("rootfs.cpio", "sha256:" + "4" * 64),
        initrd=Artifact("initrd.img", "sha256:" + "5" * 64),
        packages=(),
        agent_sha256="sha256:" + "6" * 64,
        cmdline="console=ttyS0",
        directory=d,
    )
    m.save()
    (cache / "images" / "latest").write_text("k1\n")
    return m


def _pin(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cubeaccel", "template", "pin", *args], capture_output=True, text=True, check=False
    )


def test_pin_writes_the_images_digests_and_keeps_the_comments(tmp_path: Path) -> None:
    image = fake_image(tmp_path / "cache")
    original = (EXAMPLES / "edu-demo.yaml").read_text()
    f = tmp_path / "edu-demo.yaml"
    f.write_text(original)
    out = _pin(str(f), "--cache-dir", str(tmp_path / "cache"), "--no-build", "-o", "json")
    assert out.returncode == 0, out.stderr
    assert set(json.loads(out.stdout)["changed"]) == {
        "spec.guest.image.digest",
        "spec.guest.kernel.version",
        "spec.guest.kernel.digest",
        "spec.guest.modules_img.kernel_version",
        "spec.guest.modules_img.digest",
    }
    text = f.read_text()
    doc = loads_document(text)
    assert isinstance(doc, dict)
    guest = doc["spec"]["guest"]
    assert guest["image"]["digest"] == image.image_digest
    assert guest["kernel"] == {"version": "6.1.0-99-amd64", "digest": image.vmlinux.sha256}
    assert guest["modules_img"] == {"kernel_version": "6.1.0-99-amd64", "digest": image.modules_img.sha256}
    comments = [line for line in original.splitlines() if line.lstrip().startswith("#")]
    assert [line for line in text.splitlines() if line.lstrip().startswith("#")] == comments
    assert len(text.splitlines()) == len(original.splitlines())  # five values changed, nothing else
    again = _pin(str(f), "--cache-dir", str(tmp_path / "cache"), "--no-build", "--check")
    assert again.returncode == 0 and "already pinned" in again.stdout


def test_check_exits_1_when_the_file_is_not_pinned_to_this_hosts_image(tmp_path: Path) -> None:
    fake_image(tmp_path / "cache")
    f = tmp_path / "t.yaml"
    f.write_text((EXAMPLES / "edu-demo.yaml").read_text())
    out = _pin(str(f), "--cache-dir", str(tmp_path / "cache"), "--no-build", "--check")
    assert out.returncode == 1 and f.read_text() == (EXAMPLES / "edu-demo.yaml").read_text()


def test_a_flow_style_guest_section_is_refused_not_half_rewritten() -> None:
    with pytest.raises(CubeError) as e:
        pin_yaml_text("spec:\n  guest: {image: {digest: x}}\n", {("spec", "guest", "image", "digest"): "y"})
    assert e.value.code == "template.pin_failed"


def test_up_pins_every_example_a_user_drives_to_the_userland_image_not_the_lean_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """edu-demo and base are driven through the SDK: each carries E2B base's userland (xargs, git, curl, sudo…),
    so `up` pins both to the userland image even when a validation image is newer, and gives them room for it."""
    from dataclasses import replace

    from cubeaccel.master import up

    lean = fake_image(tmp_path)
    userland = replace(lean, key="userland-k2", rootfs=Artifact("rootfs.cpio", "sha256:" + "7" * 64))
    monkeypatch.setenv("CUBEACCEL_CACHE_DIR", str(tmp_path))
    (tmp_path / "images/userland-k2").mkdir()
    userland = replace(userland, directory=tmp_path / "images/userland-k2")
    userland.save()
    (tmp_path / "images/latest-userland").write_text("userland-k2\n")
    for name in ("edu-demo.yaml", "base.yaml"):
        doc = up.example_document(name, pin_to_image=True)
        assert doc["spec"]["guest"]["image"]["digest"] == userland.image_digest != lean.image_digest, name
        assert doc["spec"]["memory"]["size_mib"] >= 512, name  # the userland initrd and its rootfs during boot
