"""Identifier grammars shared by every component. A sandbox id ends up in file names, argv tags and /proc
scans, so one strict pattern, defined once."""

from __future__ import annotations

import hashlib
import hmac
import re

SANDBOX_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}"
SANDBOX_ID_RE = re.compile(SANDBOX_ID_PATTERN)
NODE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")

# A tenant's sandbox ids: the ones it chooses start with this (ids are a namespace per tenant, so naming another
# tenant's id answers exactly as naming a free one does). 48 bits of a MAC of the name: two tenants share a prefix
# with odds of ~n²/2^49 (2e-9 for 1,000 tenants).
TENANT_PREFIX_HEX = 12
_TENANT_CONTEXT = b"cubeaccel.tenant:"


def tenant_sandbox_prefix(tenant: str, key: bytes) -> str:
    """A tenant's id prefix, keyed with the installation's secret (CubeMaster's store: docs/security.md). Ids travel
    in host names (DNS, SNI) and logs; keyed, a prefix seen there cannot be matched against guessed customer names
    offline, as an unkeyed hash of the name could."""
    mac = hmac.new(key, _TENANT_CONTEXT + tenant.encode(), hashlib.sha256).hexdigest()
    return f"t{mac[:TENANT_PREFIX_HEX]}-"


def unkeyed_tenant_sandbox_prefix(tenant: str) -> str:
    """The prefix tenants made before keyed prefixes got (a hash of the name alone): theirs is kept where it is
    stored, so the ids they were issued stay valid. Never used for a new tenant."""
    return "t" + hashlib.sha256(_TENANT_CONTEXT + tenant.encode()).hexdigest()[:TENANT_PREFIX_HEX] + "-"
