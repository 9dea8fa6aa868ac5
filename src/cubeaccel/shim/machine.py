"""A sandbox's machine on this host, from its spec: one function, so a template snapshot prepared ahead of
time (shim/template.py) has exactly the machine the sandboxes that restore it will have."""

from __future__ import annotations

from dataclasses import replace

from cubeaccel.images.manifest import Manifest
from cubeaccel.model.bars import Bar, MachineShape, machine_shape, uniform_shape
from cubeaccel.model.pinned_memory import numa_bind_node, prealloc_threads
from cubeaccel.protocol.errors import CubeError
from cubeaccel.shim.vmm import VmConfig
from cubeaccel.wire.shim_spec import ShimSpec


def vm_config(spec: ShimSpec, manifest: Manifest, cpus: int, host_nodes: tuple[int, ...]) -> VmConfig:
    """The sandbox's machine on this host: `cpus` and `host_nodes` size and place its preallocation, with the
    same rule Cubelet's ledger charges (model/pinned_memory.py); its root ports and 64-bit hole are shaped for
    the devices it will receive (model/bars.py)."""
    cfg = VmConfig(
        sandbox_id=spec.sandbox_id,
        memory_mib=spec.memory_mib,
        vcpus=spec.vcpus,
        pin_memory=spec.pin_memory,
        kernel=manifest.path(manifest.vmlinux),
        initrd=manifest.path(manifest.initrd),
        cmdline=manifest.cmdline,
        state_dir=spec.run_dir,
        device_ids=tuple(d.device_id for d in spec.devices),
        memory_backend=spec.memory_backend,
        prealloc_threads=prealloc_threads(spec.memory_mib, cpus),
        host_node=numa_bind_node(tuple(d.numa_node for d in spec.devices), host_nodes),
        vfio_hosts=tuple(h for d in spec.devices if d.driver == "vfio-pci" and (h := d.properties.get("host"))),
        memory_files=tuple(str(d.memory_file.path) for d in spec.devices if d.memory_file is not None),
    )
    return replace(cfg, shape=shape_for(spec, cfg))


def shape_for(spec: ShimSpec, cfg: VmConfig) -> MachineShape:
    """Cold: each root port for the device it will receive. From a template (and when a template snapshot is
    prepared): every port for the largest device the contract admits on this node, so the state fits whichever
    device a sandbox gets."""
    bars = [d.bars for d in spec.devices]
    try:
        if spec.start == "template" and not spec.policy_devices:
            return uniform_shape([*spec.template_bars, *bars], cfg.root_ports, cfg.memory_mib)
        return machine_shape(bars, cfg.root_ports, cfg.memory_mib)
    except ValueError as e:
        raise CubeError(
            "vmm.address_space_exceeded", str(e), layer="backend", details={"bars": bar_names(bars)}, status=500
        ) from e


def bar_names(bars: list[tuple[Bar, ...]]) -> list[list[str]]:
    return [[b.name for b in device] for device in bars]
