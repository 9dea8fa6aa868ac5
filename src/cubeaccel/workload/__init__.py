"""cube-workload: the guest's workload service, an envd-compatible process and file API (stdlib only).

A separate process from cube-agent (validation): a workload can neither disturb nor impersonate validation.
It speaks envd's public protocol (Connect over HTTP/1.1 with the JSON codec, plus `/files` and `/health`) on
any byte-stream transport given to it as a `Listener` (see http1.py); see docs/workload.md.
"""

WORKLOAD_VERSION = "0.1.0"
# The envd release whose protocol subset this implements; what a front door reports as `envdVersion`.
# 0.6.4: file metadata (0.6.2), watch events with entry info (0.6.3) and the network-mount flag (0.6.4).
ENVD_VERSION = "0.6.4"
