"""CubeMaster's stored records, typed: what `MasterStore` returns and takes, one definition per row.

A sandbox row's JSON columns are parsed into the reply's own models (`wire/master_api.py`: the request as
stored, the error, the timeline), so the store, the placement code and the replies read one shape. Writing a
record back gives the JSON the columns always held: the same keys in the same order, an absent key still absent,
and a JSON column with nothing in it left SQL NULL (SQLAlchemy would store a Python None as the JSON `null`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cubeaccel.model.sandbox_states import SandboxState
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire import master_api as W


@dataclass(frozen=True)
class SandboxRow:
    """One row of `sandboxes` (master/schema.py says what each column is for)."""

    id: str
    tenant: str
    request: W.SandboxRequest
    state: SandboxState
    count: int
    created_at: float
    updated_at: float
    idempotency_key: str | None = None
    template_name: str | None = None
    template_version: str | None = None
    contract: dict[str, Any] | None = None  # model/contract CompatibilityContract.to_json, as frozen at placement
    node: str | None = None
    group_key: str | None = None
    accel_class: str | None = None
    pinned_mib: int = 0
    device_ids: tuple[str, ...] = ()
    cubelet_created_at: float | None = None  # Cubelet clock, from its reply
    warm_id: str | None = None
    error: W.SandboxError | None = None
    timeline: tuple[W.TimelineEntry, ...] = ()
    expires_at: float | None = None
    # What CubeMaster derived the sandbox's workload token from (master/auth.py `workload_token`), so that the
    # owner can get it again (connect); None: its creator chose the token (the E2B front door) or it predates.
    token_salt: str | None = None

    @classmethod
    def from_columns(cls, c: Mapping[str, Any]) -> SandboxRow:
        """A row as the database holds it (columns a caller leaves out take the table's defaults)."""
        error, timeline = c.get("error"), c.get("timeline")
        return cls(
            id=c["id"],
            tenant=c["tenant"],
            request=W.SandboxRequest.model_validate(c["request"]),
            state=SandboxState(c["state"]),
            count=int(c["count"]),
            created_at=float(c["created_at"]),
            updated_at=float(c["updated_at"]),
            idempotency_key=c.get("idempotency_key"),
            template_name=c.get("template_name"),
            template_version=c.get("template_version"),
            contract=c.get("contract"),
            node=c.get("node"),
            group_key=c.get("group_key"),
            accel_class=c.get("accel_class"),
            pinned_mib=int(c.get("pinned_mib") or 0),
            device_ids=tuple(c.get("device_ids") or ()),
            cubelet_created_at=c.get("cubelet_created_at"),
            warm_id=c.get("warm_id"),
            error=None if error is None else W.SandboxError.model_validate(error),
            timeline=tuple(W.TimelineEntry.model_validate(t) for t in timeline or ()),
            expires_at=c.get("expires_at"),
            token_salt=c.get("token_salt"),
        )

    def columns(self) -> dict[str, Any]:
        """The values to insert: the JSON columns as stored; an empty JSON column is left out (SQL NULL)."""
        out: dict[str, Any] = {
            "id": self.id,
            "tenant": self.tenant,
            "idempotency_key": self.idempotency_key,
            "request": self.request.model_dump(mode="json"),
            "state": self.state.value,
            "template_name": self.template_name,
            "template_version": self.template_version,
            "contract": self.contract,
            "node": self.node,
            "group_key": self.group_key,
            "accel_class": self.accel_class,
            "count": self.count,
            "pinned_mib": self.pinned_mib,
            "device_ids": list(self.device_ids),
            "cubelet_created_at": self.cubelet_created_at,
            "warm_id": self.warm_id,
            "error": None if self.error is None else self.error.model_dump(mode="json"),
            "timeline": [t.model_dump(mode="json") for t in self.timeline],
            "expires_at": self.expires_at,
            "token_salt": self.token_salt,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
        }
        return {k: v for k, v in out.items() if not (v is None and k in JSON_NULLABLE)}

    def request_json(self) -> dict[str, Any]:
        """The normalized request as stored: what an idempotent repeat is compared with."""
        return self.request.model_dump(mode="json")

    @property
    def template_digest(self) -> str | None:
        digest: str | None = (self.contract or {}).get("template", {}).get("digest")
        return digest


JSON_NULLABLE = frozenset({"contract", "error"})


# Not model/sandbox_policy.Refusal (one policy check's expected/found) nor frontdoor/mapping.Refusal (an E2B
# error answer): a keyed create's stored CubeError.
@dataclass(frozen=True)
class Refusal:
    """The CubeError a keyed create was refused with, kept on its idempotency record to answer a retry."""

    code: str
    layer: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)  # the error's own details (free-form per code)

    @classmethod
    def of(cls, e: CubeError) -> Refusal:
        return cls(e.code, e.layer, e.message, dict(e.details))

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Refusal:
        return cls(str(d["code"]), str(d["layer"]), str(d["message"]), dict(d.get("details") or {}))

    def to_json(self) -> dict[str, object]:
        """As `CubeError.to_json()["error"]`, which is what the column always held."""
        return {"code": self.code, "layer": self.layer, "message": self.message, "details": self.details}

    def replayed(self) -> CubeError:
        """The refusal raised again for a retry (status from the catalog)."""
        return CubeError(self.code, self.message, self.layer, {**self.details, "replayed": True}, 0)


@dataclass(frozen=True)
class IdempotencyRecord:
    """One row of `idempotency`: a keyed create's record, and its refusal once it was refused."""

    tenant: str
    idempotency_key: str
    sandbox_id: str
    request: W.SandboxRequest
    refusal: Refusal | None
    created_at: float

    @classmethod
    def from_columns(cls, c: Mapping[str, Any]) -> IdempotencyRecord:
        refusal = c["refusal"]
        return cls(
            tenant=c["tenant"],
            idempotency_key=c["idempotency_key"],
            sandbox_id=c["sandbox_id"],
            request=W.SandboxRequest.model_validate(c["request"]),
            refusal=None if refusal is None else Refusal.from_json(refusal),
            created_at=float(c["created_at"]),
        )


@dataclass(frozen=True)
class WarmClaim:
    """One row of `warm_claims`: a warm sandbox on a node that a create is taking."""

    node: str
    warm_id: str
    sandbox_id: str
    pool: str
    claimed_at: float


@dataclass(frozen=True)
class TemplateRecord:
    """One registered template version (`templates`)."""

    name: str
    version: str
    seq: int  # registration order: the latest version wins by name
    accel_class: str
    digest: str
    document: dict[str, Any]  # the template document as registered (model/template.Template.from_json reads it)
    created_at: float


@dataclass(frozen=True)
class SandboxChange:
    """A sandbox's state change, handed to `MasterStore.listeners` once its transaction is in."""

    sandbox_id: str
    event: str
    actor: str
    from_state: str
    to_state: str
    phase: str | None

    def to_json(self) -> dict[str, object]:
        return {
            "sandbox_id": self.sandbox_id,
            "event": self.event,
            "actor": self.actor,
            "from_state": self.from_state,
            "to_state": self.to_state,
            "phase": self.phase,
        }


@dataclass(frozen=True)
class Quota:
    """A tenant's quota (`tenants.quota`). None is unlimited. Lifetimes in seconds; `default_lifetime_s` applies to
    a create that names none."""

    max_sandboxes: int | None = None
    max_accelerators: dict[str, int] = field(default_factory=dict)  # by class
    max_pinned_mib: int | None = None
    max_lifetime_s: float | None = None
    default_lifetime_s: float | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "max_sandboxes": self.max_sandboxes,
            "max_accelerators": dict(self.max_accelerators),
            "max_pinned_mib": self.max_pinned_mib,
            "max_lifetime_s": self.max_lifetime_s,
            "default_lifetime_s": self.default_lifetime_s,
        }

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> Quota:
        return Quota(
            d.get("max_sandboxes"),
            {str(k): int(v) for k, v in (d.get("max_accelerators") or {}).items()},
            d.get("max_pinned_mib"),
            d.get("max_lifetime_s"),
            d.get("default_lifetime_s"),
        )
