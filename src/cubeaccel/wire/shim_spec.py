"""The shim's input: the spec Cubelet writes for one sandbox, one pydantic model for both sides.

Cubelet builds a `ShimSpec` (the driver that launches a process adds where it lives and reports), writes it
as JSON, and the shim reads it back with `load_spec`. Every refusal is `shim.invalid_spec` with
details.field naming the field, because the spec crosses a process boundary and a wrong value must fail before
a VMM is started, never halfway through a hot-plug.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BeforeValidator,
    Field,
    PlainSerializer,
    SecretStr,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic import (
    Strict as StrictMode,
)

from cubeaccel.model.bars import BAR_COUNT, Bar
from cubeaccel.model.ids import SANDBOX_ID_RE
from cubeaccel.model.node_facts import DIGEST
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.base import Message, Strict, field_path
from cubeaccel.wire.frozen_contract import Contract

_START_ID = re.compile(r"[A-Za-z0-9-]{1,64}")
_QDEV_PROP = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
MAX_DEVICES = 16  # root ports per VM; fixed so template state matches every sandbox's machine (decisions.md)
SHIM_LIMITS = {"max_devices": MAX_DEVICES}  # validation context for a spec a real shim runs


def bad_spec(field_name: str, message: str) -> CubeError:
    return CubeError(
        "shim.invalid_spec", f"{field_name}: {message}", layer="template", details={"field": field_name}, status=422
    )


def _hex16(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 0xFFFF:
        return value
    if isinstance(value, str) and re.fullmatch(r"(?:0x)?[0-9a-fA-F]{4}", value):
        return int(value[-4:], 16)
    raise ValueError(f"must be a 16-bit PCI id (4 hex digits), got {value!r:.40}")


def _abs_path(value: object) -> object:
    if isinstance(value, Path):
        value = str(value)
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
        raise ValueError("must be an absolute path")
    return Path(value)


def _qdev_name(value: object) -> object:
    if not isinstance(value, str) or not _QDEV_PROP.fullmatch(value):
        raise ValueError(f"not a device driver name: {value!r:.40}")
    return value


def _bar(value: object) -> object:
    return value if isinstance(value, Bar) else Bar.from_json(value)


# A BAR as discovery recorded it (`model.bars.Bar`), as its JSON object on the wire.
BarField = Annotated[Bar, BeforeValidator(_bar), PlainSerializer(lambda b: b.to_json(), return_type=dict)]
Bars = Annotated[tuple[BarField, ...], Field(max_length=BAR_COUNT)]


# Written as Cubelet always wrote them ("10de"); read as 4 hex digits, 0x-prefixed or not, or a JSON integer.
PciId = Annotated[int, BeforeValidator(_hex16), PlainSerializer(lambda v: f"{v:04x}", return_type=str)]
AbsPath = Annotated[Path, BeforeValidator(_abs_path)]
Seconds = Annotated[float, StrictMode(), Field(gt=0, le=3600)]


MAX_MEMORY_FILE = 64 << 20  # a stand-in's remembering memory stays small: a VMM with mem-lock locks it too


class MemoryFile(Strict):
    """The host file behind a stand-in's device memory (QEMU `memory-backend-file,share=on`): the device's own, kept
    across sandboxes (backends/emulated.py). The shim adds it as an object before `device_add` (`memdev`)."""

    path: AbsPath
    size: Annotated[StrictInt, Field(ge=4096, le=MAX_MEMORY_FILE)]


# Not backends/vfio_spec.DeviceSpec (an operator's allow-list entry, vendor:device[@address]): this is one
# device the shim hot-plugs, as the Cubelet hands it over.
class DeviceSpec(Strict):
    device_id: Annotated[StrictStr, Field(min_length=1, max_length=128)]  # Cubelet's id: emulated-0000:e0:00.0
    driver: Annotated[str, BeforeValidator(_qdev_name)]  # QMP device_add driver: edu, vfio-pci
    properties: dict[str, str] = {}
    vendor_id: PciId
    device_id_hex: PciId  # the PCI device id the guest must see
    address: StrictStr | None = None  # the host PCI address (Cubelet's; the shim attaches by `properties`)
    # Its BARs as discovery read them: the machine is shaped for them, and attach is confirmed only when the guest
    # placed each memory BAR at its size. Empty (a record from before BARs were read): vendor:device only.
    bars: Bars = ()
    numa_node: Annotated[StrictInt, Field(ge=-1, le=1023)] | None = None  # the host's; -1: sysfs knows none
    memory_file: MemoryFile | None = None  # device memory that outlives the VMM (the ivshmem-plain stand-in)

    @field_validator("properties", mode="before")
    @classmethod
    def _plain_properties(cls, value: object) -> object:
        if (
            not isinstance(value, dict)
            or not all(
                isinstance(k, str) and _QDEV_PROP.fullmatch(k) and isinstance(v, str) and _QDEV_PROP.fullmatch(v)
                for k, v in value.items()
            )
            or {"id", "bus", "driver"} & set(value)
        ):
            raise ValueError("must map names to plain values (id/bus/driver are the shim's)")
        return value

    @property
    def vendor_device(self) -> str:
        return f"{self.vendor_id:04x}:{self.device_id_hex:04x}"


class NetSpec(Strict):
    """The sandbox's network as Cubelet built it (host/net/netpolicy.py): the shim opens `tap` inside `netns`."""

    netns: AbsPath  # /run/netns/cube-<sandbox>
    tap: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,15}$")]
    guest_cidr: Annotated[StrictStr, Field(pattern=r"^[0-9.]{7,15}/[0-9]{1,2}$")]
    gateway: Annotated[StrictStr, Field(pattern=r"^[0-9.]{7,15}$")]
    mac: Annotated[StrictStr, Field(pattern=r"^([0-9a-f]{2}:){5}[0-9a-f]{2}$")]


class MountSpec(Strict):
    """A read-only host directory for the guest: allowlisted on the node, checked by Cubelet before it gets here."""

    source: AbsPath
    target: Annotated[StrictStr, Field(pattern=r"^/[A-Za-z0-9_./-]{1,200}$")]


class ShimSpec(Message):
    """What one shim run does. Cubelet's lifecycle fills the sandbox's half; the process driver adds
    `state_dir`, `report`, `start`, the timeouts and `image_check` before writing the file."""

    sandbox_id: StrictStr
    devices: tuple[DeviceSpec, ...] = ()
    memory_mib: Annotated[StrictInt, Field(ge=64, le=4 * 1024 * 1024)]
    vcpus: Annotated[StrictInt, Field(ge=1, le=256)] = 1
    pin_memory: StrictBool = True
    # The sandbox's frozen contract, parsed (a tampered or malformed one fails here, before any VM); written to
    # the file and sent to cube-agent as the JSON it came as.
    contract: Contract | None = None
    start_id: Annotated[StrictStr, Field(pattern=_START_ID.pattern)] | None = None  # echoed in every report
    image_digest: Annotated[StrictStr, Field(pattern=f"^{DIGEST.pattern}$")] | None = None  # the guest to boot
    hotplug: StrictBool = True  # the contract's attach expectation: true = hot-plug after boot (the only path)
    image_manifest: AbsPath | None = None  # an explicit image (tools, benchmarks); None: the cache's image_digest
    start: Literal["cold", "template"] = "cold"
    state_dir: AbsPath | None = None  # required by the shim (load_spec); set by the driver that launches it
    report: dict[str, str] | None = None  # {"socket": PATH} or {"file": PATH}; required by the shim
    detach_timeout_s: Seconds = 10.0
    boot_timeout_s: Seconds = 60.0
    memory_backend: Literal["ram", "memfd", "hugepages"] = "ram"
    image_check: Literal["report", "enforce"] = "report"  # enforce: a mismatch fails before the VM starts
    # Bridge the guest's workload service to `workload.sock`; its access token comes on the shim's stdin (one
    # line), never in this file: the host keeps only its hash.
    workload: StrictBool = False
    # A warm start (docs/warm.md): no token comes; the bridge binds an unknowable one (so the workload service
    # refuses every request) and the shim listens on `control.sock` for the claim that brings the tenant's.
    warm: StrictBool = False
    # A trusted scrub VM (cubelet/scrub.py): after attach, ask the agent to scrub the device this way, report
    # `scrub_finished`, and exit. Never set for a tenant's sandbox (no workload channel either).
    scrub: Literal["bar", "bar-memory", "cuda"] | None = None
    # The registry's parameters for that method (backends/scrub_methods.py: `layout`, `resource`), sent to the agent
    # unchanged with the device's guest address: the shim makes no device decision of its own.
    scrub_params: dict[
        Annotated[StrictStr, Field(pattern=r"^[a-z_]{1,32}$")], Annotated[StrictStr, Field(max_length=64)]
    ] = {}
    # In memory only (Cubelet → its process driver → the shim's stdin): never dumped, so never in the spec file.
    workload_token: SecretStr | None = Field(default=None, exclude=True)
    # The request that started it (CubeMaster's create, through Cubelet): on the shim's log lines and reports.
    request_id: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9._:-]{1,128}$")] | None = None
    # The sandbox policy's devices (model/sandbox_policy.py); a VM with any of them is always cold-booted.
    network: NetSpec | None = None  # None: no NIC at all
    scratch_mib: Annotated[StrictInt, Field(ge=16, le=16 * 1024 * 1024)] | None = None
    readonly_mounts: tuple[MountSpec, ...] = Field(default=(), max_length=8)
    # BAR layouts of every device on the node the contract admits: a template start shapes each root port for the
    # largest, so one template state fits whichever of them a sandbox gets (model/bars.py `uniform_shape`).
    template_bars: tuple[Bars, ...] = Field(default=(), max_length=64)

    @property
    def boot_image_digest(self) -> str | None:
        """The guest image this sandbox boots: the spec's, else the one its contract pins (None: the default)."""
        pinned = None if self.contract is None else self.contract.template.guest_image_digest
        return self.image_digest or pinned

    @property
    def policy_devices(self) -> bool:
        return self.network is not None or self.scratch_mib is not None or bool(self.readonly_mounts)

    @field_validator("sandbox_id")
    @classmethod
    def _sandbox_id(cls, value: str) -> str:
        """Sandbox ids end up in argv tags, file names and /proc scans: letters, digits, `_.-`, ≤ 63."""
        if not SANDBOX_ID_RE.fullmatch(value):
            raise ValueError(f"must match {SANDBOX_ID_RE.pattern}, got {value!r:.80}")
        return value

    @field_validator("devices", mode="before")
    @classmethod
    def _few(cls, value: object, info: ValidationInfo) -> object:
        """The count first: five malformed devices are "too many devices", not a complaint about the first.

        The bound is the shim's machine (MAX_DEVICES root ports), given as `context={"max_devices": n}` where a
        spec is read for a real shim; a simulated node's shim takes more."""
        limit = (info.context or {}).get("max_devices")
        if not isinstance(value, list | tuple) or (limit is not None and len(value) > limit):
            raise ValueError(f"must be a list of at most {limit} devices")
        return value

    @field_validator("devices")
    @classmethod
    def _distinct(cls, value: tuple[DeviceSpec, ...]) -> tuple[DeviceSpec, ...]:
        if len({d.device_id for d in value}) != len(value):
            raise ValueError("device ids must be distinct")
        return value

    @field_validator("report", mode="before")
    @classmethod
    def _one_target(cls, value: object) -> object:
        if value is None:
            return value
        if not isinstance(value, dict) or len(value) != 1 or not {"socket", "file"} & set(value):
            raise ValueError('must be {"socket": PATH} or {"file": PATH}')
        target = next(iter(value.values()))
        if not isinstance(target, str) or not target.startswith("/"):
            raise ValueError("path must be absolute")
        return value

    @property
    def run_dir(self) -> Path:
        """The shim's state directory; parse_spec has made sure there is one."""
        if self.state_dir is None:
            raise bad_spec("state_dir", "must be an absolute path")
        return self.state_dir

    @property
    def report_socket(self) -> Path | None:
        return Path(self.report["socket"]) if self.report and "socket" in self.report else None

    @property
    def report_file(self) -> Path | None:
        return Path(self.report["file"]) if self.report and "file" in self.report else None

    def to_json(self) -> dict[str, object]:
        return self.model_dump(mode="json")


def spec_error(e: ValidationError) -> CubeError:
    """The outermost failure names the field (a list too long before the items in it)."""
    errs = sorted(e.errors(), key=lambda x: len(x["loc"]))
    first = errs[0]
    name = field_path(first["loc"]) or "spec"
    msg = first["msg"].removeprefix("Value error, ")
    return bad_spec(name, msg + (f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""))


def parse_spec(data: object) -> ShimSpec:
    """A spec the shim can run: valid, and saying where the shim keeps its state and sends its reports."""
    if not isinstance(data, dict):
        raise bad_spec("spec", "must be a JSON object")
    try:
        spec = ShimSpec.model_validate(data, context=SHIM_LIMITS)
    except ValidationError as e:
        raise spec_error(e) from e
    if spec.state_dir is None:
        raise bad_spec("state_dir", "must be an absolute path")
    if spec.report is None:
        raise bad_spec("report", 'must be {"socket": PATH} or {"file": PATH}')
    return spec


def load_spec(path: Path) -> ShimSpec:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CubeError("shim.invalid_spec", f"cannot read spec {path}: {e}", layer="template", status=422) from e
    return parse_spec(data)
