from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cubelet_process import CubeletProcess
from tests.support.master_harness import Cluster


@pytest.fixture
def cubelet_proc(tmp_path: Path) -> Iterator[CubeletProcess]:
    p = CubeletProcess(tmp_path).start()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """CubeMaster + one Cubelet per entry of the test module's `PROFILES` (node name → simulated profile), with
    the module's optional `GUEST_IMAGES` (node name → the guest images that simulated node reports)."""
    cl = Cluster(
        tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1]),
        request.module.PROFILES,
        getattr(request.module, "GUEST_IMAGES", None),
    )
    try:
        yield cl
    finally:
        cl.stop()


@pytest.fixture
def c(cluster: Cluster) -> Iterator[Cluster]:
    yield cluster
    cluster.cleanup()
