"""Device memory that remembers, and a canary test that can fail (issue 27 #3; docs/scrub.md).

The stand-in is QEMU's `ivshmem-plain` over a file of the device's own (`<state>/device-memory/`), kept across
sandboxes: unlike `edu`, what tenant A writes into it outlives A's VMM, so tenant B finds it unless something
clears it. Each tenant scans all of the device's memory, then fills it with its own canaries; between tenants the
release path runs the registry's `bar-memory` scrub in the scrub VM (zero, then every byte read back).

Both ways, with real MicroVMs: scrub on, no tenant finds another's canary (here 3 tenants; the 50-tenant run is
`bench/remanence_bench.py`, minutes under TCG); scrub policy `none`, the second tenant finds every canary of the
first — so the scan is known to bite.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cubeaccel.images.manifest import Manifest
from tests.support import remanence
from tests.support.cubelet_process import CubeletProcess
from tests.support.vmm_cleanup import kill_started_vmms

pytestmark = pytest.mark.vm
SIZE = 1 << 20  # 1 MiB: small, since a VMM with mem-lock locks it too
RECORDS = SIZE // 32  # fill_canary writes one 32-byte record per 32 bytes


@pytest.fixture
def cubelet(tmp_path: Path, guest_image: Manifest, request: pytest.FixtureRequest) -> Iterator[CubeletProcess]:
    extra = getattr(request, "param", ())
    p = CubeletProcess(
        tmp_path,
        "-",
        "--backend",
        "emulated",
        "--emulated-devices",
        "0",
        "--memory-device",
        str(SIZE),
        "--release-timeout",
        "20",
        *extra,
    )
    p.start()
    yield p
    p.stop()
    kill_started_vmms(tmp_path)


def test_with_the_scrub_no_tenant_finds_another_tenants_canaries(cubelet: CubeletProcess) -> None:
    tenancies = remanence.run(cubelet, 3)
    assert len({t.device for t in tenancies}) == 1  # one device, three tenants in sequence
    for t in tenancies:
        assert t.found["bytes_scanned"] == SIZE and t.found["filled"] == SIZE
        assert (t.found["hits"], t.found["nonzero"]) == (0, 0), t.found
        assert t.scrub["ok"] is True and t.scrub["method"] == "bar-memory", t.scrub
        assert t.scrub["bytes_zeroed"] == t.scrub["bytes_verified"] == SIZE and t.scrub["pages_nonzero"] == 0
    (mem,) = remanence.memory_files(cubelet.state_dir)
    assert mem.stat().st_size == SIZE and mem.read_bytes() == bytes(SIZE)  # the file outlived every VMM, cleared


@pytest.mark.parametrize("cubelet", [("--scrub", "accelerator=none")], indirect=True)
def test_without_the_scrub_the_next_tenant_finds_the_canaries(cubelet: CubeletProcess) -> None:
    a, b = remanence.run(cubelet, 2)
    assert a.device == b.device and not a.scrub and not b.scrub  # policy none: no scrub VM ran
    assert a.found["hits"] == 0
    assert b.found["hits"] == RECORDS and b.found["tags"] == {a.sandbox: RECORDS}, b.found  # all of A's canaries
    (mem,) = remanence.memory_files(cubelet.state_dir)
    assert b.sandbox.encode() in mem.read_bytes()  # B's own, left for whoever comes next
