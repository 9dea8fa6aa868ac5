"""Who may call the Cubelet, decided before the app runs. The TCP listener answers only requests CubeMaster signed
with this node's token (`MasterOnly`, with `signed_body` checking the body against the signed hash); the unix
socket only root and the Cubelet's own uid (`LocalPeers`, from SO_PEERCRED). docs/security.md."""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response

from cubeaccel.cubelet.api.workload import WORKLOAD_PATH
from cubeaccel.host.service.throttle import Throttle
from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport import node_sig
from cubeaccel.transport.api_edges import error_response
from cubeaccel.transport.http_server import PEER_KEY


class MasterOnly:
    """The TCP listener's gate: a request CubeMaster signed with the current node token passes; anything else is
    a 401, and repeated failures for one presented credential a 429. `token` is read per request (it rotates)."""

    def __init__(self, token: Callable[[], str | None]) -> None:
        self._token = token
        self._throttle = Throttle()
        self._nonces = node_sig.NonceCache()

    async def signed_by_master(self, request: Request) -> str | None:
        """None if CubeMaster signed this request's headers with the current node token, else why not. The
        body is checked against the signed hash by `signed_body`, once the edge guard has read it."""
        claim = node_sig.parse(request.headers.get("authorization"), request.headers.get(node_sig.BODY_HEADER))
        now = self._token()
        if claim is None or not now:
            return "the Cubelet's TCP API answers CubeMaster only (a CubeSig signature)"
        target = node_sig.target_of(request.url.path, request.url.query)
        why = node_sig.check(claim, now, request.method, target, self._nonces)
        if why is None:
            request.state.node_claim = claim
        return why

    async def __call__(self, request: Request) -> Response | None:
        # The workload proxy checks the sandbox's own access token (hashed in its checkpoint) instead.
        # /metrics: device states and counts, no sandbox or tenant names (a scraper holds no node token).
        exempt = request.url.path in ("/v1/health", "/metrics") or WORKLOAD_PATH.match(request.url.path) is not None
        if not exempt and (why := await self.signed_by_master(request)) is not None:
            # Counted against the node the signature names, not the address; a valid one never reaches this line.
            claim = node_sig.parse(request.headers.get("authorization"), None)
            presented = f"node:{claim.node[:64]}" if claim is not None else "unsigned"
            try:
                self._throttle.check(presented)
            except CubeError as e:
                return error_response(e)
            self._throttle.fail(presented)
            code = "auth.invalid_credential" if request.headers.get("authorization") else "auth.missing_credential"
            return error_response(CubeError(code, why, "api", {}, 401))
        return None


async def signed_body(request: Request) -> None:
    """A dependency of every TCP route: the body read by the edge guard is the one CubeMaster signed."""
    claim = getattr(request.state, "node_claim", None)
    if claim is not None and not node_sig.body_matches(claim, await request.body()):
        raise CubeError("auth.invalid_credential", "the body is not the one signed", "api")


class LocalPeers:
    """The unix socket's gate: a caller whose uid (as the kernel says) is not in `uids` is refused, whatever the
    socket's file mode."""

    def __init__(self, uids: frozenset[int]) -> None:
        self._uids = uids

    async def __call__(self, request: Request) -> Response | None:
        peer = request.scope.get(PEER_KEY)
        if peer is None or peer[1] in self._uids:
            return None
        request.state.error_code = "auth.peer_not_allowed"
        return error_response(
            CubeError(
                "auth.peer_not_allowed",
                f"uid {peer[1]} may not use the Cubelet's socket (root or the Cubelet's own uid only)",
                "api",
                {"uid": peer[1]},
            )
        )
