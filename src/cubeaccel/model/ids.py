"""Identifier grammars shared by every component. A sandbox id ends up in file names, argv tags and /proc
scans, so one strict pattern, defined once."""

from __future__ import annotations

import re

SANDBOX_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}"
SANDBOX_ID_RE = re.compile(SANDBOX_ID_PATTERN)
NODE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
