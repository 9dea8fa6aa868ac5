"""Large guests: what a VMM locks (one function for the shim's RLIMIT_MEMLOCK and Cubelet's ledger), how its
memory is preallocated (threads, NUMA node) and how long its start may take."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from cubeaccel.cubelet import memory_ledger
from cubeaccel.cubelet.memory_ledger import VmmHost
from cubeaccel.host.vmm.confine import memlock_limit_bytes
from cubeaccel.host.vmm.hypervisor import numa_nodes
from cubeaccel.images.manifest import Artifact, Manifest
from cubeaccel.model.cold_start import (
    COLD_CONFIGURED,
    COLD_NO_SNAPSHOT,
    COLD_POLICY_DEVICES,
    cold_start_reason,
    start_path,
)
from cubeaccel.model.pinned_memory import LockedGuest, numa_bind_node, prealloc_threads, vmm_locked
from cubeaccel.model.reservation_params import ReservationParams
from cubeaccel.model.start_deadlines import start_deadlines, startup_timeout_s
from cubeaccel.shim.machine import vm_config
from cubeaccel.shim.qemu import build_argv, locked_guest, memory_argv
from cubeaccel.shim.vmm import VmConfig
from cubeaccel.wire.shim_spec import DeviceSpec, ShimSpec

MIB = 1024 * 1024
MANIFEST = Manifest(
    key="k",
    kernel_package="linux-image-6.1.0-1-amd64",
    kernel_package_version="1",
    kernel_release="6.1.0-1-amd64",
    vmlinuz_sha256="sha256:aa",
    vmlinux=Artifact("vmlinux", "sha256:bb"),
    modules_img=Artifact("modules.img", "sha256:cc"),
    modules=(),
    rootfs=Artifact("rootfs.cpio", "sha256:dd"),
    initrd=Artifact("initrd.img", "sha256:ee"),
    packages=(),
    agent_sha256="sha256:11",
    cmdline="console=ttyS0",
    directory=Path("/images/k"),
)


def _device(i: int, vfio: bool, node: int | None) -> DeviceSpec:
    return DeviceSpec(
        device_id=f"dev-{i}",
        driver="vfio-pci" if vfio else "edu",
        properties={"host": f"0000:0{i}:00.0"} if vfio else {},
        vendor_id=0x10DE if vfio else 0x1234,
        device_id_hex=0x2330 if vfio else 0x11E8,
        numa_node=node,
    )


@settings(max_examples=300, deadline=None)
@given(
    memory=st.integers(64, 4 << 20),
    vcpus=st.integers(1, 256),
    pin=st.booleans(),
    vfio=st.booleans(),
    tcg=st.booleans(),
    cpus=st.integers(1, 512),
    host_nodes=st.sampled_from([(0,), (0, 1), (0, 1, 2, 3)]),
    device_nodes=st.lists(st.none() | st.integers(-1, 3), min_size=1, max_size=4),
)
def test_the_vmm_rlimit_and_the_ledger_count_the_same_bytes_for_any_guest(
    memory: int,
    vcpus: int,
    pin: bool,
    vfio: bool,
    tcg: bool,
    cpus: int,
    host_nodes: tuple[int, ...],
    device_nodes: list[int | None],
) -> None:
    """The shim builds its machine from the spec, Cubelet its charge from the reservation: for the same guest on
    the same host, the limit the VMM gets is exactly what the ledger admitted, and the node loses what it charged."""
    spec = ShimSpec(
        sandbox_id="sb-1",
        memory_mib=memory,
        vcpus=vcpus,
        pin_memory=pin,
        devices=tuple(_device(i, vfio, n) for i, n in enumerate(device_nodes)),
        state_dir=Path("/run/sb-1"),
    )
    cfg = vm_config(spec, MANIFEST, cpus, host_nodes)
    shim_side = locked_guest(cfg, "tcg" if tcg else "kvm", len(host_nodes) > 1)
    host = VmmHost(tcg=tcg, cpus=cpus, vfio=vfio, numa=len(host_nodes) > 1)
    charged = memory_ledger.locked(ReservationParams(memory_mib=memory, vcpus=vcpus, pin_memory=pin), host)
    assert memlock_limit_bytes(shim_side) == charged.rlimit_mib * MIB
    assert vmm_locked(shim_side).node_mib == charged.node_mib
    if pin:  # every thread the VMM runs is in both
        assert charged.node_mib >= memory + 80 * (vcpus - 1) + (64 if tcg else 0)


def test_preallocation_threads_follow_the_guest_size_and_the_host_cpus() -> None:
    assert prealloc_threads(256, 16) == 1  # small guests: one thread, no pool to lock
    assert prealloc_threads(1024, 16) == 1
    assert prealloc_threads(4096, 2) == 2  # this machine: two CPUs
    assert prealloc_threads(4096, 16) == 4
    assert prealloc_threads(64 * 1024, 16) == 8  # the measured ceiling
    assert prealloc_threads(64 * 1024, 1) == 1


def test_a_large_guest_is_preallocated_by_a_pool_bound_to_its_devices_numa_node() -> None:
    cfg = VmConfig(
        sandbox_id="sb-1",
        memory_mib=64 * 1024,
        vcpus=8,
        pin_memory=True,
        kernel=Path("/k"),
        initrd=Path("/i"),
        cmdline="console=ttyS0",
        state_dir=Path("/run/sb-1"),
        prealloc_threads=8,
        host_node=1,
    )
    assert memory_argv(cfg) == [
        "-object",
        "thread-context,id=tc0,node-affinity=1",
        "-object",
        "memory-backend-ram,id=m0,size=65536M,prealloc=on,prealloc-threads=8,host-nodes=1,policy=bind,"
        "prealloc-context=tc0",
    ]
    argv = build_argv(cfg, "kvm")
    # The context is created before the backend that names it.
    assert argv.index("thread-context,id=tc0,node-affinity=1") < argv.index(memory_argv(cfg)[-1])
    small = VmConfig(**{**cfg.__dict__, "memory_mib": 512, "prealloc_threads": 1, "host_node": None})
    assert memory_argv(small) == ["-object", "memory-backend-ram,id=m0,size=512M,prealloc=on"]


def test_numa_binding_only_where_the_host_has_numa_and_every_device_shares_one_node() -> None:
    assert numa_bind_node((1, 1), (0, 1)) == 1
    assert numa_bind_node((1, 1), (0,)) is None  # this host: no NUMA, nothing to choose
    assert numa_bind_node((0, 1), (0, 1)) is None  # across nodes: none is local to all
    assert numa_bind_node((None,), (0, 1)) is None
    assert numa_bind_node((-1,), (0, 1)) is None  # sysfs says the device has no node
    assert numa_bind_node((), (0, 1)) is None
    assert numa_bind_node((5,), (0, 1)) is None  # not a node of this host


def test_numa_nodes_are_read_from_sysfs(tmp_path: Path) -> None:
    assert numa_nodes(tmp_path) == (0,)
    for n in ("node0", "node1", "has_cpu"):
        (tmp_path / "devices" / "system" / "node" / n).mkdir(parents=True)
    assert numa_nodes(tmp_path) == (0, 1)


def test_start_deadlines_grow_with_the_guest_and_stay_at_the_old_bound_for_small_ones() -> None:
    small = start_deadlines(256)
    assert 60 <= small.vmm_ready_s < 62 and 60 <= small.guest_ready_s < 61
    big = start_deadlines(64 * 1024)
    assert big.vmm_ready_s >= 64 * 2.3  # the cold preallocation cost measured here, with margin
    assert big.vmm_ready_s > 200 and big.guest_ready_s > small.guest_ready_s and big.migrate_s > 120
    assert start_deadlines(256, base_s=5).vmm_ready_s < 6  # a spec's shorter boot allowance is kept
    gpu_initrd = start_deadlines(1024, initrd_bytes=246 << 20)  # the NVIDIA image unpacks ~4x the CPU one's
    assert gpu_initrd.guest_ready_s >= start_deadlines(1024).guest_ready_s + 60
    assert gpu_initrd.vmm_ready_s == start_deadlines(1024).vmm_ready_s  # unpacking follows QMP, not before
    # Cubelet never gives up on a shim before the shim's own preallocation deadline.
    assert startup_timeout_s(256, 180.0) == 180.0
    assert startup_timeout_s(64 * 1024, 180.0) > big.vmm_ready_s


def test_the_locked_figures_of_a_pinned_guest_are_its_terms() -> None:
    m = vmm_locked(LockedGuest(4096, vcpus=2, tcg=True, prealloc_threads=2, vfio=True))
    assert (m.guest_mib, m.vmm_mib, m.recount_mib) == (4096, 560 + 144 + 64 + 80, 4096)
    assert vmm_locked(LockedGuest(4096, mlock=False)).node_mib == 0


def test_a_cold_start_names_its_reason_and_the_timeline_keeps_only_the_latest_start() -> None:
    assert cold_start_reason("template", policy_devices=False) is None  # look a snapshot up
    assert cold_start_reason("template", policy_devices=True) == COLD_POLICY_DEVICES
    assert cold_start_reason("cold", policy_devices=False) == COLD_CONFIGURED
    restored = {"start": "template", "cold_reason": None}
    cold: dict[str, str | None] = {"start": "cold", "cold_reason": COLD_NO_SNAPSHOT}
    trail = [
        ("reservation_created", None, {}),
        ("shim_report", "vm_started", restored),
        ("reservation_created", None, {}),  # the sandbox id reused: a new start
    ]
    assert start_path(trail) == {}
    trail.append(("shim_report", "vm_started", cold))
    assert start_path(trail) == {"path": "cold", "reason": "start.cold_no_snapshot"}
    assert start_path(trail[:2]) == {"path": "template", "reason": None}
