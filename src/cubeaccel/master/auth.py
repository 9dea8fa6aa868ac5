"""Who is calling CubeMaster: tenants and admins with API keys, nodes with per-node tokens (docs/security.md).

API keys are `e2b_<id><secret>` (8 + 64 lowercase hex: the shape every E2B SDK line accepts; 2.25-2.45 refuse
any other before sending) with a 256-bit random secret: shown once, stored as sha256 (a slow hash buys nothing for a
random 256-bit secret), looked up by `id` and compared in constant time. Keys made before that, `cbk_<id>_<secret>`,
keep working. A node token is
`cbn:<node>:<generation>:<hmac>`, an HMAC of the node and its generation under a secret in the database:
CubeMaster stores no token, can present a node's token to that node's Cubelet, and revokes one by bumping
the generation (docs/decisions.md). Repeated failures of one presented credential are throttled; a valid
one never is.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from cubeaccel.host.service.throttle import Throttle
from cubeaccel.master import schema as S
from cubeaccel.master.credential_cache import NodeCredentialCache, mark_credentials_changed
from cubeaccel.master.records import Quota
from cubeaccel.master.store import MasterStore
from cubeaccel.model.ids import NODE_ID_RE, tenant_sandbox_prefix, unkeyed_tenant_sandbox_prefix
from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport import node_sig
from cubeaccel.wire.master_api import KeyRow, QuotaShown, TenantRow

ADMIN, TENANT, NODE, ANONYMOUS = "admin", "tenant", "node", "anonymous"
DEFAULT_TENANT = "default"
TENANT_RE = NODE_ID_RE
WORKLOAD_TOKEN_CONTEXT = b"cubeaccel.workload-token:"


@dataclass(frozen=True)
class Identity:
    role: str
    tenant: str | None = None
    node: str | None = None
    key_id: str | None = None

    def label(self) -> str:
        """The identity as the audit log names it (never the secret)."""
        if self.role == NODE:
            return f"node:{self.node}"
        if self.role == TENANT:
            return f"tenant:{self.tenant}/{self.key_id}"
        if self.role == ADMIN:
            return f"admin/{self.key_id}"
        return ANONYMOUS


ANON = Identity(ANONYMOUS)


@dataclass(frozen=True)
class SignedRequest:
    """What a node's signature must cover: the request as received."""

    method: str
    target: str
    body: bytes
    body_sha: str | None


def unauthorized(code: str, message: str) -> CubeError:
    return CubeError(code, message, "api", {}, 401)


def forbidden(message: str) -> CubeError:
    return CubeError("auth.forbidden", message, "api")


def credential_of(header: str, signed: SignedRequest | None) -> str:
    """What a failed credential is counted against: the API key id or the node it names, never a secret."""
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer":
        kid = key_id_of(token.strip())
        if kid is not None:
            return f"key:{kid}"
        if token.strip().startswith("cbn:"):
            return f"node:{token.strip().split(':')[1][:64] if token.count(':') > 1 else '?'}"
        return "bearer:malformed"
    if scheme == node_sig.SCHEME:
        claim = node_sig.parse(header, signed.body_sha if signed is not None else None)
        return f"node:{claim.node[:64]}" if claim is not None else "sig:malformed"
    return "scheme:other"


KEY_PREFIX = "e2b_"
KEY_ID_HEX = 8
_KEY_RE = re.compile(rf"{KEY_PREFIX}([0-9a-f]{{{KEY_ID_HEX}}})[0-9a-f]{{64}}")
_OLD_KEY_RE = re.compile(r"cbk_([^_]{1,64})_[^_]+")


def key_id_of(key: str) -> str | None:
    """The id an API key names (`e2b_<8 hex id><64 hex>`, or the older `cbk_<id>_<secret>`); None: neither shape."""
    m = _KEY_RE.fullmatch(key) or _OLD_KEY_RE.fullmatch(key)
    return None if m is None else m.group(1)


def new_key() -> tuple[str, str]:
    """(key id, key) in the E2B shape."""
    kid = secrets.token_hex(KEY_ID_HEX // 2)
    return kid, f"{KEY_PREFIX}{kid}{secrets.token_hex(32)}"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _meta_secret(c: sa.Connection, key: str) -> bytes:
    """One of the installation's secrets, made by a migration (master/schema.py) and kept in the database."""
    return bytes.fromhex(c.execute(sa.select(S.meta.c.value).where(S.meta.c.key == key)).scalar_one())


class Auth:
    def __init__(self, store: MasterStore, throttle: Throttle | None = None) -> None:
        self.store = store
        self.throttle = throttle or Throttle()
        self.nonces = node_sig.NonceCache()  # this replica's: see docs/security.md for the window across replicas
        with store.tx() as c:
            self._secret = _meta_secret(c, "node_secret")
            self._tenant_id_key = _meta_secret(c, S.TENANT_ID_KEY)
            self._workload_token_key = _meta_secret(c, S.WORKLOAD_TOKEN_KEY)
        self._prefixes: dict[str, str] = {}  # tenant → its id prefix (fixed at its creation)
        self.credentials = NodeCredentialCache(store)  # live node credentials, without a read per request

    # ---- verifying ----------------------------------------------------------------------------------
    def authenticate(self, header: str | None, signed: SignedRequest | None = None) -> Identity | None:
        """The caller's identity from `Authorization: Bearer <API key>` or a node's `CubeSig` signature
        (`signed`: the request it must match); None when there is no credential.

        The credential is checked first and a valid one is never throttled; failures are counted against the
        credential that was presented (its key id, the node it claims), never against the source address, which
        the front door, the nodes and every proxied client share (issue 30 #3)."""
        if not header:
            return None
        scheme, _, token = header.partition(" ")
        why = "the credential is unknown, malformed or revoked"
        ident: Identity | None = None
        if scheme.lower() == "bearer" and token.strip().startswith("cbn:"):
            why = "a node token is never sent itself: node requests are signed (CubeSig)"
        elif scheme.lower() == "bearer":
            ident = self._verify(token.strip())
        elif scheme == node_sig.SCHEME and signed is not None:
            ident, why = self._verify_signed(header, signed)
        if ident is None:
            presented = credential_of(header, signed)
            self.throttle.check(presented)  # a credential that keeps failing is answered 429, not 401
            self.throttle.fail(presented)
            raise unauthorized("auth.invalid_credential", why)
        return ident

    def _verify_signed(self, header: str, req: SignedRequest) -> tuple[Identity | None, str]:
        claim = node_sig.parse(header, req.body_sha)
        if claim is None or NODE_ID_RE.fullmatch(claim.node) is None:
            return None, "a malformed node signature"
        gen = self.credentials.generation(claim.node)
        if gen is not None and gen < claim.generation:  # re-enrolled on another replica since this one looked
            gen = self.credentials.generation(claim.node, fresh=True)
        if gen != claim.generation:
            return None, "the node's credential is unknown, revoked or replaced"
        token = self.node_token(claim.node, claim.generation)
        why = node_sig.check(claim, token, req.method, req.target, self.nonces)
        if why is None and not node_sig.body_matches(claim, req.body):
            why = "the body is not the one signed"
        return (Identity(NODE, node=claim.node), "") if why is None else (None, why)

    def _verify(self, token: str) -> Identity | None:
        kid = key_id_of(token)
        if kid is None:
            return None
        with self.store.tx() as c:
            r = c.execute(sa.select(S.api_keys).where(S.api_keys.c.id == kid)).first()
            if r is None or r.revoked_at is not None or not hmac.compare_digest(r.digest, _digest(token)):
                return None
            if r.role == TENANT:
                t = c.execute(sa.select(S.tenants.c.revoked_at).where(S.tenants.c.name == r.tenant)).first()
                if t is None or t.revoked_at is not None:
                    return None
        return Identity(str(r.role), tenant=r.tenant, key_id=str(r.id))

    def workload_token(self, sandbox_id: str, salt: str) -> str:
        """A sandbox's workload (envd) access token, derived rather than stored: CubeMaster passes it to the node
        at the start and gives it again to the sandbox's owner (connect), as E2B's connect does; nothing stores the
        token (the node keeps its hash). The per-sandbox salt keeps an id used again from getting the same token."""
        msg = WORKLOAD_TOKEN_CONTEXT + f"{sandbox_id}:{salt}".encode()
        mac = hmac.new(self._workload_token_key, msg, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).decode().rstrip("=")

    def node_token(self, node: str, generation: int) -> str:
        mac = hmac.new(self._secret, f"{node}:{generation}".encode(), hashlib.sha256).hexdigest()
        return f"cbn:{node}:{generation}:{mac}"

    def current_node_token(self, node: str) -> str | None:
        """What CubeMaster presents to `node`'s Cubelet (None: never enrolled or revoked)."""
        gen = self.credentials.generation(node)
        return None if gen is None else self.node_token(node, gen)

    # ---- managing -----------------------------------------------------------------------------------
    def create_key(self, role: str, tenant: str | None = None) -> tuple[str, str]:
        """(key id, the key): the key is returned once and stored only as a digest."""
        if role not in (ADMIN, TENANT) or (role == TENANT) != (tenant is not None):
            raise ValueError(f"bad key role {role!r} for tenant {tenant!r}")
        kid, key = new_key()
        with self.store.tx() as c:
            if tenant is not None:
                t = c.execute(sa.select(S.tenants.c.revoked_at).where(S.tenants.c.name == tenant)).first()
                if t is None or t.revoked_at is not None:
                    raise CubeError("tenant.not_found", f"no tenant {tenant!r}", "api")
            c.execute(
                S.api_keys.insert().values(
                    id=kid, digest=_digest(key), role=role, tenant=tenant, created_at=time.time()
                )
            )
        return kid, key

    def keys(self, tenant: str | None = None) -> list[KeyRow]:
        """Live keys (ids, never digests): one tenant's, or (None) every key."""
        q = sa.select(S.api_keys).where(S.api_keys.c.revoked_at.is_(None)).order_by(S.api_keys.c.created_at)
        if tenant is not None:
            q = q.where(S.api_keys.c.tenant == tenant)
        with self.store.tx() as c:
            return [KeyRow(key_id=r.id, role=r.role, tenant=r.tenant, created_at=r.created_at) for r in c.execute(q)]

    def revoke_key(self, kid: str, tenant: str | None = None) -> None:
        """Revoke `kid`; with `tenant`, only if it is that tenant's (another's is 404, as if it did not exist)."""
        cond = [S.api_keys.c.id == kid, S.api_keys.c.revoked_at.is_(None)]
        if tenant is not None:
            cond.append(S.api_keys.c.tenant == tenant)
        with self.store.tx() as c:
            n = c.execute(S.api_keys.update().where(*cond).values(revoked_at=time.time())).rowcount
        if n != 1:
            raise CubeError("key.not_found", f"no live key {kid!r}", "api")

    def has_admin(self) -> bool:
        with self.store.tx() as c:
            q = sa.select(S.api_keys.c.id).where(S.api_keys.c.role == ADMIN, S.api_keys.c.revoked_at.is_(None))
            return c.execute(q.limit(1)).first() is not None

    def create_tenant(self, name: str, quota: Quota) -> None:
        if TENANT_RE.fullmatch(name) is None:
            raise CubeError("tenant.invalid_name", f"invalid tenant name {name!r}", "api")
        with self.store.tx() as c:
            r = c.execute(sa.select(S.tenants.c.name).where(S.tenants.c.name == name)).first()
            if r is not None:
                raise CubeError("tenant.exists", f"tenant {name!r} exists", "api")
            prefix = tenant_sandbox_prefix(name, self._tenant_id_key)
            c.execute(
                S.tenants.insert().values(name=name, quota=quota.to_json(), created_at=time.time(), id_prefix=prefix)
            )

    def sandbox_prefix(self, tenant: str) -> str:
        """The start of every sandbox id `tenant` chooses: stored at its creation (keyed with the installation's
        secret; a tenant made before that keeps its unkeyed one, so ids issued stay valid)."""
        if tenant not in self._prefixes:
            with self.store.tx() as c:
                r = c.execute(sa.select(S.tenants.c.id_prefix).where(S.tenants.c.name == tenant)).first()
            # No row (a create for a tenant that is refused later) or a row an older replica wrote: the keyed one
            # for an unknown name, the unkeyed one it had for a row without a prefix.
            if r is None:
                return tenant_sandbox_prefix(tenant, self._tenant_id_key)
            self._prefixes[tenant] = r.id_prefix or unkeyed_tenant_sandbox_prefix(tenant)
        return self._prefixes[tenant]

    def tenants(self) -> list[TenantRow]:
        with self.store.tx() as c:
            keys: dict[str, list[str]] = {}
            for k in c.execute(sa.select(S.api_keys).where(S.api_keys.c.revoked_at.is_(None))):
                keys.setdefault(k.tenant or "", []).append(k.id)
            return [
                TenantRow(
                    name=r.name,
                    quota=QuotaShown.model_validate(r.quota),
                    created_at=r.created_at,
                    revoked=r.revoked_at is not None,
                    keys=sorted(keys.get(r.name, [])),
                )
                for r in c.execute(sa.select(S.tenants).order_by(S.tenants.c.name))
            ]

    def revoke_tenant(self, name: str) -> None:
        with self.store.tx() as c:
            n = c.execute(
                S.tenants.update()
                .where(S.tenants.c.name == name, S.tenants.c.revoked_at.is_(None))
                .values(revoked_at=time.time())
            ).rowcount
            c.execute(S.api_keys.update().where(S.api_keys.c.tenant == name).values(revoked_at=time.time()))
        if n != 1:
            raise CubeError("tenant.not_found", f"no live tenant {name!r}", "api")

    def revoked_tenants(self) -> set[str]:
        with self.store.tx() as c:
            return {
                str(r.name) for r in c.execute(sa.select(S.tenants.c.name).where(S.tenants.c.revoked_at.isnot(None)))
            }

    def quota(self, tenant: str) -> Quota:
        with self.store.tx() as c:
            r = c.execute(sa.select(S.tenants.c.quota).where(S.tenants.c.name == tenant)).first()
        return Quota() if r is None else Quota.from_json(r.quota)

    def enrol_node(self, node: str) -> str:
        """A fresh token for `node`; any earlier one stops working."""
        if NODE_ID_RE.fullmatch(node) is None:
            raise CubeError("node.invalid_name", f"invalid node name {node!r}", "api")
        with self.store.tx() as c:
            r = c.execute(
                sa.select(S.node_credentials).where(S.node_credentials.c.node == node).with_for_update()
            ).first()
            gen = 1 if r is None else int(r.generation) + 1
            if r is None:
                c.execute(
                    S.node_credentials.insert().values(
                        node=node, generation=gen, revoked=False, enrolled_at=time.time()
                    )
                )
            else:
                c.execute(
                    S.node_credentials.update()
                    .where(S.node_credentials.c.node == node)
                    .values(generation=gen, revoked=False, enrolled_at=time.time())
                )
                mark_credentials_changed(c)
        self.credentials.drop()
        return self.node_token(node, gen)

    def revoke_node(self, node: str) -> None:
        with self.store.tx() as c:
            n = c.execute(
                S.node_credentials.update().where(S.node_credentials.c.node == node).values(revoked=True)
            ).rowcount
            mark_credentials_changed(c)
        self.credentials.drop()
        if n != 1:
            raise CubeError("node.not_found", f"node {node!r} was never enrolled", "api")


def bootstrap(auth: Auth) -> dict[str, str] | None:
    """First start: an admin key, the `default` tenant and its key (None when an admin key exists already)."""
    if auth.has_admin():
        return None
    _, admin = auth.create_key(ADMIN)
    try:
        auth.create_tenant(DEFAULT_TENANT, Quota())
    except CubeError as e:
        if e.code != "tenant.exists":
            raise
    _, tenant = auth.create_key(TENANT, DEFAULT_TENANT)
    return {"admin": admin, DEFAULT_TENANT: tenant}


# ---- audit seals: each replica's log head, kept in the database (host/service/audit.py) --------------------------
SEAL_PREFIX = "audit_seal:"


def seal_key(log_id: str) -> str:
    return SEAL_PREFIX + log_id[:32]  # fits meta.key; 128 bits tell logs apart


class DatabaseSeal:
    """A sealer for `AuditLog`: the newest (seq, hash) of each log in `meta`, so cutting the file's tail shows
    even when its head file goes too. Written by one background thread that keeps only the newest head: an
    audited request does not wait for a database commit, and a burst costs one write. The seal may lag the
    log by what that thread has not written yet (never lead it)."""

    def __init__(self, store: MasterStore) -> None:
        self.store = store
        self._pending: dict[str, tuple[int, str]] = {}
        self._cv = threading.Condition()
        self._busy = False
        self._thread = threading.Thread(target=self._run, name="audit-seal", daemon=True)
        self._thread.start()

    def __call__(self, log_id: str, seq: int, digest: str) -> None:
        with self._cv:
            if self._pending.get(log_id, (0, ""))[0] < seq:
                self._pending[log_id] = (seq, digest)
            self._cv.notify_all()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every head handed over is in the database (tests; shutdown)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._pending and not self._busy, timeout_s)

    def _run(self) -> None:
        failures = 0
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._pending))
                batch, self._pending, self._busy = self._pending, {}, True
            try:
                for log_id, (seq, digest) in batch.items():
                    self._write(log_id, seq, digest)
                failures = 0
            except Exception:  # the database is away: retry the newest head a few times, then wait for the next
                failures += 1
                with self._cv:
                    for log_id, head in batch.items():
                        if failures < 3:
                            self._pending.setdefault(log_id, head)
                time.sleep(0.5)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _write(self, log_id: str, seq: int, digest: str) -> None:
        value = json.dumps({"seq": seq, "hash": digest})
        key = seal_key(log_id)
        with self.store.tx() as c:
            row = c.execute(sa.select(S.meta.c.value).where(S.meta.c.key == key).with_for_update()).first()
            if row is None:
                c.execute(S.meta.insert().values(key=key, value=value))
            elif int(json.loads(row.value)["seq"]) < seq:  # never back: a late writer cannot undo a seal
                c.execute(S.meta.update().where(S.meta.c.key == key).values(value=value))


def audit_seals(store: MasterStore) -> list[dict[str, Any]]:
    with store.tx() as c:
        rows = c.execute(sa.select(S.meta).where(S.meta.c.key.startswith(SEAL_PREFIX))).all()
    return [{"log": r.key[len(SEAL_PREFIX) :], **json.loads(r.value)} for r in rows]
