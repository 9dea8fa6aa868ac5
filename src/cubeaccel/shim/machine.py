"""A sandbox's machine on this host, from its spec: one function, so a template snapshot prepared ahead of
time (shim/template.py) has exactly the machine the sandboxes that restore it will have."""

from __future__ import annotations

from cubeaccel.images.manifest import Manifest
from cubeaccel.model.pinned_memory import numa_bind_node, prealloc_threads
from cubeaccel.shim.vmm import VmConfig
from cubeaccel.wire.shim_spec import ShimSpec


def vm_config(spec: ShimSpec, manifest: Manifest, cpus: int, host_nodes: tuple[int, ...]) -> VmConfig:
    """The sandbox's machine on this host: `cpus` and `host_nodes` size and place its preallocation, with the
    same rule Cubelet's ledger charges (model/pinned_memory.py)."""
    return VmConfig(
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
    )
