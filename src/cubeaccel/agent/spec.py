"""The in-guest part of a compatibility contract, read from a plain JSON dict.

The agent cannot import pydantic, so it validates the handful of keys it needs by hand and
rejects anything it does not understand with a stable code, instead of probing for the wrong thing.

Three shapes are accepted (see docs/agent.md):
- a frozen contract (`CompatibilityContract.to_json()`): its `guest_probes` member is used;
- the guest probe spec alone (`GuestProbeSpec.to_json()`): `kernel_release`, `modules`, `kernel_driver`,
  `device_files`, `libraries` [{name, version, layer}], `pci`, `cuda` {version, min_driver_api};
- a hand-written form: `guest_kernel`, `probes` {modules, device_files, libraries, pci}, `kernel_driver`,
  `userspace_driver`, `cuda_runtime`.
Any of them may carry `persistence_mode: true`; the probe spec may carry `load_modules` (the template's
guest-init step: false means the modules must already be loaded, the agent runs no modprobe).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from cubeaccel.protocol.agent_messages import bad_contract

_HEX16 = re.compile(r"(?:0x)?([0-9a-fA-F]{4})")
_NAME = re.compile(r"[A-Za-z0-9_.+-]{1,128}")
_VERSION = re.compile(r"[A-Za-z0-9_.+~-]{1,64}")
_LAYERS = ("userspace_driver", "cuda_runtime", "kernel_driver", "modules_img")


@dataclass(frozen=True)
class PciExpectation:
    vendor_id: str  # 4 lower-case hex digits, as the report's pci_devices use
    device_id: str

    @property
    def label(self) -> str:
        return f"{self.vendor_id}:{self.device_id}"


@dataclass(frozen=True)
class LibraryExpectation:
    name: str  # soname, loaded with ctypes (libcuda.so.1)
    version: str | None  # the file's version (libcuda.so.550.54.15 → 550.54.15) must equal this, if given
    layer: str  # which layer a failure blames


# The agent's stdlib reading of what model/template_spec.ProbeSpec and the frozen contract say: the guest
# cannot import model/, so it parses the same JSON itself.
@dataclass(frozen=True)
class ProbeSpec:
    """What the guest must show. Empty fields mean "not checked"."""

    guest_kernel: str | None = None
    kernel_exact: bool = True  # the frozen contract names the full release; hand-written specs may use a prefix
    modules: tuple[str, ...] = ()
    driver_module: str | None = None  # the module that drives the device (nvidia)
    kernel_driver: str | None = None  # its version
    device_files: tuple[str, ...] = ()
    libraries: tuple[LibraryExpectation, ...] = ()
    pci: tuple[PciExpectation, ...] = ()  # any one of them must be visible
    userspace_driver: str | None = None  # hand-written form: checked against libcuda/NVML's version
    cuda_version: str | None = None
    min_driver_api: int | None = None  # cuDriverGetVersion must be >= this (12040 for 12.4)
    persistence_mode: bool = False
    load_modules: bool | None = None  # the contract's guest-init step; None: it does not say (agent default)

    @property
    def library_names(self) -> tuple[str, ...]:
        return tuple(lib.name for lib in self.libraries)

    @property
    def wants_cuda(self) -> bool:
        return self.min_driver_api is not None or "libcuda.so.1" in self.library_names

    @property
    def wants_nvml(self) -> bool:
        return self.persistence_mode or "libnvidia-ml.so.1" in self.library_names


def _str(value: object, what: str, pattern: re.Pattern[str] = _VERSION) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise bad_contract(f"{what} must be a short name or version string", key=what, value=repr(value)[:80])
    return value


def _version(data: dict[str, Any], key: str) -> str | None:
    section = data.get(key)
    if section is None:
        return None
    value = section.get("version") if isinstance(section, dict) else section
    return None if value is None else _str(value, f"{key}.version")


def _names(value: object, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad_contract(f"{key} must be a list of names", key=key)
    return tuple(_str(v, key, _NAME) for v in value)


def _device_files(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(p, str) and _device_file(p) for p in value):
        raise bad_contract("device_files must be a list of /dev/... paths")
    return tuple(value)


def _device_file(path: str) -> bool:
    return path.startswith("/dev/") and ".." not in path.split("/") and len(path) < 256 and "\x00" not in path


def _pci(value: object) -> tuple[PciExpectation, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad_contract("pci must be a list of {vendor_id, device_id}")
    out = []
    for item in value:
        if not isinstance(item, dict):
            raise bad_contract("pci entries must be objects", entry=repr(item)[:80])
        ids = []
        for key in ("vendor_id", "device_id"):
            m = _HEX16.fullmatch(str(item.get(key, "")))
            if m is None:
                raise bad_contract(f"pci.{key} must be 4 hex digits", entry=repr(item)[:80])
            ids.append(m[1].lower())
        out.append(PciExpectation(ids[0], ids[1]))
    return tuple(out)


def _persistence(data: dict[str, Any]) -> bool:
    value = data.get("persistence_mode", False)
    if not isinstance(value, bool):
        raise bad_contract("persistence_mode must be true or false")
    return value


def _min_api(version: str) -> int:
    major, minor = parse_cuda_version(version)
    return major * 1000 + minor * 10


def parse_spec(data: object) -> ProbeSpec:
    """Validate whichever of the three accepted shapes `data` is."""
    if not isinstance(data, dict):
        raise bad_contract("contract must be a JSON object")
    if "guest_probes" in data:
        inner = data["guest_probes"]
        if not isinstance(inner, dict):
            raise bad_contract("guest_probes must be an object")
        return _from_guest_probes({**inner, "persistence_mode": _persistence(data) or _persistence(inner)})
    if "probes" in data or "guest_kernel" in data:
        return _from_hand_written(data)
    return _from_guest_probes(data)


def _from_guest_probes(data: dict[str, Any]) -> ProbeSpec:
    kernel = data.get("kernel_release")
    driver = data.get("kernel_driver")
    if driver is not None and not isinstance(driver, dict):
        raise bad_contract("kernel_driver must be {module, version}")
    driver = driver or {}
    libraries = data.get("libraries") or []
    if not isinstance(libraries, list):
        raise bad_contract("libraries must be a list of {name, version, layer}")
    libs = []
    for lib in libraries:
        if not isinstance(lib, dict):
            raise bad_contract("libraries entries must be objects", entry=repr(lib)[:80])
        layer = lib.get("layer", "userspace_driver")
        if layer not in _LAYERS:
            raise bad_contract(f"libraries.layer must be one of {', '.join(_LAYERS)}", entry=repr(lib)[:80])
        version = lib.get("version")
        libs.append(
            LibraryExpectation(
                _str(lib.get("name"), "libraries.name", _NAME),
                None if version is None else _str(version, "libraries.version"),
                layer,
            )
        )
    cuda = data.get("cuda")
    if cuda is not None and not isinstance(cuda, dict):
        raise bad_contract("cuda must be {version, min_driver_api}")
    cuda_version = None if cuda is None else _str(cuda.get("version"), "cuda.version")
    min_api = None if cuda is None else cuda.get("min_driver_api")
    if cuda_version is not None and min_api is None:
        min_api = _min_api(cuda_version)
    if min_api is not None and (not isinstance(min_api, int) or isinstance(min_api, bool) or min_api < 1000):
        raise bad_contract("cuda.min_driver_api must be an integer like 12040")
    return ProbeSpec(
        guest_kernel=None if kernel is None else _str(kernel, "kernel_release"),
        modules=_names(data.get("modules"), "modules"),
        driver_module=None if not driver else _str(driver.get("module"), "kernel_driver.module", _NAME),
        kernel_driver=None if not driver else _str(driver.get("version"), "kernel_driver.version"),
        device_files=_device_files(data.get("device_files")),
        libraries=tuple(libs),
        pci=_pci(data.get("pci")),
        cuda_version=cuda_version,
        min_driver_api=min_api,
        persistence_mode=_persistence(data),
        load_modules=_load_modules(data),
    )


def _load_modules(data: dict[str, Any]) -> bool | None:
    value = data.get("load_modules")
    if value is not None and not isinstance(value, bool):
        raise bad_contract("load_modules must be true or false")
    return value


def _from_hand_written(data: dict[str, Any]) -> ProbeSpec:
    probes = data.get("probes", {})
    if not isinstance(probes, dict):
        raise bad_contract("probes must be an object")
    cuda = _version(data, "cuda_runtime")
    kernel_driver = _version(data, "kernel_driver")
    driver = data.get("kernel_driver")
    module = driver.get("module", "nvidia") if isinstance(driver, dict) else "nvidia"
    return ProbeSpec(
        guest_kernel=_version(data, "guest_kernel"),
        kernel_exact=False,
        modules=_names(probes.get("modules"), "probes.modules"),
        driver_module=None if kernel_driver is None else _str(module, "kernel_driver.module", _NAME),
        kernel_driver=kernel_driver,
        device_files=_device_files(probes.get("device_files")),
        libraries=tuple(
            LibraryExpectation(n, None, "userspace_driver") for n in _names(probes.get("libraries"), "probes.libraries")
        ),
        pci=_pci(probes.get("pci")),
        userspace_driver=_version(data, "userspace_driver"),
        cuda_version=cuda,
        min_driver_api=None if cuda is None else _min_api(cuda),
        persistence_mode=_persistence(data),
    )


def version_matches(expected: str, found: str | None) -> bool:
    """`expected` equals `found` or is a prefix ending at a component boundary: "6.1" matches "6.1.0-27-amd64"."""
    if found is None:
        return False
    if found == expected:
        return True
    return found.startswith(expected) and found[len(expected)] in ".-+~"


def parse_cuda_version(text: str) -> tuple[int, int]:
    """ "12.4" → (12, 4); raises on anything else so a bad contract is an error, not a silent pass."""
    m = re.fullmatch(r"(\d{1,3})(?:\.(\d{1,3}))?(?:\.\d+)*", text)
    if m is None:
        raise bad_contract("cuda version must look like 12.4", value=text)
    return int(m[1]), int(m[2] or 0)
