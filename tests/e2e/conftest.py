from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cubelet_process import CubeletProcess
from tests.support.master_harness import Cluster
from tests.support.poll import poll


@pytest.fixture
def cubelet_proc(tmp_path: Path) -> Iterator[CubeletProcess]:
    """A fresh Cubelet for a test that needs an empty event log or a state no reset restores."""
    p = CubeletProcess(tmp_path).start()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def module_cubelet(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CubeletProcess]:
    """One Cubelet process per module (a start costs most of a simple test's time); use it through `cubelet`."""
    p = CubeletProcess(tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])).start()
    yield p
    p.stop()


@pytest.fixture
def cubelet(module_cubelet: CubeletProcess) -> Iterator[CubeletProcess]:
    """The module's Cubelet, reset after the test: every reservation released, every quarantine recovered, all
    devices allocatable again. Its event log keeps growing: a test reads events from a cursor it took first."""
    yield module_cubelet
    c = module_cubelet.client
    for sandbox_id in {d.sandbox_id for d in c.devices() if d.sandbox_id}:
        c.release(sandbox_id)
    for d in c.devices():
        if d.state == "quarantined":
            c.verb(d.id, "recover", "tests", "reset between tests")
    poll(lambda: all(d.state == "allocatable" for d in c.devices()), 20, what="every device allocatable again")


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
