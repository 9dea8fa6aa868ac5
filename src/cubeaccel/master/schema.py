"""CubeMaster's tables and their migrations (SQLAlchemy Core; SQLite or PostgreSQL).

Migrations are an ordered list of functions; `migrate` applies the missing ones in one transaction
under a lock (a PostgreSQL advisory lock; SQLite's `BEGIN IMMEDIATE`), so replicas starting together
migrate once. `meta.schema_version` records where a database is.

What keeps two replicas from double-placing is in the shape of these tables, not in a cache:
- `sandboxes.id` is the primary key and `(tenant, idempotency_key)` is unique: one record per sandbox,
  however many replicas receive the same create;
- a placement claims devices by setting `sandboxes.node/group_key/state='placing'` while holding the
  node's row lock (`SELECT … FROM nodes WHERE name = ? FOR UPDATE`); the claim is admitted only if the
  node's last summary minus claims it cannot show yet still has room. Claims are derived from the
  sandbox rows, so there is no counter to drift;
- a warm claim inserts `warm_claims(node, warm_id)` under the same node row lock (one create per warm
  sandbox), and the Cubelet's journal CAS on the warm row decides again;
- the Cubelet reserves devices with its own compare-and-swap, so even a wrong summary cannot put one
  device in two sandboxes; a refusal there sends the placement to the next candidate.
"""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa

from cubeaccel.model.ids import unkeyed_tenant_sandbox_prefix

metadata = sa.MetaData()

meta = sa.Table(
    "meta",
    metadata,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("value", sa.String(200), nullable=False),
)

nodes = sa.Table(
    "nodes",
    metadata,
    sa.Column("name", sa.String(128), primary_key=True),
    sa.Column("cubelet_url", sa.String(300), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),  # a NodeState value: ready | draining
    sa.Column("heartbeat", sa.JSON, nullable=False),  # the last heartbeat body, as sent
    sa.Column("received_at", sa.Float, nullable=False),  # master clock
    sa.Column("sent_at", sa.Float, nullable=False),  # Cubelet clock
    sa.Column("registered_at", sa.Float, nullable=False),
    sa.Column("reconciled_at", sa.Float, nullable=True),
    # sha256 of the heartbeat body without `sent_at`: a beat that matches it renews only received_at/sent_at
    sa.Column("summary_digest", sa.String(64), nullable=True),
)

templates = sa.Table(
    "templates",
    metadata,
    sa.Column("name", sa.String(200), primary_key=True),
    sa.Column("version", sa.String(200), primary_key=True),
    sa.Column("seq", sa.Integer, nullable=False),  # registration order: the latest version wins by name
    sa.Column("accel_class", sa.String(32), nullable=False),
    sa.Column("digest", sa.String(80), nullable=False),
    sa.Column("document", sa.JSON, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
)

defaults = sa.Table(
    "template_defaults",
    metadata,
    sa.Column("accel_class", sa.String(32), primary_key=True),
    sa.Column("template_name", sa.String(200), nullable=False),
)

sandboxes = sa.Table(
    "sandboxes",
    metadata,
    sa.Column("id", sa.String(63), primary_key=True),
    sa.Column("tenant", sa.String(128), nullable=False),
    sa.Column("idempotency_key", sa.String(200), nullable=True),
    sa.Column("request", sa.JSON, nullable=False),  # normalized user request (idempotency compares it)
    sa.Column("state", sa.String(16), nullable=False),  # a SandboxState value (model/sandbox_states.py)
    sa.Column("template_name", sa.String(200), nullable=True),
    sa.Column("template_version", sa.String(200), nullable=True),
    sa.Column("contract", sa.JSON, nullable=True),
    sa.Column("node", sa.String(128), nullable=True),
    sa.Column("group_key", sa.String(600), nullable=True),
    sa.Column("accel_class", sa.String(32), nullable=True),
    sa.Column("count", sa.Integer, nullable=False),
    sa.Column("pinned_mib", sa.Integer, nullable=False, server_default="0"),  # lockable memory the placement takes
    sa.Column("device_ids", sa.JSON, nullable=False),
    sa.Column("cubelet_created_at", sa.Float, nullable=True),  # Cubelet clock, from its reply
    # The warm sandbox this create is claiming or claimed (docs/warm.md). Its devices were held before the
    # claim, so such a row is never a claim on the node's summary (see `store._unseen`).
    sa.Column("warm_id", sa.String(63), nullable=True),
    sa.Column("error", sa.JSON, nullable=True),
    sa.Column("timeline", sa.JSON, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    # With `workload_token_key`, derives the sandbox's workload token (master/auth.py): its owner can get it again
    # (POST /v1/sandboxes/{id}/connect) while nothing stores it. NULL: the creator chose the token, or v6 and older.
    sa.Column("token_salt", sa.String(32), nullable=True),
    sa.UniqueConstraint("tenant", "idempotency_key", name="uq_sandbox_idempotency"),
    sa.Index("ix_sandboxes_node_state", "node", "state"),
    sa.Index("ix_sandboxes_state", "state"),
)

# One row per keyed create, written in the same transaction as its sandbox row: the atomic claim. It outlives
# a refusal (which deletes the sandbox row and records the error here), so a retry, on any replica, gets the
# original outcome instead of a fresh placement, a 500 or a row that is about to vanish.
idempotency = sa.Table(
    "idempotency",
    metadata,
    sa.Column("tenant", sa.String(128), primary_key=True),
    sa.Column("idempotency_key", sa.String(200), primary_key=True),
    sa.Column("sandbox_id", sa.String(63), nullable=False),
    sa.Column("request", sa.JSON, nullable=False),
    sa.Column("refusal", sa.JSON, nullable=True),  # the CubeError a refused create answered with
    sa.Column("created_at", sa.Float, nullable=False),
)

# One row per warm sandbox a create is handing out: the claim's compare-and-swap in CubeMaster's store. The
# primary key is the warm id on its node, inserted under the node's row lock, so two replicas never send one
# warm sandbox to two creates; the Cubelet's journal CAS is the final arbiter. Freed by maintenance once the
# create that wrote it settled and the warm id is either gone from the heartbeat or was never taken.
warm_claims = sa.Table(
    "warm_claims",
    metadata,
    sa.Column("node", sa.String(128), primary_key=True),
    sa.Column("warm_id", sa.String(63), primary_key=True),
    sa.Column("sandbox_id", sa.String(63), nullable=False),
    sa.Column("pool", sa.String(200), nullable=False),
    sa.Column("claimed_at", sa.Float, nullable=False),
)

tenants = sa.Table(
    "tenants",
    metadata,
    sa.Column("name", sa.String(128), primary_key=True),
    sa.Column("quota", sa.JSON, nullable=False),  # master/auth.py Quota; locked by every claim of the tenant
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("revoked_at", sa.Float, nullable=True),
    # The start of every sandbox id the tenant chooses (model/ids.py), fixed at its creation: keyed with the
    # `tenant_id_key` secret since v6; a tenant made before keeps the unkeyed one it had, so its ids stay valid.
    sa.Column("id_prefix", sa.String(16), nullable=True),
)

api_keys = sa.Table(
    "api_keys",
    metadata,
    sa.Column("id", sa.String(16), primary_key=True),  # the key's public id: e2b_<id><secret>, cbk_<id>_<secret>
    sa.Column("digest", sa.String(64), nullable=False),  # sha256 of the whole key; the key itself is never stored
    sa.Column("role", sa.String(16), nullable=False),  # admin | tenant
    sa.Column("tenant", sa.String(128), nullable=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("revoked_at", sa.Float, nullable=True),
)

node_credentials = sa.Table(
    "node_credentials",
    metadata,
    sa.Column("node", sa.String(128), primary_key=True),
    sa.Column("generation", sa.Integer, nullable=False),  # a token names its generation; re-enrol/revoke bumps it
    sa.Column("revoked", sa.Boolean, nullable=False),
    sa.Column("enrolled_at", sa.Float, nullable=False),
)


def _v1(conn: sa.Connection) -> None:
    for t in (nodes, templates, defaults, sandboxes):
        t.create(conn)


def _v2(conn: sa.Connection) -> None:
    """Placements claim pinned memory as they claim devices. (A database created at v2 already has it.)"""
    if "pinned_mib" not in {c["name"] for c in sa.inspect(conn).get_columns("sandboxes")}:
        conn.execute(sa.text("ALTER TABLE sandboxes ADD COLUMN pinned_mib INTEGER NOT NULL DEFAULT 0"))


def _v3(conn: sa.Connection) -> None:
    """Identities: tenants (with quotas), hashed API keys, node credential generations, the node-token secret."""
    import secrets

    for t in (tenants, api_keys, node_credentials):
        t.create(conn, checkfirst=True)
    if conn.execute(sa.select(meta.c.key).where(meta.c.key == "node_secret")).first() is None:
        conn.execute(meta.insert().values(key="node_secret", value=secrets.token_hex(32)))


def _v4(conn: sa.Connection) -> None:
    """Idempotency claims (issue 19): keyed creates already recorded keep their sandbox row as their claim."""
    idempotency.create(conn, checkfirst=True)


def _v5(conn: sa.Connection) -> None:
    """Warm claims (issue 28): the claim rows, and which warm sandbox a sandbox row took."""
    warm_claims.create(conn, checkfirst=True)
    if "warm_id" not in {c["name"] for c in sa.inspect(conn).get_columns("sandboxes")}:
        conn.execute(sa.text("ALTER TABLE sandboxes ADD COLUMN warm_id VARCHAR(63)"))


TENANT_ID_KEY = "tenant_id_key"  # meta row: the secret keying tenant id prefixes (hex)


def _v6(conn: sa.Connection) -> None:
    """Keyed tenant id prefixes: the installation's `tenant_id_key` secret (made here, once; backed up with the
    database), and each existing tenant's prefix stored as it was (unkeyed), so ids already issued stay valid."""
    import secrets

    if "id_prefix" not in {c["name"] for c in sa.inspect(conn).get_columns("tenants")}:
        conn.execute(sa.text("ALTER TABLE tenants ADD COLUMN id_prefix VARCHAR(16)"))
    if conn.execute(sa.select(meta.c.key).where(meta.c.key == TENANT_ID_KEY)).first() is None:
        conn.execute(meta.insert().values(key=TENANT_ID_KEY, value=secrets.token_hex(32)))
    for (name,) in conn.execute(sa.select(tenants.c.name).where(tenants.c.id_prefix.is_(None))).all():
        prefix = unkeyed_tenant_sandbox_prefix(name)
        conn.execute(tenants.update().where(tenants.c.name == name).values(id_prefix=prefix))


WORKLOAD_TOKEN_KEY = "workload_token_key"  # meta row: the secret deriving sandboxes' workload tokens (hex)


def _v7(conn: sa.Connection) -> None:
    """Workload tokens CubeMaster can give the owner again: each sandbox's salt, and the installation's secret."""
    import secrets

    if "token_salt" not in {c["name"] for c in sa.inspect(conn).get_columns("sandboxes")}:
        conn.execute(sa.text("ALTER TABLE sandboxes ADD COLUMN token_salt VARCHAR(32)"))
    if conn.execute(sa.select(meta.c.key).where(meta.c.key == WORKLOAD_TOKEN_KEY)).first() is None:
        conn.execute(meta.insert().values(key=WORKLOAD_TOKEN_KEY, value=secrets.token_hex(32)))


CREDENTIALS_CHANGED_KEY = "node_credentials_changed"  # meta row: rewritten at every re-enrolment or revocation


def _v8(conn: sa.Connection) -> None:
    """Heartbeats that repeat the node's summary write only its liveness: the summary's digest, so the next beat
    and each replica's cache can tell an unchanged summary without reading or re-parsing the JSON. NULL (a row
    written before) counts as changed: the next beat writes the whole row once. And the node credentials' change
    marker, which lets each replica keep the credentials it checked (master/credential_cache.py)."""
    if "summary_digest" not in {c["name"] for c in sa.inspect(conn).get_columns("nodes")}:
        conn.execute(sa.text("ALTER TABLE nodes ADD COLUMN summary_digest VARCHAR(64)"))
    if conn.execute(sa.select(meta.c.key).where(meta.c.key == CREDENTIALS_CHANGED_KEY)).first() is None:
        conn.execute(meta.insert().values(key=CREDENTIALS_CHANGED_KEY, value="0"))


MIGRATIONS: list[tuple[int, Callable[[sa.Connection], None]]] = [
    (1, _v1),
    (2, _v2),
    (3, _v3),
    (4, _v4),
    (5, _v5),
    (6, _v6),
    (7, _v7),
    (8, _v8),
]
SCHEMA_VERSION = MIGRATIONS[-1][0]


def migrate(conn: sa.Connection) -> int:
    """Bring the schema to SCHEMA_VERSION inside the caller's transaction; returns the version."""
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(770707)"))
    meta.create(conn, checkfirst=True)
    row = conn.execute(sa.select(meta.c.value).where(meta.c.key == "schema_version")).first()
    current = int(row[0]) if row else 0
    for version, step in MIGRATIONS:
        if version > current:
            step(conn)
            current = version
    if row is None:
        conn.execute(meta.insert().values(key="schema_version", value=str(current)))
    else:
        conn.execute(meta.update().where(meta.c.key == "schema_version").values(value=str(current)))
    return current
