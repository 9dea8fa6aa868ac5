"""A replica checks a node's signed requests against its copy of the live credentials: one read of the node's
credential row per change, not one per heartbeat. A revocation or re-enrolment on either replica still takes
effect: at once on the replica that made it, within the copy's TTL on the other."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from cubeaccel.master.auth import Auth, Identity, SignedRequest
from cubeaccel.master.store import MasterStore
from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport import node_sig


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MasterStore]:
    s = MasterStore(str(tmp_path / "m.db"))
    yield s
    s.close()


def credential_reads(store: MasterStore) -> list[str]:
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "FROM node_credentials" in statement:
            seen.append(statement)

    sa.event.listen(store.engine, "before_cursor_execute", record)
    return seen


def beat(auth: Auth, token: str, node: str = "n1") -> Identity | None:
    """`auth` checking one signed heartbeat from the node holding `token`, as the server's middleware does."""
    body = json.dumps({"node": node}).encode()
    target = f"/v1/nodes/{node}"
    headers = node_sig.sign(token, "PUT", target, body)
    signed = SignedRequest("PUT", target, body, headers[node_sig.BODY_HEADER])
    try:
        return auth.authenticate(headers["Authorization"], signed)
    except CubeError as e:
        assert e.code == "auth.invalid_credential"
        return None


def test_a_replica_reads_a_nodes_credential_once_not_at_every_heartbeat(store: MasterStore) -> None:
    auth = Auth(store)
    token = auth.enrol_node("n1")
    reads = credential_reads(store)
    for _ in range(20):
        ident = beat(auth, token)
        assert ident is not None and ident.node == "n1"
    for _ in range(20):
        assert auth.current_node_token("n1") == token
    assert len(reads) == 1


def test_revocation_and_re_enrolment_take_effect_on_both_replicas(store: MasterStore) -> None:
    a, b = Auth(store), Auth(store)
    a.credentials.ttl_s = b.credentials.ttl_s = 0.0  # each looks at the change marker at every request
    token = a.enrol_node("n1")
    assert beat(a, token) is not None and beat(b, token) is not None
    new = a.enrol_node("n1")  # re-enrolled: the old token stops working, the new one works on both at once
    assert beat(a, token) is None and beat(b, token) is None
    assert beat(a, new) is not None and beat(b, new) is not None
    b.revoke_node("n1")
    assert beat(b, new) is None and beat(a, new) is None
    assert a.current_node_token("n1") is None


def test_a_node_re_enrolled_elsewhere_is_accepted_before_the_copy_expires(store: MasterStore) -> None:
    a, b = Auth(store), Auth(store)
    b.credentials.ttl_s = 3600.0  # b never looks at the marker during the test
    token = a.enrol_node("n1")
    assert beat(b, token) is not None
    new = a.enrol_node("n1")
    assert beat(b, new) is not None  # a newer generation than b's copy: read from the row
