"""E2B ↔ CubeMaster, without I/O: request bodies, sandbox records, list filters and pages, error messages."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import json
import urllib.parse
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from cubeaccel.model.sandbox_states import SandboxState
from cubeaccel.wire import json_guard
from cubeaccel.wire.e2b_api import ListedSandbox, NetworkUpdate, NewSandbox, SandboxCreated, SandboxDetail
from cubeaccel.wire.master_api import Sandbox, SandboxBody, WarmSandbox

# What the guest's cube-workload implements (docs/workload.md); a test holds it equal to the guest's own constant.
ENVD_VERSION = "0.6.4"
ENVD_PORT = 49983
ACCELERATORS_KEY = "cubeaccel.accelerators"  # metadata key: overrides the template's default accelerator request
CLIENT_ID = "cubeaccel"
LIVE = SandboxState.RUNNING  # the only CubeMaster state E2B calls a sandbox (E2B's other one, paused, we never have)
TOKEN_CONTEXT = b"cubeaccel-envd-token/v1:"
TRAFFIC_TOKEN_CONTEXT = b"cubeaccel-traffic-token/v1:"
DEFAULT_TIMEOUT_S = 300  # E2B's lifetime for a create that names none (not CubeMaster's own default)
E2B_DEFAULT_TEMPLATE = "base"  # what the SDK sends when the caller names no template (examples/templates/base.yaml)


# An E2B-format error to raise; model/sandbox_policy.Refusal is a policy check's finding.
class Refusal(Exception):
    """An answer in E2B's error format: status, message, and whether the SDK may retry."""

    def __init__(self, status: int, message: str, retry: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry = retry


def traffic_token(secret: bytes, sandbox_id: str) -> str:
    """The sandbox's traffic token (E2B's `trafficAccessToken`): reaches its other ports, never envd's, so a
    URL to an app in the sandbox can be shared without sharing a shell in it. Derived as the envd token is."""
    mac = hmac.new(secret, TRAFFIC_TOKEN_CONTEXT + sandbox_id.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).decode().rstrip("=")


def envd_token(secret: bytes, sandbox_id: str) -> str:
    """The sandbox's envd access token, derived rather than stored: any front door replica holding the secret
    hands out the same token on create, connect and get_info, and checks it on envd traffic."""
    mac = hmac.new(secret, TOKEN_CONTEXT + sandbox_id.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).decode().rstrip("=")


def create_body(req: NewSandbox, sandbox_id: str, token: str) -> SandboxBody:
    """CubeMaster's create body for an E2B create. `templateID` is a registered template by name (or
    `name@version`), passed as it is: a GPU one, or `base`, the CPU-only one the SDK asks for by default. The
    metadata key `cubeaccel.accelerators` (shorthand `H100:2`, or a JSON list of alternatives) overrides the
    template's default request (a CPU-only template refuses it: `request.class_mismatch`). Built unchecked:
    CubeMaster checks it, and its refusal names the field; only the fields set here are sent."""
    unsupported = [
        name
        for name, asked in (
            ("autoPause", bool(req.auto_pause)),
            ("autoResume", req.auto_resume is not None),
            ("volumeMounts", bool(req.volume_mounts)),
        )
        if asked
    ]
    if unsupported:
        raise Refusal(
            400,
            f"cubeaccel (api): {', '.join(unsupported)} not supported: GPU sandboxes are never paused, "
            "snapshotted or given volumes (docs/e2b.md)",
        )
    metadata = dict(req.metadata or {})
    body: dict[str, Any] = {
        "id": sandbox_id,
        "template": req.template_id,
        "metadata": metadata,
        "env_vars": dict(req.env_vars or {}),
        "workload_token": token,
    }
    if (network := network_narrowing(req)) is not None:
        body["network"] = network
    # Older SDK lines send their 300 s themselves; 2.63 leaves it out and means E2B's default, not CubeMaster's.
    body["timeout_s"] = float(req.timeout if req.timeout is not None else DEFAULT_TIMEOUT_S)
    spec = metadata.get(ACCELERATORS_KEY)
    if spec is not None:
        text = spec.strip()
        if text.startswith("["):
            try:  # the strict parser: a hostile depth is a refusal by code, not a RecursionError (a 500)
                body["accelerators"] = json_guard.loads(text)
            except json_guard.JsonRefused as e:
                raise Refusal(400, f"cubeaccel (api): metadata {ACCELERATORS_KEY}: {e.code}: {e}") from e
        else:
            body["gpu"] = text
    return SandboxBody.model_construct(**body)


# E2B `network` options cubeaccel cannot express: egress goes straight from the sandbox's namespace, filtered by
# address; there is no proxy on the way to tunnel, rewrite or resolve names, and no per-sandbox URL host to mask.
E2B_NETWORK_UNSUPPORTED = {
    "egressProxy": "a SOCKS5 egress proxy",
    "rules": "per-host HTTP transforms",
    "maskRequestHost": "a custom host mask for sandbox URLs",
}
# `allowPublicTraffic` asks whether a sandbox's other ports may be reached without a token; here they never are
# (the traffic token or the envd token is always needed: docs/decisions.md), so either value is accepted.
E2B_NETWORK_KNOWN = {"allowOut", "denyOut", "allowPublicTraffic", *E2B_NETWORK_UNSUPPORTED}
# The update's options (E2B's SandboxNetworkUpdateConfig, and `allowPublicTraffic` as at create). `dnsServers`
# opens the firewall to those servers only when `allowOut` names a domain, which is refused here: it is checked
# (IPv4 addresses) and changes nothing. A null `egressProxy` is E2B's "no proxy", the only way egress goes here.
E2B_UPDATE_KNOWN = {"allowOut", "denyOut", "allowPublicTraffic", "dnsServers", "egressProxy", "rules"}
ALL_TRAFFIC = "0.0.0.0/0"
OPTION_UNSUPPORTED = "network.e2b_option_unsupported"
DESTINATION_UNSUPPORTED = "network.e2b_destination_unsupported"


def _network_refusal(code: str, message: str) -> Refusal:
    return Refusal(400, f"cubeaccel (api): {code}: {message} (docs/e2b.md)")


def _destinations(network: dict[str, Any], key: str) -> list[str]:
    """An `allowOut`/`denyOut` list as IPv4 CIDRs; domain names and IPv6 cannot be expressed."""
    raw = network.get(key)
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise _network_refusal(DESTINATION_UNSUPPORTED, f"{key} must be a list of IP addresses or CIDRs")
    out = []
    for entry in raw:
        try:
            net = ipaddress.ip_network(entry.strip(), strict=False) if isinstance(entry, str) else None
        except ValueError:
            net = None
        if not isinstance(net, ipaddress.IPv4Network):
            what = "IPv6 is off in every sandbox" if net is not None else "sandbox egress is filtered by address only"
            raise _network_refusal(
                DESTINATION_UNSUPPORTED, f"{key} entry {entry!r:.80}: not an IPv4 address or CIDR ({what})"
            )
        out.append(str(net))
    return out


def _dns_servers(network: dict[str, Any]) -> None:
    raw = network.get("dnsServers")
    if raw is None:
        return
    ok = isinstance(raw, list) and len(raw) <= 10
    for entry in raw if ok else ():
        try:
            ok = ok and isinstance(entry, str) and ipaddress.ip_address(entry.strip()).version == 4
        except ValueError:
            ok = False
    if not ok:
        raise _network_refusal(OPTION_UNSUPPORTED, "dnsServers must be a list of at most 10 IPv4 addresses")


def _narrowing(network: dict[str, Any], known: set[str], allow_internet_access: bool | None) -> dict[str, list[str]]:
    """E2B's network options as CubeMaster's address narrowing (model/sandbox_policy.AddressNarrowing): `denyOut`
    takes addresses away, `allowOut` keeps them whatever `denyOut` says, `allow_internet_access: false` is
    `denyOut: [0.0.0.0/0]`, and the template's allowlist is E2B's "all traffic"."""
    if unknown := sorted(set(network) - known):
        raise _network_refusal(OPTION_UNSUPPORTED, f"unknown network option(s) {', '.join(unknown)[:200]}")
    asked = [key for key in E2B_NETWORK_UNSUPPORTED if network.get(key) not in (None, "", [], {})]
    if asked:
        what = ", ".join(f"{key} ({E2B_NETWORK_UNSUPPORTED[key]})" for key in asked)
        raise _network_refusal(OPTION_UNSUPPORTED, f"{what}: sandbox egress is filtered by address, with no proxy")
    if not isinstance(network.get("allowPublicTraffic", True), bool):
        raise _network_refusal(OPTION_UNSUPPORTED, "allowPublicTraffic must be true or false")
    _dns_servers(network)
    allow, deny = _destinations(network, "allowOut"), _destinations(network, "denyOut")
    if allow_internet_access is False:  # E2B: the same as denyOut [0.0.0.0/0]
        deny.append(ALL_TRAFFIC)
    return {"allow_out": allow, "deny_out": deny}


def network_narrowing(req: NewSandbox) -> dict[str, list[str]] | None:
    """A create's `network` (and `allow_internet_access`) as CubeMaster's narrowing of the template's allowlist.
    None: the template's policy."""
    out = _narrowing(dict(req.network or {}), E2B_NETWORK_KNOWN, req.allow_internet_access)
    return out if out["allow_out"] or out["deny_out"] else None


def network_update(req: NetworkUpdate) -> dict[str, list[str]]:
    """An update's body (`update_network`) as the running sandbox's new narrowing, whole: E2B's update replaces
    the egress configuration, so what it leaves out is cleared (no lists: the template's whole allowlist)."""
    network = req.model_dump(by_alias=True, exclude_unset=True)
    allow_internet_access = network.pop("allow_internet_access", None)
    return _narrowing(network, E2B_UPDATE_KNOWN, allow_internet_access)


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def template_name(row: Sandbox) -> str:
    asked = row.request.template if row.request is not None else None
    return (row.template.name if row.template is not None else None) or asked or ""


def metadata_of(row: Sandbox) -> dict[str, str]:
    return dict(row.request.metadata) if row.request is not None else {}


def _listed_fields(row: Sandbox) -> dict[str, Any]:
    name = template_name(row)
    req = row.request
    return {
        "template_id": name,
        "sandbox_id": row.id,
        "client_id": CLIENT_ID,
        "alias": name or None,
        "started_at": iso(row.created_at),
        "end_at": iso(row.expires_at or row.created_at),
        "cpu_count": (req.vcpus if req is not None else 0) or 1,
        "memory_mb": (req.memory_mib if req is not None else 0) or 0,
        "disk_size_mb": 0,
        "state": "running",
        "envd_version": ENVD_VERSION,
        "metadata": metadata_of(row),
    }


def created(row: Sandbox, token: str, domain: str | None, traffic: str | None = None) -> SandboxCreated:
    name = template_name(row)
    return SandboxCreated.model_validate(
        {
            "template_id": name,
            "sandbox_id": row.id,
            "client_id": CLIENT_ID,
            "envd_version": ENVD_VERSION,
            "alias": name or None,
            "envd_access_token": token,
            "traffic_access_token": traffic,
            "domain": domain,
        }
    )


def listed(row: Sandbox) -> ListedSandbox:
    return ListedSandbox.model_validate(_listed_fields(row))


def detail(row: Sandbox, token: str, domain: str | None) -> SandboxDetail:
    return SandboxDetail.model_validate(
        {**_listed_fields(row), "envd_access_token": token, "domain": domain, "workload": _workload(row)}
    )


def _workload(row: Sandbox) -> dict[str, Any] | None:
    """CubeMaster's workload condition as E2B's extra property (an ISO time, like the SDK's other times)."""
    w = row.workload
    if w is None or w.state != "unresponsive":
        return None
    return {"state": w.state, "reason": w.reason, "since": iso(w.since), "message": w.message}


def parse_metadata_query(raw: str | None) -> dict[str, str]:
    """The SDK sends `metadata=` as the urlencoding of already-quoted pairs (`k%3Dv%26k2%3Dv2` on the wire)."""
    if not raw:
        return {}
    try:
        pairs = urllib.parse.parse_qsl(raw, keep_blank_values=True, strict_parsing=True)
    except ValueError as e:
        raise Refusal(400, f"cubeaccel (api): invalid metadata filter {raw!r:.100}: {e}") from e
    return {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in pairs}


def parse_states(raw: str | None) -> set[str]:
    """`state=running,paused` (comma-separated, as the SDK sends a list). Unknown states are a 400."""
    if not raw:
        return {"running", "paused"}
    states = {s.strip() for s in raw.split(",") if s.strip()}
    bad = states - {"running", "paused"}
    if bad:
        raise Refusal(400, f"cubeaccel (api): unknown state(s) {sorted(bad)}; known: running, paused")
    return states


def parse_order(raw: str | None) -> bool:
    """`order=asc|desc` by start time; True: newest first, E2B's default."""
    if raw in (None, "", "desc"):
        return True
    if raw == "asc":
        return False
    raise Refusal(400, f"cubeaccel (api): unknown order {raw!r:.40}; known: asc, desc")


def parse_started_after(raw: str | None) -> float | None:
    """`startedAfter=<ISO 8601>` (the SDK sends a local time with its offset) as epoch seconds."""
    if not raw:
        return None
    try:
        when = datetime.fromisoformat(raw)
    except ValueError as e:
        raise Refusal(400, f"cubeaccel (api): startedAfter {raw!r:.60} is not an ISO 8601 time") from e
    return (when if when.tzinfo is not None else when.replace(tzinfo=UTC)).timestamp()


def _started(row: Sandbox) -> float:
    """The start time at the microsecond `startedAt` shows (a client passes back what it was shown)."""
    return datetime.fromtimestamp(row.created_at, UTC).timestamp()


def _order_key(row: Sandbox) -> tuple[float, str]:
    return row.created_at, row.id


def select(
    rows: Sequence[Sandbox | WarmSandbox],
    metadata: dict[str, str],
    states: set[str],
    started_after: float | None = None,
    newest_first: bool = True,
) -> list[Sandbox]:
    """The live sandboxes whose metadata has every asked pair and that started at or after `started_after`,
    newest first as E2B lists them (or oldest first); ties broken by id, a stable order for pages."""
    if "running" not in states:
        return []
    out = [
        r
        for r in rows
        if isinstance(r, Sandbox)
        and r.state == LIVE
        and all(metadata_of(r).get(k) == v for k, v in metadata.items())
        and (started_after is None or _started(r) >= started_after)
    ]
    return sorted(out, key=_order_key, reverse=newest_first)


def page_token(row: Sandbox) -> str:
    raw = json.dumps([row.created_at, row.id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def page(
    rows: list[Sandbox], limit: int, token: str | None, newest_first: bool = True
) -> tuple[list[Sandbox], str | None]:
    """One page after the row a `nextToken` names (by its position in the order, so a sandbox that ends between
    pages shifts nothing), and the token of the next page (None when this is the last)."""
    if not 1 <= limit <= 1000:
        raise Refusal(400, "cubeaccel (api): limit must be 1..1000")
    start = 0
    if token:
        try:
            at, sid = json_guard.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
            after = (float(at), str(sid))
        except (ValueError, TypeError, binascii.Error) as e:
            raise Refusal(400, "cubeaccel (api): invalid nextToken") from e
        start = next(
            (i for i, r in enumerate(rows) if (_order_key(r) < after if newest_first else _order_key(r) > after)),
            len(rows),
        )
    chunk = rows[start : start + limit]
    more = start + limit < len(rows)
    return chunk, page_token(chunk[-1]) if more and chunk else None


def refusal_from_master(status: int, body: Any) -> Refusal:
    """CubeMaster's `{"error": {code, layer, message, details}}` as an E2B error: the message names the layer and
    the code, and for a placement refusal each node's reason (summarized: at most 8 nodes)."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return Refusal(502, f"cubeaccel (api): CubeMaster answered {status} without an error body", retry=True)
    return refusal_from_error(err, status)


def refusal_from_error(err: dict[str, Any], status: int) -> Refusal:
    code, layer, message = str(err.get("code")), str(err.get("layer")), str(err.get("message", ""))
    text = f"cubeaccel ({layer}): {code}: {message}"
    raw = err.get("details")
    details: dict[str, Any] = raw if isinstance(raw, dict) else {}
    reasons: list[str] = []
    for tried in details.get("tried") or []:
        for node, why in sorted((tried.get("nodes") or {}).items()):
            reasons.append(f"{node}: {why.get('reason')}" + (f" ({why['detail']})" if why.get("detail") else ""))
    for attempt in details.get("attempts") or []:
        reasons.append(f"{attempt.get('node')}: {attempt.get('code')}")
    if code == "template.unknown" and details.get("template") == E2B_DEFAULT_TEMPLATE:
        text += " (E2B's default template: register examples/templates/base.yaml, as `cubeaccel up` does)"
    if reasons:
        shown = reasons[:8] + ([f"... {len(reasons) - 8} more"] if len(reasons) > 8 else [])
        text += " [nodes: " + "; ".join(shown) + "]"
    if status == 422:  # E2B says 400 for a request it cannot take
        status = 400
    # Retrying helps where what is missing is coming back (a device being released or scrubbed) or in flight.
    retry = status == 429 or code in ("sandbox.create_in_progress", "schedule.capacity_returning")
    return Refusal(status, text, retry=retry)
