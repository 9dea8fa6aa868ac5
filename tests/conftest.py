from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from cubeaccel.protocol import error_catalog
from tests.support.cubelet_harness import Node
from tests.support.sanitize_check import violations

# Shared 2-core machines run these beside other suites: a load of 15 made a 2 ms example take over Hypothesis's
# 200 ms default deadline (a flake, not a finding). Timing is measured in bench/, never asserted here.
settings.register_profile("cubeaccel", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("cubeaccel")


@pytest.fixture(autouse=True)
def catalogued_error_codes(request: pytest.FixtureRequest) -> Iterator[list[str]]:
    """The runtime half of the error-catalog guard: every CubeError / ContractViolation built in this process
    during a test must carry a catalogued code (and the catalog's HTTP status). Opt out with
    `@pytest.mark.uncatalogued_codes` where a test builds foreign codes on purpose."""
    seen: list[str] = []
    previous = error_catalog.set_observer(seen.append)
    try:
        yield seen
    finally:
        error_catalog.set_observer(previous)
    if request.node.get_closest_marker("uncatalogued_codes") is None:
        assert not seen, "uncatalogued error codes: " + "; ".join(sorted(set(seen)))


@pytest.fixture(autouse=True)
def devices_never_return_unsanitized(request: pytest.FixtureRequest) -> Iterator[None]:
    """Issue 27 #4, over every test that keeps a Cubelet journal in its `tmp_path` (the host, crash and fault
    suites): no device's trail goes from a tenant to `allocatable` without a recorded sanitizing stage
    (model/sanitize.py)."""
    root = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if root is None:
        return
    bad = violations(root)
    assert not bad, "a device went from a tenant to allocatable unsanitized:\n" + "\n".join(bad[:20])


@pytest.fixture(autouse=True)
def umask_kept() -> Iterator[None]:
    """A daemon's entry point sets the private umask process-wide (`host/service/private.py`); a test that runs one
    in-process (`run_shim` in tests/unit/test_shim_images.py) must not hand it to later tests: a GPU image built
    afterwards in this process was 0600 and the confined VMMs could not read it."""
    before = os.umask(0o022)
    os.umask(before)
    yield
    os.umask(before)


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node.create(tmp_path, "h100x8")
