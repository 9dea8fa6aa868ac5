"""How messages travel: the hardened HTTP server edge every listener shares, the clients of each API (one
request core, sync and async faces), node request signing, the proxy relay, and telemetry. The messages
themselves are `cubeaccel.wire` (no I/O; an import-linter contract keeps it so)."""
