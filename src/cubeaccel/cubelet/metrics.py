"""Cubelet's Prometheus metrics and its state-transition log lines (docs/observability.md lists every series).

Nothing here is a second bookkeeping of state: device gauges are computed at scrape time from the store, and
every counter is fed by the store's own events, handed over once their transaction is in (`Store.listeners`),
so a rolled-back change counts nothing. Label names join the DCGM exporter's: `Hostname` (the node name),
`pci_bus_id` (NVML's form, `00000000:3B:00.0`), `UUID` (the device serial where the host reports one) and
`modelName` (our model label, e.g. H100; DCGM's is NVML's product name, so join on `Hostname` + `pci_bus_id`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from cubeaccel.cubelet.store import Event
from cubeaccel.model.cold_start import MILESTONES, cold_start_phases
from cubeaccel.model.device import DeviceRecord, PciAddress
from cubeaccel.model.event_kinds import EventKind
from cubeaccel.model.states import DeviceState
from cubeaccel.transport.telemetry import ApiTelemetry

if TYPE_CHECKING:
    from cubeaccel.cubelet.ports import MetricsSource

log = logging.getLogger("cubeaccel.cubelet")
STATES = tuple(s.value for s in DeviceState)
PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0)
_MILESTONE_KINDS = {kind for _, kind, _, _ in MILESTONES}
STARTING_PHASES = ("reserved", "starting")  # a failure in these is a failed start, not a failed sandbox


def pci_bus_id(address: PciAddress) -> str:
    """NVML's (and so DCGM's) spelling of a PCI address: 8-digit domain, upper-case hex."""
    return f"{address.domain:08X}:{address.bus:02X}:{address.slot:02X}.{address.function}"


def device_labels(node: str, d: DeviceRecord) -> dict[str, str]:
    return {
        "Hostname": node,
        "pci_bus_id": pci_bus_id(d.address),
        "UUID": d.identity.serial or "",
        "modelName": str(d.labels.get("model", "")),
        "class": d.accel_class.value,
    }


class _ShimLaunches(Collector):
    """Shim starts by how they went — `fork` (the fork server) or `spawn` (a new interpreter: the fork server
    was off, not up yet, or gone) — as the shim driver counts them; nothing for drivers that do not count."""

    def __init__(self, cubelet: MetricsSource) -> None:
        self.cubelet = cubelet

    def collect(self) -> Iterator[Metric]:
        launches = self.cubelet.shim.launches
        if launches is None:
            return
        family = CounterMetricFamily(
            "cubeaccel_shim_launches", "Shim starts by how the process was made: fork or spawn", labels=["how"]
        )
        for how, n in sorted(launches.items()):
            family.add_metric([how], n)
        yield family

    def describe(self) -> Iterator[Metric]:
        return iter(())


class _Devices(Collector):
    """Computed from the store at each scrape: never out of step with it."""

    def __init__(self, cubelet: MetricsSource, classes: dict[str, str]) -> None:
        self.cubelet = cubelet
        self.classes = classes

    def collect(self) -> Iterator[Metric]:
        node = self.cubelet.config.node_name
        per_device = GaugeMetricFamily(
            "cubeaccel_device_state",
            "1 for each device's current state (with its reason); one series per device",
            labels=["Hostname", "pci_bus_id", "UUID", "modelName", "class", "state", "reason"],
        )
        counts: dict[tuple[str, str], dict[str, int]] = {}
        for d in self.cubelet.store.devices():
            lb = device_labels(node, d)
            per_device.add_metric([*lb.values(), d.state.value, d.reason or ""], 1)
            self.classes[d.id] = lb["class"]
            counts.setdefault((lb["class"], lb["modelName"]), dict.fromkeys(STATES, 0))[d.state.value] += 1
        by_state = GaugeMetricFamily(
            "cubeaccel_devices",
            "Devices by node, class, model and state (every state present, zeros included)",
            labels=["Hostname", "class", "modelName", "state"],
        )
        for (cls, model), states in sorted(counts.items()):
            for state, n in states.items():
                by_state.add_metric([node, cls, model, state], n)
        yield by_state
        yield per_device

    def describe(self) -> Iterator[Metric]:
        return iter(())


class _WarmPools(Collector):
    """The warm pools (docs/warm.md) as the refill and the journal see them at each scrape."""

    def __init__(self, cubelet: MetricsSource) -> None:
        self.cubelet = cubelet

    def collect(self) -> Iterator[Metric]:
        warm = self.cubelet.warm
        labels = ["pool", "template"]
        size = GaugeMetricFamily(
            "cubeaccel_warm_pool_size", "Warm sandboxes each pool is configured to keep", labels=labels
        )
        now = GaugeMetricFamily(
            "cubeaccel_warm_sandboxes",
            "Unclaimed warm sandboxes by pool and state (warm, starting)",
            labels=[*labels, "state"],
        )
        claims = CounterMetricFamily("cubeaccel_warm_claims", "Claims served from each pool", labels=labels)
        failed = CounterMetricFamily(
            "cubeaccel_warm_start_failures", "Warm starts that failed (the pool backs off)", labels=labels
        )
        refill = SummaryMetricFamily(
            "cubeaccel_warm_refill_seconds", "From a warm start's reservation to the sandbox warm", labels=labels
        )
        for pool in list(warm.pools.values()):
            lv = [pool.key, pool.request.template or ""]
            n_warm, n_starting = warm.counts(pool.key)
            size.add_metric(lv, pool.size)
            now.add_metric([*lv, "warm"], n_warm)
            now.add_metric([*lv, "starting"], n_starting)
            claims.add_metric(lv, pool.claims)
            failed.add_metric(lv, pool.failures)
            refill.add_metric(lv, pool.refills, pool.refill_total_s)
        misses = CounterMetricFamily(
            "cubeaccel_warm_misses",
            "Claims that found no warm sandbox, by reason (the cold path follows)",
            labels=["reason"],
        )
        for reason, n in sorted(dict(warm.misses_by_reason).items()):
            misses.add_metric([reason], n)
        draining = GaugeMetricFamily("cubeaccel_warm_draining", "1 while a drain or `down` holds the pools empty")
        draining.add_metric([], 1 if warm.draining else 0)
        yield from (size, now, claims, failed, refill, misses, draining)

    def describe(self) -> Iterator[Metric]:
        return iter(())


class CubeletMetrics:
    """One per Cubelet: its registry (served at `/metrics` by both listeners) and its store listener."""

    def __init__(self, cubelet: MetricsSource) -> None:
        self.cubelet = cubelet
        r = self.registry = CollectorRegistry()
        self.api = ApiTelemetry(r, "cubelet")
        self.transitions = Counter(
            "cubeaccel_device_transitions",
            "Device state transitions by event, actor and target state",
            ["event", "actor", "to_state"],
            registry=r,
        )
        self.quarantines = Counter(
            "cubeaccel_device_quarantines", "Devices quarantined, by reason", ["reason"], registry=r
        )
        self.unhealthy = Counter(
            "cubeaccel_device_unhealthy", "Devices marked unhealthy, by reason", ["reason"], registry=r
        )
        self.reservations = Counter(
            "cubeaccel_reservations",
            "Reservations by outcome: created, refused, expired, closed",
            ["outcome"],
            registry=r,
        )
        self.refusals = Counter(
            "cubeaccel_reservation_refusals", "Refused reservations by error code", ["reason"], registry=r
        )
        self.starts = Counter(
            "cubeaccel_sandbox_starts", "Sandbox starts by outcome: running or failed", ["outcome"], registry=r
        )
        self.failures = Counter(
            "cubeaccel_sandbox_failures",
            "Sandbox failures by code and the phase they happened in",
            ["reason", "phase"],
            registry=r,
        )
        self.cold_start = Histogram(
            "cubeaccel_cold_start_phase_seconds",
            "Cold-start timeline per phase (reserve, vm_start, pin, guest_boot, hotplug, workload_ready, "
            "guest_validation, ready, total)",
            ["phase"],
            registry=r,
            buckets=PHASE_BUCKETS,
        )
        self.release = Histogram(
            "cubeaccel_release_duration_seconds",
            "From teardown start to the reservation closed (devices back or quarantined)",
            registry=r,
            buckets=PHASE_BUCKETS,
        )
        self.release_waits = Counter(
            "cubeaccel_release_waits", "Release waits by cause (one per device and cause)", ["cause"], registry=r
        )
        self.scrub = Histogram(
            "cubeaccel_scrub_duration_seconds",
            "Scrub between tenants per device, by class and outcome (ok, failed)",
            ["class", "outcome"],
            registry=r,
            buckets=PHASE_BUCKETS,
        )
        # device → class, for events that name only the device (scrub); refreshed at every scrape
        self.classes: dict[str, str] = {d.id: d.accel_class.value for d in cubelet.store.devices()}
        r.register(_Devices(cubelet, self.classes))
        r.register(_ShimLaunches(cubelet))
        r.register(_WarmPools(cubelet))
        self._lock = threading.Lock()
        self._trails: dict[str, list[tuple[str, str | None, float]]] = {}  # in-flight starts' milestones
        self._teardowns: dict[str, float] = {}  # sandbox → teardown start
        cubelet.store.listeners.append(self.on_events)

    def observe_scrub(self, seconds: float, accel_class: str, ok: bool) -> None:
        """For a scrub step; the release path's `scrub_finished` event (`details.duration_s`, `details.ok`) is
        counted the same way without a call."""
        self.scrub.labels(accel_class, "ok" if ok else "failed").observe(seconds)

    def refused(self, code: str) -> None:
        self.reservations.labels("refused").inc()
        self.refusals.labels(code).inc()

    # ---- the store's events ---------------------------------------------------------------------------------
    def on_events(self, events: list[Event]) -> None:
        for e in events:
            self._count(e)
        if log.isEnabledFor(logging.INFO):  # one line per event
            node = self.cubelet.config.node_name
            for e in events:
                log.info(e.kind, extra={"fields": {"node": node, **_event_fields(e)}})

    def _count(self, e: Event) -> None:
        """Each kind moves its own series (`_COUNTERS`); a start's milestones also build its cold-start trail."""
        counter = _COUNTERS.get(e.kind)
        if counter is not None:
            counter(self, e)
        if e.sandbox_id is not None and (e.kind in _MILESTONE_KINDS or e.kind == EventKind.RESERVATION_CREATED):
            self._milestone(e.sandbox_id, e)

    def _transition(self, e: Event) -> None:
        self.transitions.labels(e.event or "", e.actor, e.to_state or "").inc()
        if e.to_state == DeviceState.QUARANTINED.value:
            self.quarantines.labels(e.reason or "none").inc()
        elif e.to_state == DeviceState.UNHEALTHY.value:
            self.unhealthy.labels(e.reason or "none").inc()

    def _scrub(self, e: Event) -> None:
        duration = e.details.get("duration_s")
        if not isinstance(duration, int | float):
            return
        cls = str(e.details.get("class") or self.classes.get(e.device_id or "", ""))
        ok = e.details.get("ok")
        self.observe_scrub(float(duration), cls, ok=ok if isinstance(ok, bool) else e.reason is None)

    def _teardown_started(self, e: Event) -> None:
        if e.sandbox_id is None:
            return
        with self._lock:
            self._teardowns[e.sandbox_id] = e.at
            self._trails.pop(e.sandbox_id, None)
        failure = e.details.get("failure")
        if isinstance(failure, dict):
            phase = str(failure.get("phase", ""))
            self.failures.labels(str(failure.get("code", e.reason)), phase).inc()
            if phase in STARTING_PHASES:
                self.starts.labels("failed").inc()

    def _reservation_closed(self, e: Event) -> None:
        if e.sandbox_id is None:
            return
        self.reservations.labels("closed").inc()
        with self._lock:
            began = self._teardowns.pop(e.sandbox_id, None)
            self._trails.pop(e.sandbox_id, None)
        if began is not None:
            self.release.observe(max(0.0, e.at - began))

    def _milestone(self, sid: str, e: Event) -> None:
        with self._lock:
            if e.kind == EventKind.RESERVATION_CREATED:
                self._trails[sid] = []
            trail = self._trails.get(sid)
            if trail is None:
                return
            trail.append((e.kind, e.event, e.at))
            if e.kind != EventKind.SANDBOX_RUNNING:
                return
            del self._trails[sid]
        self.starts.labels("running").inc()
        for phase, seconds in cold_start_phases(trail).items():
            self.cold_start.labels(phase).observe(seconds)


_COUNTERS: dict[str, Callable[[CubeletMetrics, Event], None]] = {
    EventKind.TRANSITION: CubeletMetrics._transition,
    EventKind.RESERVATION_CREATED: lambda m, e: m.reservations.labels("created").inc(),
    EventKind.RESERVATION_EXPIRED: lambda m, e: m.reservations.labels("expired").inc(),
    EventKind.RELEASE_WAITING: lambda m, e: m.release_waits.labels(e.reason or "none").inc(),
    EventKind.SCRUB_STARTED: CubeletMetrics._scrub,
    EventKind.SCRUB_FINISHED: CubeletMetrics._scrub,
    EventKind.TEARDOWN_STARTED: CubeletMetrics._teardown_started,
    EventKind.RESERVATION_CLOSED: CubeletMetrics._reservation_closed,
}


def _event_fields(e: Event) -> dict[str, Any]:
    return {
        "kind": e.kind,
        "device_id": e.device_id,
        "sandbox_id": e.sandbox_id,
        "event": e.event,
        "from_state": e.from_state,
        "to_state": e.to_state,
        "actor": e.actor,
        "reason": e.reason,
    }
