"""Run every probe the contract asks for, assemble the GuestReport, then judge it with the contract too.

The agent's own per-probe verdicts travel in `GuestReport.probes`; the contract's `check_guest`
(when this guest's model package has it and the request carried a whole contract) judges the same
raw facts independently, as Cubelet will on the host.
"""

from __future__ import annotations

import importlib
from typing import Any

from cubeaccel.agent import probes
from cubeaccel.agent.probes import ProbeContext
from cubeaccel.agent.spec import ProbeSpec
from cubeaccel.agent.userspace import Libraries, check_library, check_userspace_version, probe_cuda, probe_nvml
from cubeaccel.protocol.agent_messages import Json, ProbeReply
from cubeaccel.protocol.agent_protocol import AGENT_VERSION
from cubeaccel.protocol.reports import GuestReport, ProbeResult


def build_report(spec: ProbeSpec, ctx: ProbeContext) -> GuestReport:
    """Bottom-up: kernel, modules, PCI, device files, kernel driver, libraries, CUDA, NVML."""
    results: list[ProbeResult] = []
    release = probes.kernel_release(ctx)
    if spec.guest_kernel is not None:
        results.append(probes.check_kernel(spec, release))
    outcome = probes.Modprobe({}, [])
    if ctx.load_modules and spec.modules:
        outcome = probes.run_modprobe(ctx, spec.modules, spec.driver_module, release)
        results += outcome.results
    failures, refusal = outcome.failures, outcome.refusal
    loaded = probes.loaded_modules(ctx)
    results += probes.check_modules(ctx, spec, loaded, failures, outcome.not_attempted)
    pci = probes.pci_devices(ctx)
    if spec.pci:
        results.append(probes.check_pci(spec, pci))
    files = probes.device_files(ctx, spec.device_files)
    driver = probes.kernel_driver_version(ctx, spec.driver_module or "nvidia")
    if refusal is None:  # a refused driver made no device files and has no version: one failure, not three
        results += probes.check_device_files(ctx, spec)
        if spec.kernel_driver is not None:
            results.append(probes.check_kernel_driver(spec, driver))

    # Above a refused driver only what needs no device is asked: libraries and their versions, the CUDA driver
    # API version; cuInit, device counts and NVML would only restate the driver's failure at other layers.
    libs: Libraries = {}
    results += [check_library(want, ctx, libs) for want in spec.libraries]
    cuda = probe_cuda(spec, ctx, libs, results, initialize=refusal is None) if spec.wants_cuda else None
    nvml = probe_nvml(spec, ctx, libs, results) if spec.wants_nvml and refusal is None else None
    if spec.userspace_driver is not None:
        results.append(check_userspace_version(spec.userspace_driver, libs, nvml))
    return GuestReport(
        agent_version=AGENT_VERSION,
        kernel_release=release,
        modules_loaded=loaded,
        module_failures=failures,
        driver_refusal=refusal,
        pci_devices=pci,
        device_files=files,
        kernel_driver_version=driver,
        libraries={name: lib.info() for name, lib in libs.items()},
        cuda=cuda,
        nvml=nvml,
        probes=tuple(results),
    )


def contract_violations(contract: Json, report: GuestReport) -> tuple[list[dict[str, Any]] | None, str]:
    """The contract's own `check_guest` on this report; never raises.

    Runs only for a whole frozen contract (`contract_version`) or template document (`apiVersion`):
    a bare probe spec lacks what check_guest needs. Returns (violations or None, a one-line status).
    """
    if "contract_version" in contract:
        kind = "CompatibilityContract"
    elif "apiVersion" in contract:
        kind = "Template"
    else:
        return None, "skipped: the request carried a probe spec, not a whole contract"
    try:
        module = importlib.import_module("cubeaccel.model.contract")
        check_guest, parse = module.check_guest, getattr(module, kind).from_json
    except (ImportError, AttributeError) as exc:
        return None, f"unavailable: {exc}"
    try:
        violations = check_guest(parse(contract), report)
        return [v.to_json() if hasattr(v, "to_json") else {"violation": str(v)} for v in violations], "applied"
    except Exception as exc:  # the judge failing must not lose the agent's own report
        return None, f"failed: {type(exc).__name__}: {exc}"[:500]


def probe_reply(contract: Json, spec: ProbeSpec, ctx: ProbeContext) -> ProbeReply:
    """What the `probe` method returns and `cube-agent probe --json` prints."""
    report = build_report(spec, ctx)
    violations, status = contract_violations(contract, report)
    failed = [p for p in report.probes if not p.ok]
    layers = {p.layer for p in failed} | {str(v["layer"]) for v in violations or [] if v.get("layer")}
    return ProbeReply(
        ok=not failed and not violations,
        failed=tuple(p.name for p in failed),
        failed_layers=tuple(sorted(layers)),
        report=report.to_json(),
        violations=list(violations or []),
        contract_check=status,
    )
