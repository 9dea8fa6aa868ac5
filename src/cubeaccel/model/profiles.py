"""Known accelerator ids → model, memory and architecture labels. Unknown ids keep hex labels.

Sources, checked 2026-11-29:
- PCI ID repository (pci-ids.ucw.cz, vendor 10de) device names: 2330 "GH100 [H100 SXM5 80GB]",
  2331 "GH100 [H100 PCIe]", 2321 "GH100 [H100 NVL]", 2335 "GH100 [H200 SXM 141GB]", 233b "GH100 [H200 NVL]",
  20b0 "GA100 [A100 SXM4 40GB]", 20b2 "GA100 [A100 SXM4 80GB]", 20f1 "GA100 [A100 PCIe 40GB]",
  20b5 "GA100 [A100 PCIe 80GB]", 27b8 "AD104GL [L4]", 26b9 "AD102GL [L40S]", 26b5 "AD102GL [L40]",
  1eb8 "TU104GL [Tesla T4]", 2901 "GB100 [B200]" (as quoted in several public lspci captures and
  pci.ids excerpts).
- NVIDIA/gpu-admin-tools `gpu/devid_names.py` (GPU_NAME_BY_DEVID): 0x2321/0x2330/0x2331 H100,
  0x2335/0x233B H200, 0x27B8 L4, 0x26B5 L40, 0x26B9 L40S — the same ids from NVIDIA's own tool.
- Memory sizes from NVIDIA product briefs (H100 NVL 94 GB, H200 141 GB HBM3e, B200 180 GB HBM3e as
  shipped in HGX B200). One device id can cover more than one memory SKU; the label names the common
  one, so `memory_gib` is advisory (the guest's CUDA probe reports the real size).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceProfile:
    vendor: str
    model: str
    memory_gib: int
    architecture: str
    cuda: bool


VENDOR_NAMES: dict[int, str] = {
    0x10DE: "nvidia",
    0x1002: "amd",
    0x8086: "intel",
    0x1234: "qemu",
    0x1B36: "qemu",
    0x1AF4: "virtio",
}

PROFILES: dict[tuple[int, int], DeviceProfile] = {
    (0x10DE, 0x2330): DeviceProfile("nvidia", "H100-SXM5-80GB", 80, "hopper", True),
    (0x10DE, 0x2331): DeviceProfile("nvidia", "H100-PCIe-80GB", 80, "hopper", True),
    (0x10DE, 0x2321): DeviceProfile("nvidia", "H100-NVL-94GB", 94, "hopper", True),
    (0x10DE, 0x2335): DeviceProfile("nvidia", "H200-SXM-141GB", 141, "hopper", True),
    (0x10DE, 0x233B): DeviceProfile("nvidia", "H200-NVL-141GB", 141, "hopper", True),
    (0x10DE, 0x20B0): DeviceProfile("nvidia", "A100-SXM4-40GB", 40, "ampere", True),
    (0x10DE, 0x20B2): DeviceProfile("nvidia", "A100-SXM4-80GB", 80, "ampere", True),
    (0x10DE, 0x20F1): DeviceProfile("nvidia", "A100-PCIe-40GB", 40, "ampere", True),
    (0x10DE, 0x20B5): DeviceProfile("nvidia", "A100-PCIe-80GB", 80, "ampere", True),
    (0x10DE, 0x27B8): DeviceProfile("nvidia", "L4-24GB", 24, "ada", True),
    (0x10DE, 0x26B9): DeviceProfile("nvidia", "L40S-48GB", 48, "ada", True),
    (0x10DE, 0x26B5): DeviceProfile("nvidia", "L40-48GB", 48, "ada", True),
    (0x10DE, 0x1EB8): DeviceProfile("nvidia", "T4-16GB", 16, "turing", True),
    (0x10DE, 0x2901): DeviceProfile("nvidia", "B200-180GB", 180, "blackwell", True),
    (0x1234, 0x11E8): DeviceProfile("qemu", "edu", 0, "emulated", False),
    (0x1B36, 0x0005): DeviceProfile("qemu", "pci-testdev", 0, "emulated", False),
}


def labels_for(vendor_id: int, device_id: int) -> dict[str, str]:
    """Labels for scheduling. Unknown devices still work: they keep their hex ids."""
    p = PROFILES.get((vendor_id, device_id))
    vid, did = f"{vendor_id:04x}", f"{device_id:04x}"
    if p is None:
        return {
            "vendor": VENDOR_NAMES.get(vendor_id, vid),
            "model": f"{vid}:{did}",
            "vendor_id": vid,
            "device_id": did,
        }
    labels = {
        "vendor": p.vendor,
        "model": p.model,
        "architecture": p.architecture,
        "cuda": "true" if p.cuda else "false",
        "vendor_id": vid,
        "device_id": did,
    }
    if p.memory_gib:
        labels["memory_gib"] = str(p.memory_gib)
    return labels
