"""What Cubelet records about one start of a sandbox, typed and versioned: the reservation checkpoint.

It replaces the free-form `facts` dict. Every field is read by a decision (start, the release rules, reconcile,
the memory ledger, the failure push); what is only history (when it ran, the shim's detach-timeout and
VMM-exit reports, the teardown reason) lives in the event trail, not here. Stored as JSON in
`reservations.checkpoint` and served as the reservation's `facts` (the wire name is kept).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cubeaccel.protocol.errors import CubeError

CHECKPOINT_VERSION = 1
# Keys the old `facts` dict carried that no decision read: dropped by migration 6 (they stay in the event trail).
UNREAD_FACTS = ("running_at", "vmm_exited", "detach_timeout", "release_reason")


@dataclass(frozen=True)
class SandboxFailure:
    """Why a sandbox failed: pushed to CubeMaster, kept in the `reservation_closed` event."""

    code: str
    layer: str
    message: str
    phase: str  # the reservation phase it failed in

    def to_json(self) -> dict[str, str]:
        return {"code": self.code, "layer": self.layer, "message": self.message, "phase": self.phase}

    @classmethod
    def from_json(cls, data: object) -> SandboxFailure:
        keys = ("code", "layer", "message", "phase")
        if not isinstance(data, dict) or set(data) != set(keys) or not all(isinstance(data[k], str) for k in keys):
            raise ValueError(f"failure must be code, layer, message and phase strings, got {data!r}")
        return cls(data["code"], data["layer"], data["message"], data["phase"])


@dataclass
class ReservationCheckpoint:
    """Mutable under Cubelet's lock, written back in the same transaction as the change it records."""

    # ---- start: recorded before the shim is launched (intent before act) ----
    shim_started: bool = False
    started_at: float | None = None  # reconcile's startup timeout counts from here
    start_id: str | None = None  # this start's nonce: the shim echoes it, reports with another one are refused
    image_digest: str | None = None  # what the shim boots, by digest
    # sha256 (hex) of this start's workload access token: the proxy checks callers against it; the token itself
    # went to the caller once and to the shim on its stdin, and is never stored
    workload_token_sha256: str | None = None
    # ---- warm sandboxes (docs/warm.md) ----
    warm_pool: str | None = None  # the pool key of a warm start (template digest and shape); kept after the claim
    shim_id: str | None = None  # the id its shim runs under, once a claim renamed the reservation (else its own)
    claimed_at: float | None = None  # when a claim bound it to its requester
    claim_acked: bool = False  # its shim serves the requester's token (a claim without this is failed, not re-sent)
    # ---- evidence the shim reported (judged, never trusted alone) ----
    vmm_pid: int | None = None  # the shim said it started a VMM (identity is found in /proc, not by this pid)
    vmm_confined: bool = False  # Cubelet read the VMM's confinement from /proc itself (before any device reached it)
    guest_addresses: dict[str, str] = field(default_factory=dict)  # device id → guest PCI address
    detached: list[str] = field(default_factory=list)  # device ids whose detach the shim confirmed
    shim_exited: bool = False  # the shim's final report (`shim_exiting`): it starts nothing after it
    # when the shim said the workload service stopped answering (`workload_unresponsive`), and the code its calls
    # fail with; both None again on `workload_recovered`: what the reservation and CubeMaster's record show
    workload_unresponsive_since: float | None = None
    workload_reason: str | None = None
    # ---- release path ----
    failure: SandboxFailure | None = None
    # the network Cubelet built for this start (host/net/netpolicy.SandboxNet.to_json): removed in the release path,
    # and the reservation closes only after it is
    network: dict[str, Any] | None = None
    kill_at: float | None = None  # when the release path SIGKILLed shim and VMM (once)
    vmm_survives: bool = False  # devices settled but the VMM outlived them (one event)
    release_waits: dict[str, list[str]] = field(default_factory=dict)  # device id → causes already reported
    v: int = CHECKPOINT_VERSION

    def to_json(self) -> dict[str, object]:
        return {
            "v": self.v,
            "shim_started": self.shim_started,
            "started_at": self.started_at,
            "start_id": self.start_id,
            "image_digest": self.image_digest,
            "workload_token_sha256": self.workload_token_sha256,
            "warm_pool": self.warm_pool,
            "shim_id": self.shim_id,
            "claimed_at": self.claimed_at,
            "claim_acked": self.claim_acked,
            "vmm_pid": self.vmm_pid,
            "vmm_confined": self.vmm_confined,
            "guest_addresses": dict(self.guest_addresses),
            "detached": list(self.detached),
            "shim_exited": self.shim_exited,
            "workload_unresponsive_since": self.workload_unresponsive_since,
            "workload_reason": self.workload_reason,
            "failure": None if self.failure is None else self.failure.to_json(),
            "network": None if self.network is None else dict(self.network),
            "kill_at": self.kill_at,
            "vmm_survives": self.vmm_survives,
            "release_waits": {k: list(v) for k, v in self.release_waits.items()},
        }

    @classmethod
    def from_json(cls, data: object) -> ReservationCheckpoint:
        """Strict: a checkpoint is Cubelet's own record, so a malformed one is a corrupt store, not input."""
        if not isinstance(data, dict):
            raise ValueError("a checkpoint is a JSON object")
        v = data.get("v")
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError("a checkpoint carries its version `v`")
        if v > CHECKPOINT_VERSION:
            raise CubeError(
                code="store.checkpoint_too_new",
                message=f"reservation checkpoint version {v} is newer than this cubeaccel ({CHECKPOINT_VERSION})",
                layer="cubelet",
                status=500,
            )
        unknown = set(data) - set(cls().to_json())
        if unknown:
            raise ValueError(f"unknown checkpoint fields {sorted(unknown)}")
        return cls(
            shim_started=_bool(data, "shim_started"),
            started_at=_num(data, "started_at"),
            start_id=_str(data, "start_id"),
            image_digest=_str(data, "image_digest"),
            workload_token_sha256=_str(data, "workload_token_sha256"),
            warm_pool=_str(data, "warm_pool"),
            shim_id=_str(data, "shim_id"),
            claimed_at=_num(data, "claimed_at"),
            claim_acked=_bool(data, "claim_acked"),
            vmm_pid=_int(data, "vmm_pid"),
            vmm_confined=_bool(data, "vmm_confined"),
            guest_addresses=_str_map(data, "guest_addresses"),
            detached=_str_list(data.get("detached", []), "detached"),
            shim_exited=_bool(data, "shim_exited"),
            workload_unresponsive_since=_num(data, "workload_unresponsive_since"),
            workload_reason=_str(data, "workload_reason"),
            failure=None if data.get("failure") is None else SandboxFailure.from_json(data["failure"]),
            network=None if data.get("network") is None else _dict(data["network"]),
            kill_at=_num(data, "kill_at"),
            vmm_survives=_bool(data, "vmm_survives"),
            release_waits={
                k: _str_list(w, f"release_waits.{k}") for k, w in _dict(data.get("release_waits", {})).items()
            },
            v=v,
        )

    @classmethod
    def from_facts(cls, facts: dict[str, Any]) -> ReservationCheckpoint:
        """Migration 6: an old `facts` dict (any subset of its keys, as the code of that time wrote them)."""
        kept = {k: v for k, v in facts.items() if k not in UNREAD_FACTS}
        pid = kept.get("vmm_pid")
        kept["vmm_pid"] = pid if isinstance(pid, int) and not isinstance(pid, bool) else None
        return cls.from_json({**kept, "v": CHECKPOINT_VERSION})


def _dict(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"expected an object, got {value!r}")
    return value


def _bool(data: Mapping[str, object], key: str) -> bool:
    value = data.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be a boolean")
    return value


def _num(data: Mapping[str, object], key: str) -> float | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"{key} must be a number")
    return float(value)


def _int(data: Mapping[str, object], key: str) -> int | None:
    value = data.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise ValueError(f"{key} must be an integer")
    return value


def _str(data: Mapping[str, object], key: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{key} must be a string")
    return value


def _str_list(value: object, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise ValueError(f"{key} must be a list of strings")
    return list(value)


def _str_map(data: Mapping[str, object], key: str) -> dict[str, str]:
    value = _dict(data.get(key, {}))
    if not all(isinstance(x, str) for x in value.values()):
        raise ValueError(f"{key} must map strings to strings")
    return dict(value)
