"""A sandbox id as the Cubelet accepts it, and the hash its workload token is kept as."""

from __future__ import annotations

import hashlib

from cubeaccel.model.ids import SANDBOX_ID_RE
from cubeaccel.protocol.errors import invalid


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def validate_sandbox_id(sandbox_id: object) -> str:
    if not isinstance(sandbox_id, str) or SANDBOX_ID_RE.fullmatch(sandbox_id) is None:
        raise invalid("reserve.invalid_sandbox_id", f"invalid sandbox id {sandbox_id!r}: [A-Za-z0-9._-], 1-63 chars")
    return sandbox_id
