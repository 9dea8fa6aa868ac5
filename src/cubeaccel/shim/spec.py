"""The shim's input: the spec file Cubelet writes for one sandbox, validated field by field.

Every field is checked here with a stable code (`shim.invalid_spec`, details.field) because the spec crosses a
process boundary and a wrong value must fail before a VMM is started, never halfway through a hot-plug.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cubeaccel.model.errors import CubeError
from cubeaccel.model.ids import SANDBOX_ID_RE
from cubeaccel.model.node_facts import DIGEST

_SANDBOX_ID = SANDBOX_ID_RE
_START_ID = re.compile(r"[A-Za-z0-9-]{1,64}")
_QDEV_PROP = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
MAX_DEVICES = 4  # root ports per VM; fixed so template state matches every sandbox's machine


def bad_spec(field_name: str, message: str) -> CubeError:
    return CubeError(
        "shim.invalid_spec", f"{field_name}: {message}", layer="template", details={"field": field_name}, status=422
    )


def valid_sandbox_id(value: object) -> str:
    """Sandbox ids end up in argv tags, file names and /proc scans: letters, digits, `_.-`, ≤ 64."""
    if not isinstance(value, str) or not _SANDBOX_ID.fullmatch(value):
        raise bad_spec("sandbox_id", f"must match {_SANDBOX_ID.pattern}, got {value!r:.80}")
    return value


@dataclass(frozen=True)
class DeviceSpec:
    device_id: str  # Cubelet's id, e.g. emulated-0000:e0:00.0
    driver: str  # QMP device_add driver: edu, vfio-pci
    properties: dict[str, str]
    vendor_id: int
    device_id_hex: int  # the PCI device id the guest must see

    @property
    def vendor_device(self) -> str:
        return f"{self.vendor_id:04x}:{self.device_id_hex:04x}"


@dataclass(frozen=True)
class ShimSpec:
    sandbox_id: str
    devices: tuple[DeviceSpec, ...]
    memory_mib: int
    vcpus: int
    pin_memory: bool
    contract: dict[str, Any] | None
    image_manifest: Path | None  # an explicit image (tools, benchmarks); None: the cached image `image_digest`
    start: str  # cold | template
    state_dir: Path
    report_socket: Path | None
    report_file: Path | None
    detach_timeout_s: float
    boot_timeout_s: float = 60.0
    memory_backend: str = "ram"
    image_check: str = "report"  # report: mismatches go into vm_started; enforce: fail before the VM starts
    start_id: str | None = None  # Cubelet's nonce for this start; echoed in every report
    image_digest: str | None = None  # the guest to boot from the image cache (the contract's pin, or the default)
    hotplug: bool = True  # the contract's attach expectation: true = hot-plug after boot (the only path)
    extra: dict[str, Any] = field(default_factory=dict)


def _hex16(name: str, value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 0xFFFF:
        return value
    if isinstance(value, str) and re.fullmatch(r"(?:0x)?[0-9a-fA-F]{4}", value):
        return int(value[-4:], 16)
    raise bad_spec(name, f"must be a 16-bit PCI id (4 hex digits), got {value!r:.40}")


def _device(i: int, d: object) -> DeviceSpec:
    where = f"devices[{i}]"
    if not isinstance(d, dict):
        raise bad_spec(where, "must be an object")
    dev_id, driver, props = d.get("device_id"), d.get("driver"), d.get("properties", {})
    if not isinstance(dev_id, str) or not 0 < len(dev_id) <= 128:
        raise bad_spec(f"{where}.device_id", "must be a non-empty string")
    if not isinstance(driver, str) or not _QDEV_PROP.fullmatch(driver):
        raise bad_spec(f"{where}.driver", f"not a device driver name: {driver!r:.40}")
    if (
        not isinstance(props, dict)
        or not all(
            isinstance(k, str) and _QDEV_PROP.fullmatch(k) and isinstance(v, str) and _QDEV_PROP.fullmatch(v)
            for k, v in props.items()
        )
        or {"id", "bus", "driver"} & set(props)
    ):
        raise bad_spec(f"{where}.properties", "must map names to plain values (id/bus/driver are the shim's)")
    return DeviceSpec(
        dev_id,
        driver,
        dict(props),
        _hex16(f"{where}.vendor_id", d.get("vendor_id")),
        _hex16(f"{where}.device_id_hex", d.get("device_id_hex")),
    )


def parse_spec(data: object) -> ShimSpec:
    if not isinstance(data, dict):
        raise bad_spec("spec", "must be a JSON object")
    devices_raw = data.get("devices", [])
    if not isinstance(devices_raw, list) or len(devices_raw) > MAX_DEVICES:
        raise bad_spec("devices", f"must be a list of at most {MAX_DEVICES} devices")
    devices = tuple(_device(i, d) for i, d in enumerate(devices_raw))
    if len({d.device_id for d in devices}) != len(devices):
        raise bad_spec("devices", "device ids must be distinct")
    mem, vcpus = data.get("memory_mib"), data.get("vcpus", 1)
    if not isinstance(mem, int) or isinstance(mem, bool) or not 64 <= mem <= 4 * 1024 * 1024:
        raise bad_spec("memory_mib", f"must be an integer 64..4194304, got {mem!r:.40}")
    if not isinstance(vcpus, int) or isinstance(vcpus, bool) or not 1 <= vcpus <= 256:
        raise bad_spec("vcpus", f"must be an integer 1..256, got {vcpus!r:.40}")
    pin = data.get("pin_memory", True)
    if not isinstance(pin, bool):
        raise bad_spec("pin_memory", "must be true or false")
    contract = data.get("contract")
    if contract is not None and not isinstance(contract, dict):
        raise bad_spec("contract", "must be an object or null")
    start = data.get("start", "cold")
    if start not in ("cold", "template"):
        raise bad_spec("start", f"must be cold or template, got {start!r:.40}")
    paths: dict[str, Path | None] = {}
    for key in ("image_manifest", "state_dir"):
        value = data.get(key)
        if value is None and key == "image_manifest":
            paths[key] = None
            continue
        if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
            raise bad_spec(key, "must be an absolute path")
        paths[key] = Path(value)
    state_dir = paths["state_dir"]
    assert state_dir is not None
    report = data.get("report")
    if not isinstance(report, dict) or len(report) != 1 or not {"socket", "file"} & set(report):
        raise bad_spec("report", 'must be {"socket": PATH} or {"file": PATH}')
    target = next(iter(report.values()))
    if not isinstance(target, str) or not target.startswith("/"):
        raise bad_spec("report", "path must be absolute")
    timeouts = {}
    for key, default in (("detach_timeout_s", 10.0), ("boot_timeout_s", 60.0)):
        value = data.get(key, default)
        if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value <= 3600:
            raise bad_spec(key, f"must be seconds in (0, 3600], got {value!r:.40}")
        timeouts[key] = float(value)
    memory_backend = data.get("memory_backend", "ram")
    if memory_backend not in ("ram", "memfd", "hugepages"):
        raise bad_spec("memory_backend", f"must be ram, memfd or hugepages, got {memory_backend!r:.40}")
    start_id = data.get("start_id")
    if start_id is not None and (not isinstance(start_id, str) or not _START_ID.fullmatch(start_id)):
        raise bad_spec("start_id", "must be 1-64 letters, digits or '-'")
    image_digest = data.get("image_digest")
    if image_digest is not None and (not isinstance(image_digest, str) or not DIGEST.fullmatch(image_digest)):
        raise bad_spec("image_digest", "must be sha256:<64 hex> or null")
    hotplug = data.get("hotplug", True)
    if not isinstance(hotplug, bool):
        raise bad_spec("hotplug", "must be true or false")
    image_check = data.get("image_check", "report")
    if image_check not in ("report", "enforce"):
        raise bad_spec("image_check", f"must be report or enforce, got {image_check!r:.40}")
    return ShimSpec(
        image_digest=image_digest,
        hotplug=hotplug,
        start_id=start_id,
        image_check=image_check,
        memory_backend=memory_backend,
        sandbox_id=valid_sandbox_id(data.get("sandbox_id")),
        devices=devices,
        memory_mib=mem,
        vcpus=vcpus,
        pin_memory=pin,
        contract=contract,
        image_manifest=paths["image_manifest"],
        start=start,
        state_dir=state_dir,
        report_socket=Path(target) if "socket" in report else None,
        report_file=Path(target) if "file" in report else None,
        detach_timeout_s=timeouts["detach_timeout_s"],
        boot_timeout_s=timeouts["boot_timeout_s"],
    )


def load_spec(path: Path) -> ShimSpec:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CubeError("shim.invalid_spec", f"cannot read spec {path}: {e}", layer="template", status=422) from e
    return parse_spec(data)
