"""The shipped CUDA templates pin exactly the GPU image this tree builds, so a real node that built it is
schedulable for them; and two builds from the same inputs give the same digests.

When guest-side code (agent, workload, model) or a Debian package changes, the image changes: re-pin with
`cubeaccel template pin --vendor nvidia src/cubeaccel/examples/templates/<file>` (the userland flavour with
NVIDIA's stack: docs/images.md).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cubeaccel.images.builder import GPU_FLAVOUR, build, flavour_named
from cubeaccel.images.manifest import Manifest, pin_template_document, pinned_paths
from cubeaccel.images.nvidia import NVIDIA
from cubeaccel.master.up import EXAMPLES
from cubeaccel.wire.templates import loads_document
from tests.vm.conftest import SHARED_CACHE


def _get(doc: object, path: tuple[str, ...]) -> object:
    for k in path:
        assert isinstance(doc, dict)
        doc = doc[k]
    return doc


def _stale(name: str, image: Manifest) -> dict[str, tuple[object, object]]:
    doc = loads_document((EXAMPLES / name).read_text())
    assert isinstance(doc, dict)
    want = pin_template_document(doc, image)
    return {
        ".".join(p): (_get(doc, p), _get(want, p)) for p in pinned_paths(doc, image) if _get(doc, p) != _get(want, p)
    }


@pytest.mark.parametrize("name", ["cuda12-h100.yaml", "untrusted-tool-h100.yaml"])
def test_the_cuda_templates_pin_the_gpu_image_this_tree_builds(name: str, gpu_image: Manifest) -> None:
    stale = _stale(name, gpu_image)
    assert not stale, f"re-pin with `cubeaccel template pin --vendor nvidia {EXAMPLES / name}`: {stale}"


@pytest.mark.parametrize("name", ["base.yaml", "edu-demo.yaml"])
def test_the_sdk_templates_pin_the_userland_image_this_tree_builds(name: str, userland_image: Manifest) -> None:
    """`base` and `edu-demo` are E2B's base in content too: xargs, git, curl, sudo, tput, pip."""
    stale = _stale(name, userland_image)
    assert not stale, f"re-pin with `cubeaccel template pin --flavour userland {EXAMPLES / name}`: {stale}"


def test_a_second_gpu_image_build_from_the_same_inputs_gives_the_same_digests(
    tmp_path: Path, gpu_image: Manifest
) -> None:
    """A fresh cache with the downloaded packages and the compiled modules: the image is assembled again."""
    fresh = tmp_path / "cache"
    (fresh / "images").mkdir(parents=True)
    for sub in ("debs-nvidia", "vendor-modules", "apt"):
        os.symlink(SHARED_CACHE / sub, fresh / sub)
    m, built = build(fresh, force=True, stack=NVIDIA, flavour=flavour_named(GPU_FLAVOUR))
    assert built and m.key == gpu_image.key
    assert (m.image_digest, m.modules_img.sha256, m.rootfs.sha256) == (
        gpu_image.image_digest,
        gpu_image.modules_img.sha256,
        gpu_image.rootfs.sha256,
    )
