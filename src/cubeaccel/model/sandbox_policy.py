"""What a sandbox may reach besides its device: network egress, writable space, host mounts — and what is refused.

A template declares a `SandboxPolicy` (`spec.sandbox` in the file); a sandbox request may only narrow its network
part (`narrow_network`), never widen it. The default is the closed one: no NIC, no scratch disk, no host mount.
Everything a GPU sandbox cannot offer safely (nested virtualization, privileged or host-namespace workloads, device
sharing, snapshot/clone/pause) is written in the same section only so that it can be refused with a code rather
than as an unknown field. Pure values and checks; no I/O (host/net/netpolicy.py builds the namespace).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cubeaccel.protocol.errors import CubeError

NETWORK_MODES = ("none", "allowlist")
PROTOCOLS = ("tcp", "udp")
MAX_EGRESS_RULES = 64
MAX_SCRATCH_MIB = 16 * 1024 * 1024  # 16 TiB: a sparse file; the node's disk is the real limit
MAX_READONLY_MOUNTS = 8
DEVICE_SHARING = ("exclusive", "mig", "vgpu", "time_slicing")  # only exclusive is supported
HOST_NAMESPACES = ("network", "pid", "ipc", "uts", "mount", "user", "cgroup")
LIFECYCLE_OPS = ("snapshot", "clone", "pause")
_RULE = re.compile(r"(?P<cidr>[0-9./]{7,18}):(?P<port>[0-9]{1,5})(?:/(?P<proto>[a-z]{3}))?")
_GUEST_PATH = re.compile(r"/[A-Za-z0-9_.][A-Za-z0-9_./-]{0,200}")
_RESERVED_TARGETS = ("/proc", "/sys", "/dev", "/run", "/opt/cubeaccel", "/scratch", "/bin", "/sbin", "/usr", "/lib")

# Destinations no allowlist may name: the host itself, link-local (cloud metadata lives at 169.254.169.254),
# multicast/broadcast, "this network". The node adds its own sandbox address pool (`forbidden_overlap`).
FORBIDDEN_DESTINATIONS = tuple(
    ipaddress.IPv4Network(n)
    for n in ("0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4", "255.255.255.255/32")
)


def policy_error(code: str, message: str, **details: Any) -> CubeError:
    return CubeError(code, message, "template", details, 422)


@dataclass(frozen=True, order=True)
class EgressRule:
    """One allowed destination: `CIDR:port[/proto]` (proto defaults to tcp)."""

    network: ipaddress.IPv4Network
    port: int
    proto: str = "tcp"

    @classmethod
    def parse(cls, text: object) -> EgressRule:
        if not isinstance(text, str) or (m := _RULE.fullmatch(text.strip())) is None:
            raise policy_error(
                "network.invalid_rule", f"egress rule {text!r:.80}: expected CIDR:port[/tcp|udp], e.g. 10.0.0.0/24:443"
            )
        try:
            net = ipaddress.IPv4Network(m["cidr"], strict=True)
        except ValueError as e:
            raise policy_error("network.invalid_rule", f"egress rule {text!r}: {e}") from None
        port, proto = int(m["port"]), m["proto"] or "tcp"
        if not 1 <= port <= 65535 or proto not in PROTOCOLS:
            raise policy_error("network.invalid_rule", f"egress rule {text!r}: port 1-65535, proto tcp or udp")
        return cls(net, port, proto)

    def covers(self, other: EgressRule) -> bool:
        return self.port == other.port and self.proto == other.proto and other.network.subnet_of(self.network)

    def __str__(self) -> str:
        return f"{self.network}:{self.port}/{self.proto}"


@dataclass(frozen=True)
class NetworkPolicy:
    """`none`: the guest has no NIC at all. `allowlist`: a NIC whose traffic may reach only `egress`."""

    mode: str = "none"
    egress: tuple[EgressRule, ...] = ()

    @property
    def has_nic(self) -> bool:
        return self.mode == "allowlist"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode}
        if self.mode == "allowlist":
            out["egress"] = [str(r) for r in self.egress]
        return out

    @classmethod
    def from_json(cls, data: object) -> NetworkPolicy:
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise policy_error("network.invalid_policy", "network policy must be an object {mode, egress}")
        mode = data.get("mode", "none")
        if mode not in NETWORK_MODES:
            raise policy_error("network.invalid_policy", f"network mode: none or allowlist, got {mode!r:.40}")
        rules = data.get("egress") or []
        if not isinstance(rules, list) or len(rules) > MAX_EGRESS_RULES:
            raise policy_error("network.invalid_policy", f"the egress rules must be a list of ≤ {MAX_EGRESS_RULES}")
        if mode == "none" and rules:
            raise policy_error("network.invalid_policy", "the network mode none takes no egress rules")
        if mode == "allowlist" and not rules:
            raise policy_error("network.invalid_policy", "the network mode allowlist needs at least one egress rule")
        return cls(mode, tuple(sorted({EgressRule.parse(r) for r in rules})))


def forbidden_overlap(policy: NetworkPolicy, extra: Sequence[ipaddress.IPv4Network] = ()) -> list[str]:
    """Rules that reach a forbidden destination (or the node's sandbox pool in `extra`)."""
    bad = (*FORBIDDEN_DESTINATIONS, *extra)
    return [str(r) for r in policy.egress if any(r.network.overlaps(n) for n in bad)]


def _destination(text: object) -> ipaddress.IPv4Network:
    """An IPv4 address or CIDR (host bits masked, as E2B reads them)."""
    if not isinstance(text, str) or not re.fullmatch(r"[0-9./]{7,18}", text.strip()):
        raise policy_error("network.invalid_rule", f"destination {text!r:.80}: expected an IPv4 address or CIDR")
    try:
        return ipaddress.IPv4Network(text.strip(), strict=False)
    except ValueError as e:
        raise policy_error("network.invalid_rule", f"destination {text!r:.80}: {e}") from None


def _without(net: ipaddress.IPv4Network, holes: Iterable[ipaddress.IPv4Network]) -> list[ipaddress.IPv4Network]:
    parts = [net]
    for hole in holes:
        parts = [
            piece
            for part in parts
            if not part.subnet_of(hole)
            for piece in ((part,) if not part.overlaps(hole) else part.address_exclude(hole))
        ]
    return parts


def _within(net: ipaddress.IPv4Network, nets: Iterable[ipaddress.IPv4Network]) -> list[ipaddress.IPv4Network]:
    """`net` cut to each of `nets` it overlaps (two CIDRs either nest or are disjoint)."""
    return [n if n.subnet_of(net) else net for n in nets if n.overlaps(net)]


@dataclass(frozen=True)
class AddressNarrowing:
    """A request's narrowing by destination address alone, on every port and protocol the template allows there
    (E2B's `allowOut`/`denyOut`): what `deny_out` names is taken away, except what `allow_out` names. The
    template's allowlist plays E2B's "all traffic": nothing outside it is ever reached."""

    allow_out: tuple[ipaddress.IPv4Network, ...] = ()
    deny_out: tuple[ipaddress.IPv4Network, ...] = ()

    KEYS = frozenset({"allow_out", "deny_out"})

    @classmethod
    def asked(cls, data: object) -> bool:
        return isinstance(data, dict) and bool(cls.KEYS & data.keys())

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AddressNarrowing:
        if extra := sorted(set(data) - cls.KEYS):
            raise policy_error(
                "network.invalid_policy", f"allow_out/deny_out narrowing takes no other keys, got {extra[:4]}"
            )
        lists = {k: data.get(k) or [] for k in cls.KEYS}
        if any(not isinstance(v, list) or len(v) > MAX_EGRESS_RULES for v in lists.values()):
            raise policy_error("network.invalid_policy", f"allow_out and deny_out are lists of ≤ {MAX_EGRESS_RULES}")
        return cls(
            tuple(_destination(x) for x in lists["allow_out"]), tuple(_destination(x) for x in lists["deny_out"])
        )

    def to_json(self) -> dict[str, list[str]]:
        return {"allow_out": [str(n) for n in self.allow_out], "deny_out": [str(n) for n in self.deny_out]}

    def apply(self, template: NetworkPolicy) -> NetworkPolicy:
        """The template's rules, each kept on its addresses outside deny_out and on those inside allow_out. An
        `allow_out` entry the template reaches nowhere is refused: it would silently grant nothing."""
        unreachable = [str(a) for a in self.allow_out if not any(a.overlaps(t.network) for t in template.egress)]
        if unreachable:
            raise CubeError(
                "network.policy_widened",
                f"allow_out names destinations the template does not allow: {', '.join(unreachable)}",
                "api",
                {"widened": unreachable, "template": template.to_json()},
            )
        by_port: dict[tuple[int, str], list[ipaddress.IPv4Network]] = {}
        for t in template.egress:
            kept = [*_without(t.network, self.deny_out), *_within(t.network, self.allow_out)]
            by_port.setdefault((t.port, t.proto), []).extend(kept)
        rules = sorted(
            EgressRule(net, port, proto)
            for (port, proto), nets in by_port.items()
            for net in ipaddress.collapse_addresses(nets)
        )
        if len(rules) > MAX_EGRESS_RULES:
            raise CubeError(
                "network.policy_too_large",
                f"allow_out/deny_out cut the template's allowlist into {len(rules)} rules (at most "
                f"{MAX_EGRESS_RULES}): deny fewer or wider address ranges",
                "api",
                {"rules": len(rules), "max": MAX_EGRESS_RULES},
            )
        return NetworkPolicy("allowlist", tuple(rules)) if rules else NetworkPolicy()


def parse_narrowing(requested: object) -> NetworkPolicy | AddressNarrowing:
    """A request's network field: rules of its own, or addresses alone (`allow_out`/`deny_out`)."""
    if AddressNarrowing.asked(requested):
        assert isinstance(requested, dict)
        return AddressNarrowing.from_json(requested)
    return NetworkPolicy.from_json(requested)


def narrow_network(template: NetworkPolicy, requested: object) -> NetworkPolicy:
    """The sandbox's policy: the template's, or the request's when every requested rule lies inside one of the
    template's (a subset of its addresses, same port and protocol). Anything wider is refused, never clipped.
    A request may instead narrow by address alone (`AddressNarrowing`: `allow_out`/`deny_out`)."""
    return template if requested is None else narrowed(template, parse_narrowing(requested))


def narrowed(template: NetworkPolicy, want: NetworkPolicy | AddressNarrowing) -> NetworkPolicy:
    """`narrow_network` of a parsed request."""
    if isinstance(want, AddressNarrowing):
        return want.apply(template)
    wider = [str(r) for r in want.egress if not any(t.covers(r) for t in template.egress)]
    if wider:
        raise CubeError(
            "network.policy_widened",
            f"the request asks for egress the template does not allow: {', '.join(wider)}",
            "api",
            {"widened": wider, "template": template.to_json()},
        )
    return want


@dataclass(frozen=True)
class ReadonlyMount:
    """A host directory shown read-only in the guest; only where the node's operator allowlisted `source`."""

    source: str
    target: str

    def to_json(self) -> dict[str, str]:
        return {"source": self.source, "target": self.target}


@dataclass(frozen=True)
class FilesystemPolicy:
    """`scratch_mib`: the workload's writable disk (mounted at /scratch, holding /tmp and the users' homes), a
    sparse file in the sandbox's state directory; None: no disk (the guest's RAM-backed files only)."""

    scratch_mib: int | None = None
    readonly_mounts: tuple[ReadonlyMount, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.scratch_mib is not None:
            out["scratch_mib"] = self.scratch_mib
        if self.readonly_mounts:
            out["readonly_mounts"] = [m.to_json() for m in self.readonly_mounts]
        return out


@dataclass(frozen=True)
class SandboxPolicy:
    network: NetworkPolicy = field(default_factory=NetworkPolicy)
    filesystem: FilesystemPolicy = field(default_factory=FilesystemPolicy)
    # Refused when set (kept only so a template that asks gets a code, not "unknown field"):
    nested_virtualization: bool = False
    privileged: bool = False
    host_namespaces: tuple[str, ...] = ()
    device_sharing: str = "exclusive"
    lifecycle: tuple[str, ...] = ()  # snapshot | clone | pause

    def to_json(self) -> dict[str, Any]:
        """Only what differs from the defaults, so templates written before `sandbox` keep their digest."""
        out: dict[str, Any] = {}
        if self.network != NetworkPolicy():
            out["network"] = self.network.to_json()
        if self.filesystem != FilesystemPolicy():
            out["filesystem"] = self.filesystem.to_json()
        if self.nested_virtualization:
            out["nested_virtualization"] = True
        if self.privileged:
            out["privileged"] = True
        if self.host_namespaces:
            out["host_namespaces"] = list(self.host_namespaces)
        if self.device_sharing != "exclusive":
            out["device_sharing"] = self.device_sharing
        if self.lifecycle:
            out["lifecycle"] = list(self.lifecycle)
        return out

    @classmethod
    def from_json(cls, data: object) -> SandboxPolicy:
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise policy_error("template.invalid_field", "spec.sandbox must be an object")
        fs = data.get("filesystem") or {}
        scratch = fs.get("scratch_mib")
        return cls(
            network=NetworkPolicy.from_json(data.get("network")),
            filesystem=FilesystemPolicy(
                scratch_mib=None if scratch is None else int(scratch),
                readonly_mounts=tuple(
                    ReadonlyMount(str(m["source"]), str(m["target"])) for m in fs.get("readonly_mounts") or ()
                ),
            ),
            nested_virtualization=bool(data.get("nested_virtualization", False)),
            privileged=bool(data.get("privileged", False)),
            host_namespaces=tuple(str(x) for x in data.get("host_namespaces") or ()),
            device_sharing=str(data.get("device_sharing", "exclusive")),
            lifecycle=tuple(str(x) for x in data.get("lifecycle") or ()),
        )


@dataclass(frozen=True)
class Refusal:
    code: str
    expected: str
    found: str
    hint: str = ""


def refusals(p: SandboxPolicy, accel_class: str) -> list[Refusal]:
    """What registration refuses in `spec.sandbox`, one entry per problem (the caller names the layer)."""
    out: list[Refusal] = []
    dev = f"a sandbox holding a passed-through {accel_class}"
    if p.nested_virtualization:
        out.append(
            Refusal(
                "compat.unsupported_nested_virtualization",
                "nested_virtualization: false",
                "true",
                f"{dev} exposes no virtualization extensions: a guest hypervisor could program the device's DMA",
            )
        )
    if p.privileged:
        out.append(
            Refusal(
                "compat.unsupported_privileged",
                "privileged: false",
                "true",
                "the workload runs unprivileged inside the MicroVM; the guest kernel is the boundary it may not own",
            )
        )
    if p.host_namespaces:
        out.append(
            Refusal(
                "compat.unsupported_host_namespace",
                "host_namespaces: []",
                ", ".join(p.host_namespaces),
                "a MicroVM shares no namespace with the host; use network.allowlist or readonly_mounts",
            )
        )
    if p.device_sharing != "exclusive":
        out.append(
            Refusal(
                "compat.unsupported_device_sharing",
                "device_sharing: exclusive",
                p.device_sharing,
                "one tenant per device (whole-function passthrough); MIG, vGPU and time slicing are not offered",
            )
        )
    if p.lifecycle:
        out.append(
            Refusal(
                "compat.unsupported_gpu_snapshot",
                "lifecycle: []",
                ", ".join(p.lifecycle),
                f"{dev} is never snapshotted, cloned or paused: device state cannot be saved or duplicated",
            )
        )
    out += _network_refusals(p.network)
    out += _filesystem_refusals(p.filesystem)
    return out


def _network_refusals(n: NetworkPolicy) -> Iterable[Refusal]:
    if bad := forbidden_overlap(n):
        yield Refusal(
            "compat.network_forbidden_destination",
            "egress to routable unicast addresses",
            ", ".join(bad),
            "loopback, link-local (metadata), multicast and broadcast destinations are never allowed",
        )


def _filesystem_refusals(fs: FilesystemPolicy) -> Iterable[Refusal]:
    if fs.scratch_mib is not None and not 16 <= fs.scratch_mib <= MAX_SCRATCH_MIB:
        yield Refusal("compat.scratch_invalid_size", f"16..{MAX_SCRATCH_MIB} MiB", f"{fs.scratch_mib} MiB")
    if len(fs.readonly_mounts) > MAX_READONLY_MOUNTS:
        yield Refusal("compat.mount_invalid", f"≤ {MAX_READONLY_MOUNTS} read-only mounts", str(len(fs.readonly_mounts)))
    targets: set[str] = set()
    for m in fs.readonly_mounts:
        problem = None
        if not _GUEST_PATH.fullmatch(m.source) or ".." in m.source.split("/"):
            problem = f"source {m.source!r}"
        elif not _GUEST_PATH.fullmatch(m.target) or ".." in m.target.split("/") or m.target in targets:
            problem = f"target {m.target!r}"
        elif any(m.target == r or m.target.startswith(r + "/") for r in ("/", *_RESERVED_TARGETS)[1:]):
            problem = f"target {m.target!r} (reserved)"
        targets.add(m.target)
        if problem:
            yield Refusal(
                "compat.mount_invalid",
                "absolute paths without '..'; a target outside the guest's system directories",
                problem,
            )


def mount_not_allowlisted(fs: FilesystemPolicy, allowlist: Sequence[str]) -> list[str]:
    """Sources outside every operator-allowlisted directory on this node (none allowlisted: every source)."""
    roots = [a.rstrip("/") or "/" for a in allowlist]
    return [
        m.source
        for m in fs.readonly_mounts
        if not any(m.source == r or m.source.startswith(r.rstrip("/") + "/") for r in roots)
    ]
