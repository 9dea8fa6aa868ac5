"""The confined VMM's pieces without a VMM: uid leases, the locked-memory mode and limit, the /proc verdict, what a
VMM may see, and the launcher's refusal to run anything half-confined."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from cubeaccel.host.vmm import confine, vmm_launch
from cubeaccel.host.vmm.confine import (
    CAP_IPC_LOCK,
    CAP_SYS_RESOURCE,
    ConfinePolicy,
    Expected,
    allocate_uid,
    memlock_limit_bytes,
    memlock_mode,
    read_credentials,
    verify,
)
from cubeaccel.model.pinned_memory import (
    PREALLOC_POOL_MIB,
    QEMU_LOCKED_OVERHEAD_MIB,
    QEMU_LOCKED_PER_VCPU_MIB,
    THREAD_CONTEXT_MIB,
    LockedGuest,
)
from cubeaccel.protocol.errors import CubeError
from cubeaccel.shim.confined import launch_argv, setpriv_argv, vmm_exposure
from cubeaccel.shim.vmm import VmConfig

ALL = (1 << 41) - 1
STATUS = """Name:\tqemu-system-x86
Uid:\t{uid}\t{uid}\t{uid}\t{uid}
Gid:\t{uid}\t{uid}\t{uid}\t{uid}
Groups:\t{groups}
NoNewPrivs:\t1
Seccomp:\t{seccomp}
CapInh:\t0000000000004000
CapPrm:\t{cap:016x}
CapEff:\t{cap:016x}
CapBnd:\t{cap:016x}
CapAmb:\t0000000000004000
"""


def _proc(tmp_path: Path, pid: int, uid: int = 1_900_000_007, cap: int = 1 << CAP_IPC_LOCK, **kw: object) -> Path:
    d = tmp_path / str(pid)
    (d / "ns").mkdir(parents=True)
    fields = {"uid": uid, "groups": "", "seccomp": 2, "cap": cap, **kw}
    (d / "status").write_text(STATUS.format(**fields))
    os.symlink("mnt:[4026532177]", d / "ns" / "mnt")
    (d / "limits").write_text("Max locked memory         1073741824           1073741824           bytes\n")
    return tmp_path


def _want(cap: int = 1 << CAP_IPC_LOCK) -> Expected:
    return Expected(1_900_000_007, 1_900_000_007, cap, "mnt:[4026531832]")


def test_a_vmm_as_launched_verifies_and_every_deviation_is_named(tmp_path: Path) -> None:
    ok = read_credentials(41, _proc(tmp_path, 41))
    assert verify(ok, _want()) == [] and ok.memlock_limit == "1073741824"
    cases = {
        "uid": dict(uid=0),
        "groups": dict(groups="0 27"),
        "seccomp": dict(seccomp=0),
        "caps": dict(cap=ALL),
    }
    for name, kw in cases.items():
        creds = read_credentials(50, _proc(tmp_path / name, 50, **kw))  # type: ignore[arg-type]
        assert verify(creds, _want()), name
    # A VMM in the host's own mount namespace is not confined, whatever its credentials.
    same_ns = Expected(1_900_000_007, 1_900_000_007, 1 << CAP_IPC_LOCK, "mnt:[4026532177]")
    assert any("mount namespace" in p for p in verify(ok, same_ns))
    # CAP_IPC_LOCK is allowed only where the mode asks for it: with `rlimit` no capability at all.
    assert any(p.startswith("CapEff") for p in verify(ok, _want(cap=0)))
    with pytest.raises(CubeError) as e:
        confine.verify_pid(41, _want(cap=0), tmp_path)
    assert e.value.code == "vmm.not_confined" and e.value.details["seccomp"] == 2


def test_memlock_mode_prefers_raising_the_limit_and_refuses_when_nothing_works() -> None:
    policy = ConfinePolicy()
    assert memlock_mode(policy, pin_memory=False, caps={}) == "none"
    full = {"CapEff": ALL, "CapBnd": ALL}
    assert memlock_mode(policy, True, full) == "rlimit"
    here = {"CapEff": ALL & ~(1 << CAP_SYS_RESOURCE), "CapBnd": ALL & ~(1 << CAP_SYS_RESOURCE)}  # these machines
    assert memlock_mode(policy, True, here) == "cap_ipc_lock"
    assert memlock_mode(ConfinePolicy(memlock="rlimit"), True, here) is None
    assert memlock_mode(policy, True, {"CapEff": 0, "CapBnd": 0}) is None


def test_memlock_limit_is_guest_ram_plus_what_qemu_itself_locks_per_vcpu_and_prealloc_pool() -> None:
    mib = 1024 * 1024
    own = QEMU_LOCKED_OVERHEAD_MIB
    assert memlock_limit_bytes(LockedGuest(256, tcg=True)) == (256 + 64 + own) * mib
    assert memlock_limit_bytes(LockedGuest(256)) == (256 + own) * mib
    # Each vCPU after the first has its own locked stack and state: the limit had no such term before.
    assert memlock_limit_bytes(LockedGuest(256, vcpus=4)) == (256 + own + 3 * QEMU_LOCKED_PER_VCPU_MIB) * mib
    # A preallocation pool (and its NUMA thread context) stay locked after preallocation.
    pool = LockedGuest(8192, prealloc_threads=4, numa_host=True)
    assert memlock_limit_bytes(pool) == (8192 + own + PREALLOC_POOL_MIB + THREAD_CONTEXT_MIB) * mib
    # VFIO type1 pinning and mlock both charge locked_vm: guest RAM counts twice.
    assert memlock_limit_bytes(LockedGuest(4096, vfio=True)) == (8192 + own) * mib
    assert memlock_limit_bytes(LockedGuest(4096, vfio=True, mlock=False)) == 4096 * mib  # VFIO pins; nothing else


def test_uid_leases_are_exclusive_until_closed(tmp_path: Path) -> None:
    policy = ConfinePolicy(uid_start=1_900_100_000, uid_count=2, lock_dir=tmp_path / "uids")
    a = allocate_uid(policy)
    b = allocate_uid(policy)
    assert {a.uid, b.uid} == {1_900_100_000, 1_900_100_001} and a.gid == a.uid
    with pytest.raises(CubeError) as e:
        allocate_uid(policy)
    assert e.value.code == "vmm.no_uid"
    a.close()
    again = allocate_uid(policy)
    assert again.uid == 1_900_100_000
    again.close()
    b.close()


def test_a_uid_some_process_runs_as_is_never_leased(tmp_path: Path) -> None:
    proc = _proc(tmp_path / "proc", 77, uid=1_900_200_000)
    policy = ConfinePolicy(uid_start=1_900_200_000, uid_count=2, lock_dir=tmp_path / "uids")
    lease = allocate_uid(policy, proc)  # the lock file is free, but a (VMM) process runs as the first uid
    assert lease.uid == 1_900_200_001
    lease.close()


def test_policy_from_the_environment() -> None:
    p = ConfinePolicy.from_env({"CUBEACCEL_VMM_UIDS": "3000000-3000009", "CUBEACCEL_VMM_MEMLOCK": "rlimit"})
    assert p.uids == range(3000000, 3000010) and p.memlock == "rlimit"
    for bad in ({"CUBEACCEL_VMM_UIDS": "0-5"}, {"CUBEACCEL_VMM_UIDS": "9-3"}, {"CUBEACCEL_VMM_MEMLOCK": "off"}):
        with pytest.raises(CubeError) as e:
            ConfinePolicy.from_env(bad)
        assert e.value.code == "vmm.confine_config"


def _vm(vfio_hosts: tuple[str, ...] = ()) -> VmConfig:
    return VmConfig(
        "sb", 256, 1, True, Path("/img/vmlinux"), Path("/img/initrd.img"), "", Path("/sd"), vfio_hosts=vfio_hosts
    )


def test_a_vmm_sees_only_qemu_its_kernel_initrd_and_the_nodes_it_needs(tmp_path: Path) -> None:
    plain = vmm_exposure(_vm(), "tcg")
    assert plain.trees_ro == ("/usr",) and plain.read_only == ("/img/vmlinux", "/img/initrd.img")
    assert plain.devices == ("/dev/null", "/dev/zero", "/dev/urandom") and plain.owned == ()
    kvm = vmm_exposure(_vm(), "kvm")  # its own /dev/kvm node: the host's stays root:kvm
    assert kvm.private_nodes == ("/dev/kvm",) and "/dev/kvm" not in kvm.devices
    # VFIO: the container, the device's group node (handed to the VMM's uid) and sysfs, read-only.
    sys_root, dev_root = tmp_path / "sys", tmp_path / "dev"
    (sys_root / "kernel" / "iommu_groups" / "7").mkdir(parents=True)
    (sys_root / "bus" / "pci" / "devices" / "0000:3b:00.0").mkdir(parents=True)
    os.symlink(sys_root / "kernel" / "iommu_groups" / "7", sys_root / "bus/pci/devices/0000:3b:00.0/iommu_group")
    (dev_root / "vfio").mkdir(parents=True)
    (dev_root / "vfio" / "7").write_text("")
    gpu = vmm_exposure(_vm(("0000:3b:00.0",)), "kvm", sys_root, dev_root)
    assert gpu.owned == (dev_root / "vfio" / "7",)
    assert str(dev_root / "vfio" / "vfio") in gpu.devices and str(sys_root) in gpu.trees_ro
    # No IOMMU group: nothing is handed over (QEMU refuses the device as before).
    assert vmm_exposure(_vm(("0000:00:01.0",)), "kvm", sys_root, dev_root).owned == ()


def test_hand_over_and_take_back_a_group_node(tmp_path: Path) -> None:
    node = tmp_path / "7"
    node.write_text("")
    confine.hand_over((node,), 1_900_000_009, 1_900_000_009)
    st = node.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (1_900_000_009, 1_900_000_009, 0o600)
    assert confine.take_back(node) is None
    st = node.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, 0, 0o600)
    link = tmp_path / "8"
    link.symlink_to(node)
    with pytest.raises(CubeError) as e:
        confine.hand_over((link,), 1_900_000_009, 1_900_000_009)
    assert e.value.code == "vmm.device_node_refused"
    assert confine.take_back(tmp_path / "gone") is None  # the group went away: nothing is held


def test_credentials_drop_keeps_nothing_or_exactly_ipc_lock() -> None:
    none = setpriv_argv(1_900_000_001, 1_900_000_001, "rlimit")
    assert "--inh-caps=-all" in none and "--bounding-set=-all" in none and "--ambient-caps=-all" in none
    assert "--clear-groups" in none and "--no-new-privs" in none and "--reuid=1900000001" in none
    lock = setpriv_argv(1_900_000_001, 1_900_000_001, "cap_ipc_lock")
    assert "--bounding-set=-all,+ipc_lock" in lock and "--ambient-caps=-all,+ipc_lock" in lock
    argv = launch_argv("{}", 5, 5, "none", ["/usr/bin/qemu-system-x86_64", "-name", "x"])
    assert argv[:3] == [sys.executable, "-S", vmm_launch.__file__] and argv[-3:] == [
        "/usr/bin/qemu-system-x86_64",
        "-name",
        "x",
    ]


@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace needs root")
def test_the_launcher_refuses_to_run_anything_when_a_path_to_expose_is_missing(tmp_path: Path) -> None:
    cfg = {"root": str(tmp_path / "root"), "read_only": [str(tmp_path / "no-such-kernel")], "devices": []}
    marker = tmp_path / "ran"
    r = subprocess.run(
        [sys.executable, "-S", vmm_launch.__file__, json.dumps(cfg), "--", "touch", str(marker)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == vmm_launch.EXIT_CONFINE and not marker.exists()
    assert json.loads(r.stderr.strip().splitlines()[-1])["confine_error"] == "missing"


@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace needs root")
def test_the_launcher_pivots_into_a_root_holding_only_what_was_named(tmp_path: Path) -> None:
    shown = tmp_path / "shown.txt"
    shown.write_text("kernel")
    (tmp_path / "hidden.txt").write_text("secret")
    cfg = {
        "root": str(tmp_path / "root"),
        "trees_ro": ["/usr"],
        "read_only": [str(shown)],
        "devices": ["/dev/null"],
        "private_nodes": [["/dev/zero", 1_900_000_042, 1_900_000_042]],  # as /dev/kvm under KVM
    }
    probe = (
        "import os; st = os.stat('/dev/zero'); "
        f"print(sorted(os.listdir('/')), os.path.exists({str(tmp_path / 'hidden.txt')!r}), "
        "sorted(os.listdir('/dev')), st.st_uid, oct(st.st_mode & 0o777), os.stat('/dev/null').st_uid)"
    )
    r = subprocess.run(
        [sys.executable, "-S", vmm_launch.__file__, json.dumps(cfg), "--", "/usr/bin/python3", "-I", "-c", probe],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    links = {n for n in ("bin", "sbin", "lib", "lib32", "lib64", "libx32") if os.path.islink(f"/{n}")}  # merged /usr
    top = sorted({"usr", "dev", str(tmp_path).split("/")[1], *links})
    assert r.stdout.strip() == f"{top} False ['null', 'zero'] 1900000042 0o600 0"
    assert os.stat("/dev/zero").st_uid == 0  # the host's node is untouched


def test_a_launcher_failure_is_reported_as_confinement_failed_not_as_a_qemu_crash(tmp_path: Path) -> None:
    from cubeaccel.shim.qemu import QemuVmm

    vmm = QemuVmm(replace(_vm(), state_dir=tmp_path), policy=ConfinePolicy(lock_dir=tmp_path / "uids"))
    step = {"confine_error": "unshare mount namespace", "errno": 1, "message": "Operation not permitted"}
    (tmp_path / "vmm.log").write_text("noise\n" + json.dumps(step) + "\n")
    err = vmm._early_exit()
    assert err.code == "vmm.confinement_failed" and err.details["step"] == step
    (tmp_path / "vmm.log").write_text("qemu-system-x86_64: -device foo: 'foo' is not a valid device model name\n")
    assert vmm._early_exit().code == "vmm.start_failed"
