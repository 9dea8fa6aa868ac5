"""The pinned-memory ledger charges at least what a real confined VMM locks (issue 30 #8).

The ledger used to charge 656-720 MiB for a 256 MiB guest whose VMM locked 746-819 MB: a node admitted more
sandboxes than it could lock. Each shape here boots a real MicroVM (TCG) through an emulated Cubelet and compares
the peak VmLck of its VMM (boot, validation, 5 s after) with the Cubelet's charge for that sandbox.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cubeaccel.images.manifest import Manifest
from tests.support.cubelet_process import CubeletProcess
from tests.support.vmlck import measure_locked
from tests.support.vmm_cleanup import kill_started_vmms
from tests.vm.test_cubelet_emulated import edu_contract

pytestmark = pytest.mark.vm


@pytest.fixture
def emulated(tmp_path: Path, guest_image: Manifest) -> Iterator[CubeletProcess]:
    p = CubeletProcess(tmp_path, "-", "--backend", "emulated", "--release-timeout", "20")
    p.start()
    yield p
    p.stop()
    kill_started_vmms(tmp_path)


# The contract fixes guest RAM (edu_contract on the validation image: 256 MiB); the vCPUs are the request's.
@pytest.mark.parametrize(("memory_mib", "vcpus"), [(256, 1), (256, 2)])
def test_ledger_charges_at_least_the_peak_vmlck_of_a_real_vmm(
    emulated: CubeletProcess, guest_image: Manifest, memory_mib: int, vcpus: int
) -> None:
    sid = f"lck-{memory_mib}-{vcpus}"
    s = measure_locked(emulated, sid, edu_contract(guest_image), memory_mib, vcpus)
    print(f"{memory_mib} MiB x{vcpus}: peak VmLck {s.peak_vmlck_kib / 1024:.0f} MiB, charged {s.charge_mib} MiB")
    assert s.peak_vmlck_kib >= memory_mib * 1024  # the guest's RAM is locked: the measurement saw the VMM
    assert s.charge_mib * 1024 >= s.peak_vmlck_kib, s
    emulated.client.release(sid)
