"""What the guest and the host both speak: agent and envd messages, mux framing, shim reports, error codes.

Split from `model/` by who imports it: cube-agent and cube-workload (stdlib only, copied into the guest image)
import this package and nothing else of cubeaccel, so it imports only the standard library and itself. Host-only
domain rules (device states, contracts, templates, placement) stay in `model/`, which builds on this package.
import-linter holds both directions (`protocol-stdlib`, `guest-protocol-only` in pyproject.toml).
"""
