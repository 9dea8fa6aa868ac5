"""Reproducible images: the same inputs give the same digests, whatever the builder's umask or process.

Before the fix three builds of one cache key gave three rootfs digests: bytecode compiled under a random hash
seed orders frozenset constants differently each time, and the builder's umask leaked into the archive's modes.
"""

from __future__ import annotations

import os
from pathlib import Path

from cubeaccel.images.builder import build, cache_dir
from cubeaccel.images.manifest import Manifest, pin_template_document
from cubeaccel.master.up import EXAMPLES
from cubeaccel.wire.templates import loads_document


def _fresh_cache(root: Path, shared: Path) -> Path:
    """A cache with the shared cache's downloaded packages and no image: a real build, without the network."""
    (root / "images").mkdir(parents=True)
    (root / "debs").mkdir()
    for deb in (shared / "debs").glob("*.deb"):
        os.symlink(deb, root / "debs" / deb.name)
    return root


def test_two_builds_from_the_same_inputs_give_identical_digests(tmp_path: Path, guest_image: Manifest) -> None:
    digests = []
    for i, umask in enumerate((0o022, 0o077)):  # a shell's umask, then a Cubelet's (private_umask)
        old = os.umask(umask)
        try:
            m, built = build(_fresh_cache(tmp_path / f"c{i}", cache_dir()), force=True)
        finally:
            os.umask(old)
        assert built and m.key == guest_image.key
        digests.append((m.image_digest, m.rootfs.sha256, m.modules_img.sha256, m.vmlinux.sha256))
    assert digests[0] == digests[1]
    assert digests[0][0] == guest_image.image_digest  # and the session's image (another process, another time)


def test_the_example_templates_kernel_and_modules_match_a_build(guest_image: Manifest) -> None:
    """edu-demo pins the kernel and modules.img of the image this host builds; its image digest also covers the
    guest's own code (agent, workload, model), so `cubeaccel template pin` refreshes it when that code changes."""
    doc = loads_document((EXAMPLES / "edu-demo.yaml").read_text())
    assert isinstance(doc, dict)
    pinned = pin_template_document(doc, guest_image)
    assert pinned["spec"]["guest"]["kernel"] == doc["spec"]["guest"]["kernel"]
    assert pinned["spec"]["guest"]["modules_img"] == doc["spec"]["guest"]["modules_img"]
