"""The E2B-compatible front door: E2B's REST API over CubeMaster and envd traffic to the sandboxes (docs/e2b.md)."""
