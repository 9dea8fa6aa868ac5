"""The wire protocol: versioned JSON lines, one request → one reply, errors as values.

Framing and dispatch are pure (bytes in, JSON objects out) so they can be fuzzed without a transport;
serve.py moves the bytes. Nothing a peer sends can end the loop except a well-formed `shutdown`.

Request:  {"v": 1, "id": 7, "method": "probe", "params": {...}}
Reply:    {"v": 1, "id": 7, "ok": true, "result": {...}}
          {"v": 1, "id": 7, "ok": false, "error": {"code", "layer", "message", "details"}}
Event:    {"v": 1, "event": "ready", "result": {...hello...}}   (sent once when serving starts)

Each method's params and result are typed records in protocol/agent_messages.py, which the shim reads too.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from cubeaccel.agent.hotplug import read_resource, wait_pci  # imported at start: in a template, before the snapshot
from cubeaccel.agent.probes import ProbeContext, kernel_release, loaded_modules, pci_devices, run_modprobe
from cubeaccel.agent.report import probe_reply
from cubeaccel.agent.reseed import reseed
from cubeaccel.agent.spec import parse_spec
from cubeaccel.protocol.agent_messages import (
    METHODS,
    HelloResult,
    Json,
    LoadModulesParams,
    LoadModulesResult,
    PciResourcesParams,
    PciResourcesResult,
    ProbeParams,
    ProbeReply,
    Reply,
    Request,
    RequestId,
    ReseedParams,
    ReseedResult,
    ScrubParams,
    ShutdownParams,
    ShutdownResult,
    WaitPciParams,
    WaitPciResult,
    bad_contract,
    invalid_params,
    protocol_error,
    request_id,
)
from cubeaccel.protocol.agent_protocol import AGENT_VERSION, PROTOCOL_VERSION
from cubeaccel.protocol.errors import CubeError

DEFAULT_MAX_REQUEST_BYTES = 256 * 1024


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


def reply_error(request_id: RequestId, err: CubeError) -> dict[str, Any]:
    return Reply(request_id, error=err).to_json()


def encode(message: Json) -> bytes:
    return json.dumps(message, separators=(",", ":"), default=str).encode() + b"\n"


class _Result(Protocol):
    def to_json(self) -> Json: ...


def _boot_id(ctx: ProbeContext) -> str | None:
    try:
        return ctx.path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


@dataclass
class Agent:
    """Dispatches requests; `stopping` is set by `shutdown` and read by the serve loop."""

    ctx: ProbeContext = field(default_factory=ProbeContext)
    contract: dict[str, object] | None = None  # default contract when `probe` carries none
    load_modules_default: bool = True
    started: float = field(default_factory=time.monotonic)
    stopping: bool = False
    poweroff_requested: bool = False

    def handle_line(self, line: bytes) -> dict[str, Any] | None:
        """One request line → one reply (None for a blank line). Never raises."""
        if not line.strip():
            return None
        rid: RequestId = None
        try:
            data = self._decode(line)
            rid = request_id(data)
            request = Request.from_json(data)
            handler: Callable[[Json], _Result] = getattr(self, f"_m_{request.method}")
            return Reply(rid, result=handler(request.params).to_json()).to_json()
        except CubeError as err:
            return reply_error(rid, err)
        except Exception as exc:  # a bug in a handler is reported, and the next request still served
            return reply_error(rid, protocol_error("agent.internal_error", f"{type(exc).__name__}: {exc}"[:500]))

    @staticmethod
    def _decode(line: bytes) -> Json:
        try:
            request = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise protocol_error("agent.bad_json", f"request is not JSON: {exc}"[:300]) from None
        if not isinstance(request, dict):
            raise protocol_error("agent.bad_request", "request must be a JSON object")
        return request

    def hello(self) -> HelloResult:
        return HelloResult(
            agent_version=AGENT_VERSION,
            protocol=PROTOCOL_VERSION,
            methods=METHODS,
            kernel_release=kernel_release(self.ctx),
            boot_id=_boot_id(self.ctx),
            pid=os.getpid(),
            uptime_s=round(time.monotonic() - self.started, 3),
            # What is there before any hot-plug: `wait_pci`'s `known` without a probe of its own.
            pci_addresses=tuple(d.address for d in pci_devices(self.ctx) if d.address is not None),
        )

    def _m_hello(self, params: Json) -> HelloResult:
        return self.hello()

    def _contract(self, contract: dict[str, object] | None) -> dict[str, object]:
        found = contract if contract is not None else self.contract
        if found is None:
            raise bad_contract("no contract in the request and none configured with --contract")
        return found

    def _m_probe(self, params: Json) -> ProbeReply:
        p = ProbeParams.from_json(params)
        contract = self._contract(p.contract)
        spec = parse_spec(contract)
        wanted = self.load_modules_default if p.load_modules is None else p.load_modules
        ctx = replace(self.ctx, load_modules=wanted and spec.load_modules is not False)  # the contract may forbid
        ctx = ctx.stretched(p.deadline_scale)
        return probe_reply(contract, spec, ctx)

    def _m_load_modules(self, params: Json) -> LoadModulesResult:
        p = LoadModulesParams.from_json(params)
        modules = p.modules if p.modules is not None else list(parse_spec(self._contract(p.contract)).modules)
        spec = parse_spec({"probes": {"modules": modules}})  # same name validation as a contract
        outcome = run_modprobe(self.ctx.stretched(p.deadline_scale), spec.modules)
        return LoadModulesResult(
            ok=not outcome.failures,
            failures=outcome.failures,
            modules_loaded=tuple(loaded_modules(self.ctx)),
            probes=tuple(outcome.results),
        )

    def _m_scrub(self, params: Json) -> _Result:
        """The scrub template's one request (docs/scrub.md); a tenant's guest never gets it from Cubelet."""
        from cubeaccel.agent.scrub import LAYOUTS, ScrubResult, scrub_bar, scrub_bar_memory, scrub_cuda

        if params.get("modules") is not None:  # a vendor image's driver, loaded before its scrub can reach the device
            spec = parse_spec({"probes": {"modules": params["modules"]}})  # same name validation as a contract
            driver = spec.modules[0] if spec.modules else None
            loaded = run_modprobe(self.ctx, spec.modules, driver, kernel_release(self.ctx))
            if loaded.failures:
                why = loaded.refusal or "; ".join(f"{m}: {e}" for m, e in loaded.failures.items())
                method = params.get("method")
                return ScrubResult(ok=False, method=str(method), error=f"driver not loaded: {why}"[:500])
        p = ScrubParams.from_json(params)
        devices = self.ctx.root / "sys/bus/pci/devices"
        if p.method == "bar-memory":
            return scrub_bar_memory(devices / str(p.address), p.resource)
        if p.method == "bar":
            return scrub_bar(devices / str(p.address), LAYOUTS[p.layout])
        if p.method == "cuda":
            return scrub_cuda(self.ctx.lib_dirs, p.device, p.max_bytes, timeout_s=p.timeout_s)
        raise invalid_params("scrub method must be bar or cuda")

    def _m_wait_pci(self, params: Json) -> WaitPciResult:
        """Until a function not in `known` with `vendor_id`:`device_id` appears, or `timeout_s` passes."""
        p = WaitPciParams.from_json(params)
        return wait_pci(self.ctx, p.vendor_id, p.device_id, frozenset(p.known), p.timeout_s)

    def _m_pci_resources(self, params: Json) -> PciResourcesResult:
        """A function's `resource` file as the guest kernel prints it: the host judges whether every BAR was
        placed at its size (model/bars.py), never this guest."""
        address = PciResourcesParams.from_json(params).address
        return PciResourcesResult(address, read_resource(self.ctx, address))

    def _m_reseed(self, params: Json) -> ReseedResult:
        """A warm claim's seed into the kernel RNG (agent/reseed.py), before the tenant's token reaches the guest."""
        seed = ReseedParams.from_json(params).seed
        try:
            return reseed(bytes.fromhex(seed), self.ctx.path("/dev/urandom"))
        except OSError as e:
            raise protocol_error("agent.reseed_failed", f"cannot write the seed: {e.strerror or e}") from None

    def _m_shutdown(self, params: Json) -> ShutdownResult:
        self.poweroff_requested = ShutdownParams.from_json(params).poweroff
        self.stopping = True
        return ShutdownResult(stopping=True, poweroff=self.poweroff_requested)
