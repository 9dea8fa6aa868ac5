"""What CubeMaster's store held before its records were typed: rows and replies as the dict-based code built them.

Tests compare the typed store with these, byte for byte, on SQLite and PostgreSQL.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from hypothesis import strategies as st

from cubeaccel.master import schema as S
from cubeaccel.master.store import MasterStore
from cubeaccel.wire import master_api as W

text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
scalar = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.floats(allow_nan=False, allow_infinity=False)
CHOICE_KEYS = ("class", "count", "selector", "model")  # in the order `AcceleratorChoice.to_json` writes them
choice = st.fixed_dictionaries(
    {"class": st.sampled_from(["gpu", "accelerator", "none"]), "count": st.integers(0, 8)},
    optional={"selector": text, "model": text},
).map(lambda c: {k: c[k] for k in CHOICE_KEYS if k in c})  # Hypothesis shuffles a dict's keys
accelerators = choice.flatmap(
    lambda c: st.one_of(st.just(c), st.lists(choice, min_size=1, max_size=2).map(lambda a: {**c, "alternatives": a}))
)
policy = st.dictionaries(text, scalar | st.lists(text, max_size=3), max_size=3)


@st.composite
def normalized_requests(draw: st.DrawFn) -> dict[str, Any]:
    """A create's normalized request, built as `CubeMaster.create` builds it (optional keys only when given)."""
    out: dict[str, Any] = {
        "template": draw(st.none() | text),
        "accelerators": [draw(accelerators)],
        "memory_mib": draw(st.none() | st.integers(256, 2**20)),
        "vcpus": draw(st.integers(1, 256)),
        "timeout_s": draw(st.none() | st.floats(0.001, 30 * 86400.0)),
    }
    for key, values in (
        ("metadata", st.dictionaries(text, text, min_size=1, max_size=3)),
        ("env_vars", st.dictionaries(st.from_regex(r"[A-Z_][A-Z0-9_]{0,6}", fullmatch=True), text, min_size=1)),
        ("network", policy),
        ("network_policy", policy),
    ):
        if draw(st.booleans()):
            out[key] = draw(values)
    return out


def old_create_row(sid: str, request: dict[str, Any], now: float, key: str | None, count: int) -> dict[str, Any]:
    """The row `CubeMaster.create` inserted (`S.sandboxes.insert().values(**row)`) before rows were typed."""
    return {
        "id": sid,
        "tenant": "t",
        "idempotency_key": key,
        "request": request,
        "state": "scheduling",
        "count": count,
        "device_ids": [],
        "timeline": [{"at": now, "phase": "requested"}],
        "created_at": now,
        "updated_at": now,
        "expires_at": now + 3600.0,
    }


def old_insert(store: MasterStore, row: dict[str, Any]) -> None:
    """As the dict-based `insert_or_existing` wrote a create: its idempotency record, then its row."""
    with store.tx() as c:
        if row["idempotency_key"]:
            c.execute(
                S.idempotency.insert().values(
                    tenant=row["tenant"],
                    idempotency_key=row["idempotency_key"],
                    sandbox_id=row["id"],
                    request=row["request"],
                    refusal=None,
                    created_at=row["created_at"],
                )
            )
        c.execute(S.sandboxes.insert().values(**row))


def raw_rows(store: MasterStore, table: sa.Table) -> list[tuple[str | None, ...]]:
    """Every column of every row as the database's own text (JSON as stored; NULL as None), in key order."""
    cols = [sa.cast(c, sa.Text).label(c.name) for c in table.columns]
    with store.tx() as c:
        return [tuple(r) for r in c.execute(sa.select(*cols).order_by(*table.primary_key.columns))]


def old_record(row: dict[str, Any], model: type[W.Sandbox] = W.Sandbox) -> W.Sandbox:
    """`sandbox_record` as it was on a dict row (no silent nodes)."""
    template = None
    if row["template_name"] is not None:
        digest = (row["contract"] or {}).get("template", {}).get("digest")
        template = W.SandboxTemplate(name=row["template_name"], version=row["template_version"], digest=digest)
    return model(
        id=row["id"],
        tenant=row["tenant"],
        state=row["state"],
        last_known_state=None,
        node=row["node"],
        accel_class=row["accel_class"],
        count=row["count"],
        device_ids=row["device_ids"],
        template=template,
        request=None if row["request"] is None else W.SandboxRequest.model_validate(row["request"]),
        error=None if row["error"] is None else W.SandboxError.model_validate(row["error"]),
        timeline=[W.TimelineEntry.model_validate(t) for t in row["timeline"] or ()],
        expires_at=row["expires_at"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
    )


def reply_bytes(model: W.Sandbox) -> str:
    return model.model_dump_json(by_alias=True)


def stored_state(store: MasterStore, sandbox_id: str) -> str:
    """The state CubeMaster's store holds for a sandbox it must have."""
    row = store.sandbox(sandbox_id)
    assert row is not None, f"{sandbox_id} is not in the store"
    return row.state
