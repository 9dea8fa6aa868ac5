"""Builders for contract tests: the shipped example templates as editable documents, and hand-made devices
and guest reports. Tests start from the real example files so the examples stay valid."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import yaml

from cubeaccel.model.device import AcceleratorClass, DeviceIdentity, DeviceRecord, PciAddress, device_id_for
from cubeaccel.model.profiles import labels_for
from cubeaccel.model.states import DeviceState
from cubeaccel.model.template_spec import Template
from cubeaccel.protocol.reports import CudaInfo, GuestPciDevice, GuestReport, LibraryInfo, NvmlInfo
from cubeaccel.wire.templates import parse_template

EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "cubeaccel" / "examples" / "templates"
H100_FILE = EXAMPLES / "cuda12-h100.yaml"
EDU_FILE = EXAMPLES / "edu-demo.yaml"
_DOCS: dict[Path, dict[str, Any]] = {}


def example_doc(path: Path = H100_FILE) -> dict[str, Any]:
    """A fresh, editable copy of an example template's document."""
    if path not in _DOCS:
        _DOCS[path] = yaml.safe_load(path.read_text())
    return copy.deepcopy(_DOCS[path])


def set_path(doc: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """`set_path(doc, "spec.cuda.version", "12.6")`; list indexes are numbers (`devices.0`)."""
    *parents, last = dotted.split(".")
    node: Any = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return doc


def template(path: Path = H100_FILE, **edits: Any) -> Template:
    """An example template with edits given as `spec__cuda__version="12.6"` (dots spelt `__`)."""
    doc = example_doc(path)
    for key, value in edits.items():
        set_path(doc, key.replace("__", "."), value)
    return parse_template(doc)


def h100() -> Template:
    return template(H100_FILE)


def edu() -> Template:
    return template(EDU_FILE)


def device(
    vendor_id: int = 0x10DE,
    device_id: int = 0x2331,
    *,
    backend: str = "vfio",
    accel_class: AcceleratorClass = AcceleratorClass.GPU,
    labels: dict[str, str] | None = None,
    address: str = "0000:3b:00.0",
) -> DeviceRecord:
    addr = PciAddress.parse(address)
    return DeviceRecord(
        id=device_id_for(backend, addr),
        address=addr,
        identity=DeviceIdentity(vendor_id=vendor_id, device_id=device_id, class_code=0x030200),
        accel_class=accel_class,
        backend=backend,
        numa_node=0,
        iommu_group=42,
        expected_driver="vfio-pci",
        labels=labels if labels is not None else labels_for(vendor_id, device_id),
        state=DeviceState.ALLOCATABLE,
        generation=1,
        reason=None,
        sandbox_id=None,
        updated_at=time.time(),
    )


def report_from(fields: dict[str, Any]) -> GuestReport:
    """A report built in memory; its typed records (pci devices, libraries, cuda, nvml) read from the guest's JSON
    shapes. Other fields stay as given, malformed too: the judge (`guest_checks._sane`) must survive them."""
    libs, cuda, nvml = fields.get("libraries", {}), fields.get("cuda"), fields.get("nvml")
    if isinstance(libs, dict):
        libs = {k: LibraryInfo.from_json(v) if isinstance(v, dict) else v for k, v in libs.items()}
    pci = fields.get("pci_devices", ())
    if isinstance(pci, list | tuple):
        pci = tuple(GuestPciDevice.from_json(d) if isinstance(d, dict) else d for d in pci)
    typed = {
        "pci_devices": pci,
        "libraries": libs,
        "cuda": CudaInfo.from_json(cuda) if isinstance(cuda, dict) else cuda,
        "nvml": NvmlInfo.from_json(nvml) if isinstance(nvml, dict) else nvml,
    }
    return GuestReport(**{**fields, **typed})


def good_h100_report(**changes: Any) -> GuestReport:
    """What cube-agent reports from a healthy cuda12-h100 guest."""
    fields: dict[str, Any] = {
        "agent_version": 1,
        "kernel_release": "6.1.0-57-amd64",
        "modules_loaded": ("nvidia_uvm", "nvidia", "virtio_console"),
        "module_failures": {},
        "pci_devices": ({"address": "0000:01:00.0", "vendor_id": "10de", "device_id": "2331", "class": "030200"},),
        "device_files": {"/dev/nvidiactl": True, "/dev/nvidia0": True, "/dev/nvidia-uvm": True},
        "kernel_driver_version": "535.309.01",
        "libraries": {
            "libcuda.so.1": {"loaded": True, "version": "535.309.01", "error": None},
            "libnvidia-ml.so.1": {"loaded": True, "version": "535.309.01", "error": None},
        },
        "cuda": {"driver_version": 12020, "init_ok": True, "device_count": 1, "error": None},
    }
    fields.update(changes)
    return report_from(fields)


def good_edu_report(**changes: Any) -> GuestReport:
    fields: dict[str, Any] = {
        "agent_version": 1,
        "kernel_release": "6.1.0-57-amd64",
        "modules_loaded": ("virtio_console", "virtio_pci"),
        "pci_devices": ({"address": "0000:01:00.0", "vendor_id": "0x1234", "device_id": "0x11e8", "class": "00ff00"},),
    }
    fields.update(changes)
    return report_from(fields)
