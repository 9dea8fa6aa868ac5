"""The headers that describe one HTTP connection rather than its message (RFC 9110 §7.6.1, with the de-facto
`keep-alive` and `proxy-connection`), plus `host` and `content-length`, which each hop sets for its own
connection. Every proxy hop of ours (the front door, the Cubelet's workload proxy, the guest's port forwarder)
drops them both ways; one list, so that no hop forwards what another would not."""

from __future__ import annotations

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "host",
        "content-length",
    }
)
# The sandbox's own credentials and the front door's routing headers: they stay with the channel, so the app
# behind a sandbox's port never sees the sandbox's tokens (frontdoor/envd.py, workload/portforward.py).
SANDBOX_CHANNEL_HEADERS = frozenset(
    {"x-access-token", "e2b-traffic-access-token", "e2b-sandbox-id", "e2b-sandbox-port"}
)
