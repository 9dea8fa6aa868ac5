"""Identifier grammars shared by every component. A sandbox id ends up in file names, argv tags and /proc
scans, so one strict pattern, defined once."""

from __future__ import annotations

import hashlib
import re

SANDBOX_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}"
SANDBOX_ID_RE = re.compile(SANDBOX_ID_PATTERN)
NODE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")

# A tenant's sandbox ids: the ones it chooses start with this (issue 30: ids are a namespace per tenant, so
# naming another tenant's id answers exactly as naming a free one does). 48 bits of a hash of the name: two
# tenants share a prefix with odds of ~n²/2^49 (2e-9 for 1,000 tenants).
TENANT_PREFIX_HEX = 12


def tenant_sandbox_prefix(tenant: str) -> str:
    return "t" + hashlib.sha256(b"cubeaccel.tenant:" + tenant.encode()).hexdigest()[:TENANT_PREFIX_HEX] + "-"
