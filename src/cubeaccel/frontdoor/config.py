"""The front door's settings (`cubeaccel api serve`), read by the routes and the envd proxy alike."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FrontDoorConfig:
    master_url: str
    admin_key: str
    secret: bytes  # derives each sandbox's envd access token; shared by every replica
    domain: str | None = None  # the E2B_DOMAIN way: REST at api.<domain>, envd at 49983-<id>.<domain>
    create_wait_s: float = 300.0  # how long create waits for the guest to be validated (running)
    # A sandbox lives on this lease until its create's reply is on its way: a front door that dies mid-create
    # leaves a sandbox that CubeMaster times out within the lease (docs/e2b.md, `--create-lease`). Above the
    # front door's call to CubeMaster (30 s), which a create may spend waiting for capacity.
    create_lease_s: float = 60.0
