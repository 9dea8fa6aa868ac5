"""What each node-side job needs of the Cubelet, as protocols: a reader of a module's signature sees the handful of
members it uses, not a ~60-method object, and a test can hand it something small.

`lifecycle.Cubelet` satisfies every one of them structurally; mypy proves it at each call site (the Cubelet is
passed where a port is named). The small ports (`Journal`, `HostAccess`, `ScrubRules`, `VmmEvidence`) are the
building blocks; each module's port adds only what that module alone uses. Host readiness keeps its own port in
`host_ready.py` (lifecycle imports that module, so it cannot import this one's lifecycle types) and the warm pools
keep theirs in `warm.py` (`WarmHost`), for the same reason.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from cubeaccel.backends.base import Backend, Capabilities, Problem
from cubeaccel.cubelet.ended import EndedSandboxes
from cubeaccel.cubelet.locks import KeyedLocks
from cubeaccel.cubelet.memory_ledger import VmmHost
from cubeaccel.cubelet.release import CubeletConfig
from cubeaccel.cubelet.scrub import ScrubPolicy, ScrubRunner
from cubeaccel.cubelet.shim_driver import ShimDriver, ShimStatus
from cubeaccel.cubelet.store import Reservation, Store, Tx
from cubeaccel.cubelet.warm import WarmPools
from cubeaccel.host.net import netpolicy
from cubeaccel.model.contract import CompatibilityContract
from cubeaccel.model.device import DeviceRecord
from cubeaccel.model.reservation_params import CarriedContract, NetworkRequest, ReservationParams
from cubeaccel.model.reset_ladder import ResetAttempt
from cubeaccel.model.sandbox_policy import NetworkPolicy
from cubeaccel.protocol.reports import ShimReport

if TYPE_CHECKING:
    from cubeaccel.cubelet.lifecycle import ReservationRequest

__all__ = [
    "AerFacts",
    "HeartbeatSource",
    "HostAccess",
    "Inventory",
    "Journal",
    "MetricsSource",
    "NetworkHost",
    "NodeInit",
    "OperatorHost",
    "ReconcileHost",
    "RetryHost",
    "ScrubReadyHost",
    "ScrubRules",
    "SnapshotHost",
    "VmmEvidence",
]


# ---- building blocks -------------------------------------------------------------------------------------------
class Journal(Protocol):
    """The node's journal, and the one way to change device state: a transaction under the lifecycle lock."""

    @property
    def store(self) -> Store: ...

    def change(self) -> AbstractContextManager[Tx]: ...


class HostAccess(Protocol):
    """The backend (with what it can do beyond `Backend`, decided once) and the per-device locks host I/O runs
    under."""

    @property
    def backend(self) -> Backend: ...

    @property
    def capabilities(self) -> Capabilities: ...

    @property
    def device_locks(self) -> KeyedLocks: ...


class ScrubRules(Protocol):
    """The scrub policy a device's class asks for, and why a device may not be handed out under it now."""

    def scrub_policy(self, d: DeviceRecord) -> ScrubPolicy: ...

    def scrub_refusal(self, d: DeviceRecord) -> Problem | None: ...


class VmmEvidence(Protocol):
    """Whether a reservation's VMM is proven gone: the release rule operators and retries are bound by too."""

    def vmm_status(self, res: Reservation) -> ShimStatus: ...

    def vmm_gone(self, res: Reservation, st: ShimStatus) -> bool | None: ...


class LifecycleLock(Protocol):
    @property
    def lock(self) -> AbstractContextManager[Any]: ...


# ---- one per job -----------------------------------------------------------------------------------------------
class AerFacts(Protocol):
    """backend_facts.py: AER baselines seeded into the backend from the journal and persisted back."""

    @property
    def store(self) -> Store: ...

    @property
    def capabilities(self) -> Capabilities: ...


class ScrubReadyHost(Journal, ScrubRules, Protocol):
    """scrub_ready.py: which scrub images the node's devices need, whether they are here, and what is held."""

    @property
    def scrub_runner(self) -> ScrubRunner: ...

    @property
    def scrub_image_problems(self) -> dict[str, Problem]: ...

    def set_scrub_image_problems(self, problems: dict[str, Problem]) -> None:
        """Each check's finding, read by the release path's `scrub_refusal`."""
        ...


class Inventory(Journal, HostAccess, ScrubRules, Protocol):
    """inventory.py: register what the host shows, bind and validate `initialized` devices."""


class NodeInit(Inventory, ScrubReadyHost, LifecycleLock, AerFacts, Protocol):
    """inventory.initialize_host: the inventory plus the host-wide checks that run before anything is advertised."""


class RetryHost(Journal, HostAccess, ScrubRules, VmmEvidence, Protocol):
    """quarantine_retry.py: probe a transiently quarantined device on host evidence, as the release path would."""

    def reset_device(self, d: DeviceRecord, unclean: bool) -> tuple[list[Problem], list[ResetAttempt] | None]: ...


class OperatorHost(Inventory, VmmEvidence, LifecycleLock, Protocol):
    """operator.py: audited verbs, never a shortcut around revalidation or the release path's scrub."""

    def advance_scrub(self, device_id: str) -> bool: ...


class NetworkHost(Journal, Protocol):
    """network_update.py: a running sandbox's egress changed in place, or reloaded as the journal says."""

    @property
    def device_locks(self) -> KeyedLocks: ...

    @property
    def shim(self) -> ShimDriver: ...

    @property
    def loaded_networks(self) -> dict[str, netpolicy.Loaded]: ...

    def get_reservation(self, sandbox_id: str) -> Reservation: ...

    def network_policy(
        self, contract: CompatibilityContract | None, requested: NetworkRequest | None
    ) -> NetworkPolicy: ...

    def audit_host(self, action: str, sandbox_id: str, **fields: Any) -> None: ...


class ReconcileHost(NodeInit, RetryHost, OperatorHost, NetworkHost, Protocol):
    """reconcile.py: persisted state against host reality, and the release work a pass finds owed. Wide because
    reconcile is where every periodic check meets; each member below is one it calls itself."""

    @property
    def config(self) -> CubeletConfig: ...

    @property
    def launching(self) -> set[str]: ...

    @property
    def warm(self) -> WarmPools: ...

    def begin_teardown(
        self, sandbox_id: str, reason: str, attach_failed: bool = False, layer: str = "cubelet", message: str = ""
    ) -> None: ...

    def try_release(self, sandbox_id: str) -> None: ...

    def handle_report(self, report: ShimReport) -> None: ...

    def retire_runs(self) -> list[str]: ...

    def expire_reservations(self) -> list[str]: ...


class HeartbeatSource(Protocol):
    """heartbeat.py: what the node advertises to CubeMaster, derived from the journal at each beat."""

    @property
    def store(self) -> Store: ...

    @property
    def backend(self) -> Backend: ...

    @property
    def shim(self) -> ShimDriver: ...

    @property
    def config(self) -> CubeletConfig: ...

    @property
    def warm(self) -> WarmPools: ...

    @property
    def ended(self) -> EndedSandboxes: ...

    @property
    def incarnation(self) -> str: ...

    @property
    def vmm_host(self) -> VmmHost: ...

    @property
    def max_devices_per_sandbox(self) -> int: ...

    def request_params(self, req: ReservationRequest) -> tuple[CarriedContract | None, ReservationParams]: ...


class MetricsSource(Protocol):
    """metrics.py's collectors: gauges computed at scrape time from the journal, the shim driver and the pools."""

    @property
    def store(self) -> Store: ...

    @property
    def shim(self) -> ShimDriver: ...

    @property
    def config(self) -> CubeletConfig: ...

    @property
    def warm(self) -> WarmPools: ...


class SnapshotHost(Protocol):
    """snapshots.py: which template snapshots this node's devices and warm pools call for."""

    @property
    def store(self) -> Store: ...

    @property
    def shim(self) -> ShimDriver: ...

    @property
    def warm(self) -> WarmPools: ...

    def request_params(self, req: ReservationRequest) -> tuple[CarriedContract | None, ReservationParams]: ...
