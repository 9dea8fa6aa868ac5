"""An image a running Cubelet boots is never pruned by a rebuild on the node (a re-pin while `cubeaccel up` served
E2B's suite removed its `base` image: every later create of that template failed until the stack restarted)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cubeaccel.cubelet.process_shim import ProcessShimDriver
from cubeaccel.images.builder import hold_image, prune
from cubeaccel.wire.shim_spec import ShimSpec
from tests.unit.test_template_pin import fake_image


def _images(root: Path, *names: str) -> None:
    for n in names:
        (root / n).mkdir(parents=True)
        (root / n / "manifest.json").write_text("{}")


def test_a_held_image_survives_the_prune_and_goes_once_let_go(tmp_path: Path) -> None:
    _images(tmp_path, "0000000000000001", "0000000000000002", "0000000000000003")
    for age, name in enumerate(sorted(p.name for p in tmp_path.iterdir()), start=1):
        os.utime(tmp_path / name, (age, age))  # 1 is the oldest: the first to go
    fd = hold_image(tmp_path / "0000000000000001")
    assert fd is not None
    assert prune(tmp_path, keep=1) == ["0000000000000002"]
    assert (tmp_path / "0000000000000001").is_dir()
    os.close(fd)
    assert "0000000000000001" in prune(tmp_path, keep=1)
    assert not (tmp_path / "0000000000000001").exists()


def test_an_image_without_a_manifest_cannot_be_held(tmp_path: Path) -> None:
    assert hold_image(tmp_path / "gone") is None


def test_the_cubelet_holds_what_it_starts_until_it_closes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("CUBEACCEL_CACHE_DIR", str(cache))
    m = fake_image(cache)
    _images(cache / "images", "0000000000000009")  # newer: a re-pin's build
    shims = ProcessShimDriver(tmp_path / "state", python="/bin/true", launch="spawn")  # the "shim" exits at once
    shims.start(ShimSpec(sandbox_id="sb-hold-1", memory_mib=128, image_digest=m.image_digest))
    assert prune(cache / "images", keep=1) == []
    assert (cache / "images" / m.key / "manifest.json").is_file()
    shims.close()
    assert prune(cache / "images", keep=1) == [m.key]
