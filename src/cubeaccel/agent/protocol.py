"""The wire protocol: versioned JSON lines, one request → one reply, errors as values.

Framing and dispatch are pure (bytes in, dicts out) so they can be fuzzed without a transport;
serve.py moves the bytes. Nothing a peer sends can end the loop except a well-formed `shutdown`.

Request:  {"v": 1, "id": 7, "method": "probe", "params": {...}}
Reply:    {"v": 1, "id": 7, "ok": true, "result": {...}}
          {"v": 1, "id": 7, "ok": false, "error": {"code", "layer", "message", "details"}}
Event:    {"v": 1, "event": "ready", "result": {...hello...}}   (sent once when serving starts)
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from cubeaccel.agent.hotplug import read_resource, wait_pci  # imported at start: in a template, before the snapshot
from cubeaccel.agent.probes import ProbeContext, kernel_release, loaded_modules, pci_devices, run_modprobe
from cubeaccel.agent.report import probe_reply
from cubeaccel.agent.reseed import reseed
from cubeaccel.agent.spec import bad_contract, parse_spec
from cubeaccel.model.agent_protocol import AGENT_VERSION, PROTOCOL_VERSION
from cubeaccel.model.errors import CubeError

DEFAULT_MAX_REQUEST_BYTES = 256 * 1024
BAR_RESOURCES = frozenset(f"resource{i}" for i in range(6))
PCI_ADDRESS = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[01][0-9a-f]\.[0-7]")
METHODS = ("hello", "probe", "load_modules", "scrub", "shutdown", "wait_pci", "pci_resources", "reseed")
SEED_HEX = re.compile(r"[0-9a-f]{64}")  # 32 bytes: what a warm claim carries (wire/warm.RNG_SEED)
PCI_ID = re.compile(r"[0-9a-f]{4}")
MAX_KNOWN = 1024
MAX_WAIT_S = 30.0


def protocol_error(code: str, message: str, **details: Any) -> CubeError:
    return CubeError(code, message, layer="agent", details=details, status=400)


@dataclass
class LineFramer:
    """Splits a byte stream into lines; a line longer than `max_bytes` becomes one error, then is skipped."""

    max_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    _buf: bytearray = field(default_factory=bytearray)
    _discarding: bool = False
    _discarded: int = 0

    @property
    def partial(self) -> int:
        """Bytes of an unfinished line held (or being skipped); the serve loop times these out."""
        return len(self._buf) + self._discarded

    def feed(self, data: bytes) -> list[bytes | CubeError]:
        out: list[bytes | CubeError] = []
        while data:
            newline = data.find(b"\n")
            chunk, data = (data, b"") if newline < 0 else (data[:newline], data[newline + 1 :])
            if self._discarding:
                self._discarded += len(chunk)
            else:
                self._buf += chunk
                if len(self._buf) > self.max_bytes:
                    out.append(self._too_large())
            if newline >= 0:
                if not self._discarding:
                    out.append(bytes(self._buf))
                self._reset()
        return out

    def drop_partial(self) -> CubeError:
        """The peer stopped mid-line: report how much was lost and start clean."""
        err = protocol_error("agent.read_timeout", "incomplete request line timed out", bytes=self.partial)
        self._reset()
        return err

    def _too_large(self) -> CubeError:
        self._discarding, self._discarded = True, len(self._buf)
        self._buf = bytearray()
        return protocol_error(
            "agent.request_too_large", f"request line exceeds {self.max_bytes} bytes", limit=self.max_bytes
        )

    def _reset(self) -> None:
        self._buf, self._discarding, self._discarded = bytearray(), False, 0


def reply_ok(request_id: Any, result: dict[str, Any]) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": request_id, "ok": True, "result": result}


def reply_error(request_id: Any, err: CubeError) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": request_id, "ok": False, **err.to_json()}


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":"), default=str).encode() + b"\n"


def _boot_id(ctx: ProbeContext) -> str | None:
    try:
        return ctx.path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


@dataclass
class Agent:
    """Dispatches requests; `stopping` is set by `shutdown` and read by the serve loop."""

    ctx: ProbeContext = field(default_factory=ProbeContext)
    contract: dict[str, Any] | None = None  # default contract when `probe` carries none
    load_modules_default: bool = True
    started: float = field(default_factory=time.monotonic)
    stopping: bool = False
    poweroff_requested: bool = False

    def handle_line(self, line: bytes) -> dict[str, Any] | None:
        """One request line → one reply (None for a blank line). Never raises."""
        if not line.strip():
            return None
        request_id: Any = None
        try:
            request = self._decode(line)
            request_id = self._request_id(request)
            method = self._method(request)
            params = request.get("params") or {}
            if not isinstance(params, dict):
                raise protocol_error("agent.invalid_params", "params must be an object")
            handler: Callable[[dict[str, Any]], dict[str, Any]] = getattr(self, f"_m_{method}")
            return reply_ok(request_id, handler(params))
        except CubeError as err:
            return reply_error(request_id, err)
        except Exception as exc:  # a bug in a handler is reported, and the next request still served
            return reply_error(request_id, protocol_error("agent.internal_error", f"{type(exc).__name__}: {exc}"[:500]))

    @staticmethod
    def _decode(line: bytes) -> dict[str, Any]:
        try:
            request = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise protocol_error("agent.bad_json", f"request is not JSON: {exc}"[:300]) from None
        if not isinstance(request, dict):
            raise protocol_error("agent.bad_request", "request must be a JSON object")
        return request

    @staticmethod
    def _request_id(request: dict[str, Any]) -> int | str | None:
        request_id = request.get("id")
        if request_id is None or (
            isinstance(request_id, int | str) and not isinstance(request_id, bool) and len(str(request_id)) <= 128
        ):
            return request_id
        raise protocol_error("agent.bad_request", "id must be an integer or a string of at most 128 characters")

    @staticmethod
    def _method(request: dict[str, Any]) -> str:
        version = request.get("v", PROTOCOL_VERSION)
        if version != PROTOCOL_VERSION or isinstance(version, bool):
            raise protocol_error(
                "agent.unsupported_version",
                f"protocol version {str(version)[:32]!r} not supported",
                supported=[PROTOCOL_VERSION],
            )
        method = request.get("method")
        if not isinstance(method, str) or method not in METHODS:
            raise protocol_error("agent.unknown_method", f"unknown method {str(method)[:64]!r}", methods=list(METHODS))
        return method

    def hello(self) -> dict[str, Any]:
        return {
            "agent_version": AGENT_VERSION,
            "protocol": PROTOCOL_VERSION,
            "methods": list(METHODS),
            "kernel_release": kernel_release(self.ctx),
            "boot_id": _boot_id(self.ctx),
            "pid": os.getpid(),
            "uptime_s": round(time.monotonic() - self.started, 3),
            # What is there before any hot-plug: `wait_pci`'s `known` without a probe of its own.
            "pci_addresses": [d["address"] for d in pci_devices(self.ctx)],
        }

    def _m_hello(self, params: dict[str, Any]) -> dict[str, Any]:
        return self.hello()

    def _contract(self, params: dict[str, Any]) -> dict[str, Any]:
        contract = params.get("contract", self.contract)
        if contract is None:
            raise bad_contract("no contract in the request and none configured with --contract")
        if not isinstance(contract, dict):
            raise bad_contract("contract must be a JSON object")
        return contract

    def _flag(self, params: dict[str, Any], key: str, default: bool) -> bool:
        value = params.get(key, default)
        if not isinstance(value, bool):
            raise protocol_error("agent.invalid_params", f"{key} must be true or false")
        return value

    def _m_probe(self, params: dict[str, Any]) -> dict[str, Any]:
        contract = self._contract(params)
        spec = parse_spec(contract)
        wanted = self._flag(params, "load_modules", self.load_modules_default)
        ctx = replace(self.ctx, load_modules=wanted and spec.load_modules is not False)  # the contract may forbid
        return probe_reply(contract, spec, ctx)

    def _m_load_modules(self, params: dict[str, Any]) -> dict[str, Any]:
        modules = params.get("modules")
        if modules is None:
            modules = list(parse_spec(self._contract(params)).modules)
        spec = parse_spec({"probes": {"modules": modules}})  # same name validation as a contract
        outcome = run_modprobe(self.ctx, spec.modules)
        failures, results = outcome.failures, outcome.results
        return {
            "ok": not failures,
            "failures": failures,
            "modules_loaded": list(loaded_modules(self.ctx)),
            "probes": [asdict(r) for r in results],
        }

    def _m_scrub(self, params: dict[str, Any]) -> dict[str, Any]:
        """The scrub template's one request (docs/scrub.md); a tenant's guest never gets it from Cubelet."""
        from cubeaccel.agent.scrub import LAYOUTS, ScrubResult, scrub_bar, scrub_bar_memory, scrub_cuda

        method = params.get("method")
        if params.get("modules") is not None:  # a vendor image's driver, loaded before its scrub can reach the device
            spec = parse_spec({"probes": {"modules": params["modules"]}})  # same name validation as a contract
            driver = spec.modules[0] if spec.modules else None
            loaded = run_modprobe(self.ctx, spec.modules, driver, kernel_release(self.ctx))
            if loaded.failures:
                why = loaded.refusal or "; ".join(f"{m}: {e}" for m, e in loaded.failures.items())
                return ScrubResult(ok=False, method=str(method), error=f"driver not loaded: {why}"[:500]).to_json()
        if method == "bar-memory":
            address, resource = params.get("address"), params.get("resource", "resource2")
            if not isinstance(address, str) or not PCI_ADDRESS.fullmatch(address) or resource not in BAR_RESOURCES:
                raise protocol_error("agent.invalid_params", "scrub bar-memory needs a PCI address and resource0..5")
            return scrub_bar_memory(self.ctx.root / "sys/bus/pci/devices" / address, resource).to_json()
        if method == "bar":
            address, layout = params.get("address"), params.get("layout", "edu")
            if not isinstance(address, str) or not PCI_ADDRESS.fullmatch(address) or layout not in LAYOUTS:
                raise protocol_error("agent.invalid_params", "scrub bar needs a PCI address and a known layout")
            return scrub_bar(self.ctx.root / "sys/bus/pci/devices" / address, LAYOUTS[layout]).to_json()
        if method == "cuda":
            max_bytes, index = params.get("max_bytes"), params.get("device", 0)
            if max_bytes is not None and (
                not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1
            ):
                raise protocol_error("agent.invalid_params", "max_bytes must be a positive integer or null")
            if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < 64:
                raise protocol_error("agent.invalid_params", "device must be a CUDA device index")
            timeout = float(params.get("timeout_s", 600.0))
            return scrub_cuda(self.ctx.lib_dirs, index, max_bytes, timeout_s=timeout).to_json()
        raise protocol_error("agent.invalid_params", "scrub method must be bar or cuda")

    def _m_wait_pci(self, params: dict[str, Any]) -> dict[str, Any]:
        """Until a function not in `known` with `vendor_id`:`device_id` appears, or `timeout_s` passes."""
        vendor, device, known = params.get("vendor_id"), params.get("device_id"), params.get("known", [])
        timeout = params.get("timeout_s", 10.0)
        if not (
            isinstance(vendor, str)
            and PCI_ID.fullmatch(vendor)
            and isinstance(device, str)
            and PCI_ID.fullmatch(device)
        ):
            raise protocol_error("agent.invalid_params", "vendor_id and device_id must be 4 lower-case hex digits")
        if (
            not isinstance(known, list)
            or len(known) > MAX_KNOWN
            or not all(isinstance(a, str) and PCI_ADDRESS.fullmatch(a) for a in known)
        ):
            raise protocol_error("agent.invalid_params", f"known must be a list of at most {MAX_KNOWN} PCI addresses")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= MAX_WAIT_S:
            raise protocol_error("agent.invalid_params", f"timeout_s must be a number in (0, {MAX_WAIT_S:.0f}]")
        return wait_pci(self.ctx, vendor, device, frozenset(known), float(timeout))

    def _m_pci_resources(self, params: dict[str, Any]) -> dict[str, Any]:
        """A function's `resource` file as the guest kernel prints it: the host judges whether every BAR was
        placed at its size (model/bars.py), never this guest."""
        address = params.get("address")
        if not isinstance(address, str) or not PCI_ADDRESS.fullmatch(address):
            raise protocol_error("agent.invalid_params", "address must be a PCI address (DDDD:BB:DD.F)")
        return {"address": address, "resource": read_resource(self.ctx, address)}

    def _m_reseed(self, params: dict[str, Any]) -> dict[str, Any]:
        """A warm claim's seed into the kernel RNG (agent/reseed.py), before the tenant's token reaches the guest."""
        seed = params.get("seed")
        if not isinstance(seed, str) or not SEED_HEX.fullmatch(seed):
            raise protocol_error("agent.invalid_params", "seed must be 64 lower-case hex digits (32 bytes)")
        try:
            return reseed(bytes.fromhex(seed), self.ctx.path("/dev/urandom"))
        except OSError as e:
            raise protocol_error("agent.reseed_failed", f"cannot write the seed: {e.strerror or e}") from None

    def _m_shutdown(self, params: dict[str, Any]) -> dict[str, Any]:
        self.poweroff_requested = self._flag(params, "poweroff", False)
        self.stopping = True
        return {"stopping": True, "poweroff": self.poweroff_requested}
