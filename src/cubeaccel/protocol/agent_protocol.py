"""What the host side and cube-agent must agree on, in one place both may import.

The agent runs in the guest and imports only the standard library and `cubeaccel.protocol`; the host side never
imports `cubeaccel.agent` (an import-linter contract holds both). So the versions, the port name and the
agent's own step timeouts (which the shim's probe deadline must outlast) live here.
"""

from __future__ import annotations

AGENT_VERSION = 1  # GuestReport.agent_version: bumped when the report's meaning changes
AGENT_PORT_NAME = "cube-agent"  # the virtserialport name the VMM gives the agent's channel
PROTOCOL_VERSION = 1  # "v" in every protocol line: bumped when the wire format changes
MODPROBE_TIMEOUT_S = 30.0  # one `modprobe` in the guest, unless the agent's command line says otherwise
CUDA_TIMEOUT_S = 20.0  # one CUDA/NVML query in the guest, likewise
MAX_DEADLINE_SCALE = 3.0  # the most a deadline stretches with the load (the lab's boot allowances stretch alike)

# The error codes cube-agent itself replies with. A guest is untrusted: any other code in an error reply (say
# `shim.stop_requested` or `agent.cancelled`, which the shim acts on) is reported as `agent.error` with the
# guest's text in `details.guest_code`, so nothing a guest says can steer the host.
GUEST_ERROR_CODES = frozenset(
    {
        "agent.bad_json",
        "agent.bad_request",
        "agent.internal_error",
        "agent.invalid_contract",
        "agent.invalid_params",
        "guest.port_not_found",
        "agent.probe_crashed",
        "agent.read_timeout",
        "agent.request_too_large",
        "agent.reseed_failed",
        "agent.unknown_method",
        "agent.unsupported_version",
    }
)


def deadline_scale(load_1min: float, cpus: int) -> float:
    """How much longer than on an idle machine a step may take now: the 1-minute load per core, from 1 up to
    MAX_DEADLINE_SCALE. A guest under TCG runs as fast as its host lets it, so the host measures and sends its
    figure with each probe (`ProbeParams.deadline_scale`); the guest takes the larger of that and its own.
    Measured: loading nvidia.ko (a 60 MB module) took over the fixed 30 s at load 12-18 on 2 cores."""
    per_core = load_1min / max(1, cpus)
    if per_core != per_core:  # NaN: no figure, no stretch
        return 1.0
    return min(MAX_DEADLINE_SCALE, max(1.0, per_core))
