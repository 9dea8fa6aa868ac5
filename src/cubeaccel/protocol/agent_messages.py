"""cube-agent's protocol messages, one typed record per request, reply and result, held by both ends.

The agent (guest, stdlib only) parses requests with these and answers with their `to_json()`; the shim parses the
replies with them. Two rules, because the two ends do not trust each other alike:

- params (`*Params.from_json`) are strict: what the agent would refuse raises `agent.invalid_params` (or
  `agent.invalid_contract`) with the message the agent has always sent;
- results (`*Result.from_json`) are lenient: a guest is untrusted, and a field it gets wrong reads as absent
  (None) so the host judges it, instead of a parse error hiding what the rest of the reply said.

`to_json()` writes the same keys in the same order the agent and shim always wrote: old guest images in the
cache speak to new shims and back (tests/unit/test_agent_messages.py holds the bytes).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeGuard

from cubeaccel.protocol.agent_protocol import MAX_DEADLINE_SCALE, PROTOCOL_VERSION
from cubeaccel.protocol.errors import CubeError
from cubeaccel.protocol.reports import ProbeResult

METHODS = ("hello", "probe", "load_modules", "scrub", "shutdown", "wait_pci", "pci_resources", "reseed")
PCI_ADDRESS = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[01][0-9a-f]\.[0-7]")
PCI_ID = re.compile(r"[0-9a-f]{4}")
SEED_HEX = re.compile(r"[0-9a-f]{64}")  # 32 bytes: what a warm claim carries (wire/warm.RNG_SEED)
BAR_RESOURCES = frozenset(f"resource{i}" for i in range(6))
SCRUB_LAYOUTS = frozenset({"edu"})  # agent/scrub.LAYOUTS' names
MAX_KNOWN = 1024
MAX_WAIT_S = 30.0
MAX_ID_CHARS = 128

RequestId = int | str | None
Json = Mapping[str, object]  # a decoded JSON object, read field by field (a field is whatever the peer sent)


def protocol_error(code: str, message: str, **details: object) -> CubeError:
    return CubeError(code, message, layer="agent", details=details, status=400)


def invalid_params(message: str) -> CubeError:
    return protocol_error("agent.invalid_params", message)


def bad_contract(message: str, **details: object) -> CubeError:
    return CubeError("agent.invalid_contract", message, layer="template", details=details, status=422)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_object(value: object) -> TypeGuard[dict[str, object]]:
    """A JSON object (the decoder's keys are always strings)."""
    return isinstance(value, dict)


def _is_list(value: object) -> TypeGuard[list[object]]:
    return isinstance(value, list)


def _flag(data: Json, key: str, default: bool) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise invalid_params(f"{key} must be true or false")
    return value


def _deadline_scale(data: Json) -> float | None:
    """`deadline_scale` as sent (None: absent, an older shim's request): a number from 1 to MAX_DEADLINE_SCALE."""
    if "deadline_scale" not in data:
        return None
    value = data["deadline_scale"]
    if not _is_number(value) or not 1.0 <= value <= MAX_DEADLINE_SCALE:
        raise invalid_params(f"deadline_scale must be a number from 1 to {MAX_DEADLINE_SCALE:g}")
    return float(value)


def _address(value: object) -> str | None:
    return value if isinstance(value, str) and PCI_ADDRESS.fullmatch(value) else None


# ---- lenient readers for what a guest sends ------------------------------------------------------------------
def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _int(value: object) -> int | None:
    return value if _is_int(value) else None


def _num(value: object) -> float | None:
    return value if _is_number(value) else None


def _strs(value: object) -> tuple[str, ...] | None:
    return tuple(v for v in value if isinstance(v, str)) if isinstance(value, list | tuple) else None


def _obj(value: object) -> dict[str, object]:
    return value if _is_object(value) else {}


def _probe_result(value: object) -> ProbeResult | None:
    """None unless an object with ProbeResult's fields (`ProbeResult.from_json` itself is strict)."""
    if not _is_object(value):
        return None
    try:
        return ProbeResult.from_json(value)
    except TypeError:
        return None


def _addresses(value: object) -> tuple[str, ...] | None:
    """None unless a list of at most MAX_KNOWN PCI addresses."""
    if not _is_list(value) or len(value) > MAX_KNOWN:
        return None
    found = tuple(a for a in map(_address, value) if a is not None)
    return found if len(found) == len(value) else None


# ---- a PCI function as the guest kernel lists it ------------------------------------------------------------
# Hot-plug's answer, untrusted; host/pci/base.PciFunction is the host's own sysfs record (parsed ints).
@dataclass(frozen=True)
class PciFunction:
    """{"address", "vendor_id", "device_id", "class"}: sysfs's words, hex without 0x. Untrusted on the host: the
    shim checks vendor:device and novelty itself."""

    address: str
    vendor_id: str
    device_id: str
    class_: str | None = None

    @property
    def vendor_device(self) -> str:
        return f"{self.vendor_id}:{self.device_id}".lower()

    def to_json(self) -> dict[str, str | None]:
        return {"address": self.address, "vendor_id": self.vendor_id, "device_id": self.device_id, "class": self.class_}

    @classmethod
    def from_json(cls, data: object) -> PciFunction | None:
        """None unless address, vendor_id and device_id are strings (a guest's other shapes name no function)."""
        if not _is_object(data):
            return None
        address, vendor, device = data.get("address"), data.get("vendor_id"), data.get("device_id")
        if not (isinstance(address, str) and isinstance(vendor, str) and isinstance(device, str)):
            return None
        return cls(address, vendor, device, _str(data.get("class")))


# ---- envelopes -----------------------------------------------------------------------------------------------
def request_id(data: Json) -> RequestId:
    """The request's id, read before anything else is judged: every error reply names the request it answers."""
    rid = data.get("id")
    if rid is None or ((_is_int(rid) or isinstance(rid, str)) and len(str(rid)) <= MAX_ID_CHARS):
        return rid
    raise protocol_error("agent.bad_request", "id must be an integer or a string of at most 128 characters")


@dataclass(frozen=True)
class Request:
    """{"v", "id", "method", "params"}; `params` is decoded per method (`PARAMS`)."""

    id: RequestId
    method: str
    params: Json = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {"v": PROTOCOL_VERSION, "id": self.id, "method": self.method, "params": self.params}

    @classmethod
    def from_json(cls, data: Json) -> Request:
        rid = request_id(data)
        version = data.get("v", PROTOCOL_VERSION)
        if version != PROTOCOL_VERSION or isinstance(version, bool):
            raise protocol_error(
                "agent.unsupported_version",
                f"protocol version {str(version)[:32]!r} not supported",
                supported=[PROTOCOL_VERSION],
            )
        method = data.get("method")
        if not isinstance(method, str) or method not in METHODS:
            raise protocol_error("agent.unknown_method", f"unknown method {str(method)[:64]!r}", methods=list(METHODS))
        params = data.get("params") or {}
        if not _is_object(params):
            raise invalid_params("params must be an object")
        return cls(rid, method, params)


# The agent protocol's answer line; wire/base.Reply is the base of HTTP reply bodies and workload/app.Reply
# anything the workload service can serialize: three different things.
@dataclass(frozen=True)
class Reply:
    """One answer: a result (`ok`) or an error, never both. `result` stays the method's JSON object: the caller
    who knows the method reads it with that method's result type."""

    id: RequestId
    result: Json | None = None
    error: CubeError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, object]:
        if self.error is not None:
            return {"v": PROTOCOL_VERSION, "id": self.id, "ok": False, **self.error.to_json()}
        return {"v": PROTOCOL_VERSION, "id": self.id, "ok": True, "result": self.result}


@dataclass(frozen=True)
class ReplyError:
    """An error reply as the guest wrote it (untrusted: the host decides what its code may mean)."""

    code: str
    message: str
    details: Json | None


def read_reply(data: Json) -> tuple[object, dict[str, object] | ReplyError | None]:
    """A reply line from the guest: its id as sent (the caller compares it with its own), and its result object
    ({} when the result is not one), its error, or None when it is neither (an unreadable error reply)."""
    rid = data.get("id")
    if data.get("ok") is True:
        return rid, _obj(data.get("result"))
    err = data.get("error")
    if not _is_object(err):
        return rid, None
    details = err.get("details")
    return rid, ReplyError(
        str(err.get("code", "agent.error"))[:100],
        str(err.get("message", ""))[:1000],
        details if _is_object(details) else None,
    )


# ---- hello, and the ready event that carries it --------------------------------------------------------------
@dataclass(frozen=True)
class HelloResult:
    """Who answers: versions, methods, the boot and the PCI functions there before any hot-plug. A field the
    guest sent mistyped reads as None; `pci_addresses` is None (and left out) for agents older than `wait_pci`."""

    agent_version: int | None = None
    protocol: int | None = None
    methods: tuple[str, ...] | None = None
    kernel_release: str | None = None
    boot_id: str | None = None  # None: unreadable in the guest
    pid: int | None = None
    uptime_s: float | None = None
    pci_addresses: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "agent_version": self.agent_version,
            "protocol": self.protocol,
            "methods": None if self.methods is None else list(self.methods),
            "kernel_release": self.kernel_release,
            "boot_id": self.boot_id,
            "pid": self.pid,
            "uptime_s": self.uptime_s,
        }
        return out if self.pci_addresses is None else {**out, "pci_addresses": list(self.pci_addresses)}

    @classmethod
    def from_json(cls, data: Json) -> HelloResult:
        return cls(
            agent_version=_int(data.get("agent_version")),
            protocol=_int(data.get("protocol")),
            methods=_strs(data.get("methods")),
            kernel_release=_str(data.get("kernel_release")),
            boot_id=_str(data.get("boot_id")),
            pid=_int(data.get("pid")),
            uptime_s=_num(data.get("uptime_s")),
            pci_addresses=_strs(data.get("pci_addresses")),
        )


@dataclass(frozen=True)
class ReadyEvent:
    """Sent unasked when serving starts (and on a port, after the host comes back)."""

    hello: HelloResult

    def to_json(self) -> dict[str, object]:
        return {"v": PROTOCOL_VERSION, "event": "ready", "result": self.hello.to_json()}

    @classmethod
    def from_json(cls, data: Json) -> ReadyEvent:
        return cls(HelloResult.from_json(_obj(data.get("result"))))


def _contract(data: Json) -> dict[str, object] | None:
    """`contract` as sent (None: absent, the agent's default applies); an explicit null names none at all."""
    contract = data.get("contract")
    if "contract" in data and contract is None:
        raise bad_contract("no contract in the request and none configured with --contract")
    if contract is None:
        return None
    if not _is_object(contract):
        raise bad_contract("contract must be a JSON object")
    return contract


# ---- probe ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProbeParams:
    """`contract`: a frozen contract, template document or probe spec (agent/spec.py reads all three); None:
    the agent's own default. `load_modules`: None lets the agent decide."""

    contract: dict[str, object] | None = None  # free-form here: agent/spec.py reads it
    load_modules: bool | None = None
    deadline_scale: float | None = None  # the host's load stretch (agent_protocol.deadline_scale); None: 1

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {} if self.contract is None else {"contract": self.contract}
        out = out if self.load_modules is None else {**out, "load_modules": self.load_modules}
        return out if self.deadline_scale is None else {**out, "deadline_scale": self.deadline_scale}

    @classmethod
    def from_json(cls, data: Json) -> ProbeParams:
        flag = _flag(data, "load_modules", True) if "load_modules" in data else None
        return cls(_contract(data), flag, _deadline_scale(data))


@dataclass(frozen=True)
class ProbeReply:
    """The agent's verdict and the raw facts. `report` (GuestReport JSON) and `violations` travel on to the
    Cubelet as the guest wrote them: it parses and judges them itself (cubelet/lifecycle._judge_guest)."""

    ok: bool
    failed: tuple[str, ...] = ()
    failed_layers: tuple[str, ...] = ()
    report: dict[str, object] | None = None
    violations: list[object] | None = None
    contract_check: str | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "failed": list(self.failed),
            "failed_layers": list(self.failed_layers),
            "report": self.report,
            "violations": self.violations,
            "contract_check": self.contract_check,
        }

    @classmethod
    def from_json(cls, data: Json) -> ProbeReply:
        report, violations = data.get("report"), data.get("violations")
        return cls(
            ok=data.get("ok") is True,
            failed=_strs(data.get("failed")) or (),
            failed_layers=_strs(data.get("failed_layers")) or (),
            report=report if _is_object(report) else None,
            violations=violations if _is_list(violations) else None,
            contract_check=_str(data.get("contract_check")),
        )

    def pci_devices(self) -> list[PciFunction]:
        """The report's PCI functions, those that read as one."""
        devices = (self.report or {}).get("pci_devices")
        found = (PciFunction.from_json(d) for d in devices) if _is_list(devices) else ()
        return [d for d in found if d is not None]


# ---- load_modules --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadModulesParams:
    """`modules` is checked by the contract's own name rules (agent/spec.py); None: the contract's modules."""

    modules: object = None
    contract: dict[str, object] | None = None
    deadline_scale: float | None = None  # as ProbeParams'

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {} if self.modules is None else {"modules": self.modules}
        out = out if self.contract is None else {**out, "contract": self.contract}
        return out if self.deadline_scale is None else {**out, "deadline_scale": self.deadline_scale}

    @classmethod
    def from_json(cls, data: Json) -> LoadModulesParams:
        modules = data.get("modules")
        return cls(modules, None if modules is not None else _contract(data), _deadline_scale(data))


@dataclass(frozen=True)
class LoadModulesResult:
    ok: bool
    failures: dict[str, str] = field(default_factory=dict)
    modules_loaded: tuple[str, ...] = ()
    probes: tuple[ProbeResult, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "failures": dict(self.failures),
            "modules_loaded": list(self.modules_loaded),
            "probes": [p.to_json() for p in self.probes],
        }

    @classmethod
    def from_json(cls, data: Json) -> LoadModulesResult:
        probes = data.get("probes")
        found = (_probe_result(p) for p in probes) if _is_list(probes) else ()
        return cls(
            ok=data.get("ok") is True,
            failures={k: str(v) for k, v in _obj(data.get("failures")).items()},
            modules_loaded=_strs(data.get("modules_loaded")) or (),
            probes=tuple(p for p in found if p is not None),
        )


# ---- scrub ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScrubParams:
    """docs/scrub.md. Read by the agent only: the shim sends the registry's parameters for the method unchanged
    (wire/shim_spec.ShimSpec.scrub_params) and the host judges the result as wire/scrub.ScrubReport. The agent
    loads `modules` before it reads the rest (a driver that did not load fails the scrub whatever was asked)."""

    method: object = None
    modules: object = None  # a vendor image's driver: names checked by agent/spec.py
    address: str | None = None  # bar, bar-memory
    resource: str = "resource2"  # bar-memory
    layout: str = "edu"  # bar
    max_bytes: int | None = None  # cuda
    device: int = 0  # cuda
    timeout_s: float = 600.0  # cuda

    @classmethod
    def from_json(cls, data: Json) -> ScrubParams:
        """Only the fields of the method asked for are judged, with that method's message."""
        method, modules = data.get("method"), data.get("modules")
        if method == "bar-memory":
            address, resource = _address(data.get("address")), data.get("resource", "resource2")
            if address is None or not isinstance(resource, str) or resource not in BAR_RESOURCES:
                raise invalid_params("scrub bar-memory needs a PCI address and resource0..5")
            return cls(method, modules, address=address, resource=resource)
        if method == "bar":
            address, layout = _address(data.get("address")), data.get("layout", "edu")
            if address is None or not isinstance(layout, str) or layout not in SCRUB_LAYOUTS:
                raise invalid_params("scrub bar needs a PCI address and a known layout")
            return cls(method, modules, address=address, layout=layout)
        if method == "cuda":
            return cls._cuda(data, modules)
        return cls(method, modules)  # an unknown method is refused by the agent, after the modules

    @classmethod
    def _cuda(cls, data: Json, modules: object) -> ScrubParams:
        max_bytes, index, timeout = data.get("max_bytes"), data.get("device", 0), data.get("timeout_s", 600.0)
        if max_bytes is not None and not (_is_int(max_bytes) and max_bytes >= 1):
            raise invalid_params("max_bytes must be a positive integer or null")
        if not _is_int(index) or not 0 <= index < 64:
            raise invalid_params("device must be a CUDA device index")
        if not _is_number(timeout) or not timeout > 0:
            raise invalid_params("timeout_s must be a positive number")
        return cls("cuda", modules, max_bytes=max_bytes, device=index, timeout_s=float(timeout))


# ---- wait_pci, pci_resources ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class WaitPciParams:
    """Until a function not in `known` with `vendor_id`:`device_id` appears, or `timeout_s` passes."""

    vendor_id: str
    device_id: str
    known: tuple[str, ...] = ()
    timeout_s: float = 10.0

    def to_json(self) -> dict[str, object]:
        return {
            "vendor_id": self.vendor_id,
            "device_id": self.device_id,
            "known": list(self.known),
            "timeout_s": self.timeout_s,
        }

    @classmethod
    def from_json(cls, data: Json) -> WaitPciParams:
        vendor, device, known = data.get("vendor_id"), data.get("device_id"), _addresses(data.get("known", []))
        timeout = data.get("timeout_s", 10.0)
        if not (isinstance(vendor, str) and PCI_ID.fullmatch(vendor) and isinstance(device, str)) or not (
            PCI_ID.fullmatch(device)
        ):
            raise invalid_params("vendor_id and device_id must be 4 lower-case hex digits")
        if known is None:
            raise invalid_params(f"known must be a list of at most {MAX_KNOWN} PCI addresses")
        if not _is_number(timeout) or not 0 < timeout <= MAX_WAIT_S:
            raise invalid_params(f"timeout_s must be a number in (0, {MAX_WAIT_S:.0f}]")
        return cls(vendor, device, known, float(timeout))


@dataclass(frozen=True)
class WaitPciResult:
    device: PciFunction | None = None
    waited_ms: float | None = None
    uevents: bool | None = None  # whether the guest listened for the kernel's uevents at all

    def to_json(self) -> dict[str, object]:
        device = None if self.device is None else self.device.to_json()
        return {"device": device, "waited_ms": self.waited_ms, "uevents": self.uevents}

    @classmethod
    def from_json(cls, data: Json) -> WaitPciResult:
        uevents = data.get("uevents")
        return cls(
            PciFunction.from_json(data.get("device")),
            _num(data.get("waited_ms")),
            uevents if isinstance(uevents, bool) else None,
        )


@dataclass(frozen=True)
class PciResourcesParams:
    address: str

    def to_json(self) -> dict[str, object]:
        return {"address": self.address}

    @classmethod
    def from_json(cls, data: Json) -> PciResourcesParams:
        address = _address(data.get("address"))
        if address is None:
            raise invalid_params("address must be a PCI address (DDDD:BB:DD.F)")
        return cls(address)


@dataclass(frozen=True)
class PciResourcesResult:
    """The function's `resource` file as the guest kernel prints it (None: no such function or file); the host
    judges the BARs (model/bars.py)."""

    address: str | None
    resource: str | None

    def to_json(self) -> dict[str, object]:
        return {"address": self.address, "resource": self.resource}

    @classmethod
    def from_json(cls, data: Json) -> PciResourcesResult:
        return cls(_str(data.get("address")), _str(data.get("resource")))


# ---- reseed, shutdown ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReseedParams:
    seed: str  # 64 lower-case hex digits

    def to_json(self) -> dict[str, object]:
        return {"seed": self.seed}

    @classmethod
    def from_json(cls, data: Json) -> ReseedParams:
        seed = data.get("seed")
        if not isinstance(seed, str) or not SEED_HEX.fullmatch(seed):
            raise invalid_params("seed must be 64 lower-case hex digits (32 bytes)")
        return cls(seed)


@dataclass(frozen=True)
class ReseedResult:
    """`mixed`: the write took; `crng_reseeded`: the kernel reseeded its CRNG from it; `why_not`: a step skipped."""

    mixed: bool | None = None
    credited_bits: int | None = None
    crng_reseeded: bool | None = None
    why_not: str | None = None

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "mixed": self.mixed,
            "credited_bits": self.credited_bits,
            "crng_reseeded": self.crng_reseeded,
        }
        return out if self.why_not is None else {**out, "why_not": self.why_not}

    def facts(self) -> dict[str, object]:
        """Every fact, a missing one as null: what the warm claim's report carries."""
        return {**self.to_json(), "why_not": self.why_not}

    @property
    def reseeded(self) -> bool:
        return self.mixed is True and self.crng_reseeded is True

    @classmethod
    def from_json(cls, data: Json) -> ReseedResult:
        mixed, reseeded = data.get("mixed"), data.get("crng_reseeded")
        return cls(
            mixed if isinstance(mixed, bool) else None,
            _int(data.get("credited_bits")),
            reseeded if isinstance(reseeded, bool) else None,
            _str(data.get("why_not")),
        )


@dataclass(frozen=True)
class ShutdownParams:
    poweroff: bool = False

    def to_json(self) -> dict[str, object]:
        return {"poweroff": self.poweroff}

    @classmethod
    def from_json(cls, data: Json) -> ShutdownParams:
        return cls(_flag(data, "poweroff", False))


@dataclass(frozen=True)
class ShutdownResult:
    stopping: bool
    poweroff: bool

    def to_json(self) -> dict[str, object]:
        return {"stopping": self.stopping, "poweroff": self.poweroff}
