"""Where a warm E2B create → first command goes, phase by phase, on real MicroVMs (issue 28); optionally beside a
baseline checkout in the same run.

A stack: one CubeMaster, one emulated Cubelet (edu stand-ins, real QEMU under TCG) with a warm pool of one, one
front door. Per round and stack, with the pool full (and nothing else of the bench's refilling): the E2B SDK's
`Sandbox.create` and first `commands.run("true")`, then the phases:

- create, from the client's clock and CubeMaster's timeline (one host, one clock): the SDK and front door up
  to CubeMaster's `requested`; the claim's `phases` (CubeMaster before the claim, the Cubelet's journal CAS, the
  shim's RNG reseed and rebind, the rest of the round trip); CubeMaster after the claim; the front door's
  lifetime call (`timeout_set`); the reply.
- the first command against the same request repeated once every cache is warm: through the SDK, then the
  same Connect `process.Process/Start` (`/bin/bash -l -c true`) sent raw through the front door, straight to
  the Cubelet's workload proxy, and straight to the shim's `workload.sock` (medians of 3 each): the
  differences are each layer's part; and `/bin/bash -l -c true` timed inside the guest (its own clock).

`--baseline DIR`: a second stack run from the checkout DIR (the code before a change, e.g. `git worktree add DIR
main`, with its own `DIR/.venv` whose editable install is DIR/src: a copy of this tree's venv with its
`_editable_impl_cubeaccel.pth` pointed at DIR/src will do), measured in alternation with this tree's:
before/after in the same run. Each stack boots the guest image built from its own checkout, so a change to the
guest's code (the workload service, the agent) is compared too.

Run: `PYTHONPATH=src:. .venv/bin/python bench/warm_path_bench.py [--rounds 3] [--baseline DIR]`. Prints JSON:
per stack, min/median/max of each phase, and /proc/loadavg before and after each create.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml
from e2b import Sandbox
from tests.support.frontdoor_process import FrontDoorProcess
from tests.support.master_harness import MasterProcess, emulated_cubelet
from tests.support.poll import poll
from tests.support.vmm_cleanup import kill_started_vmms
from tests.vm.test_master_ready import edu_template

from cubeaccel.images.builder import build
from cubeaccel.images.manifest import Manifest

TEMPLATE = "edu-warm-path"
START = "/process.Process/Start"
LOGIN_TRUE = {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "true"], "envs": {}}}
# `/bin/bash -l -c true` timed inside the guest: its own clock, so only differences count.
GUEST_TIMED = "s=$(date +%s%N); /bin/bash -l -c true; e=$(date +%s%N); echo $(( (e - s) / 1000 ))"


def spread(xs: list[float]) -> dict[str, float] | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"min": round(min(xs), 1), "median": round(statistics.median(xs), 1), "max": round(max(xs), 1)}


def loadavg() -> list[str]:
    return Path("/proc/loadavg").read_text().split()[:3]


@contextlib.contextmanager
def checkout(root: Path | None) -> Iterator[None]:
    """Processes started inside run the checkout at `root` (None: this tree) with its own interpreter
    (`root/.venv`, whose editable install is `root/src`): the Cubelet passes its shims no PYTHONPATH, so only
    the interpreter decides which code a shim runs."""
    if root is None:
        yield
        return
    python = root / ".venv/bin/python"
    if not python.exists():
        raise SystemExit(f"{python}: the baseline needs its own venv (an editable install of {root / 'src'})")
    before = os.environ.get("PYTHONPATH"), sys.executable
    os.environ["PYTHONPATH"], sys.executable = str(root / "src"), str(python)
    try:
        yield
    finally:
        if before[0] is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before[0]
        sys.executable = before[1]


def image_of(root: Path | None) -> Manifest:
    """The validation image built from the checkout at `root` (None: this tree), by that checkout's own code."""
    if root is None:
        return build()[0]
    code = "from cubeaccel.images.builder import build; print(build()[0].directory / 'manifest.json')"
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    out = subprocess.run([str(root / ".venv/bin/python"), "-c", code], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"building the baseline's image failed: {out.stderr[-2000:]}")
    return Manifest.load(Path(out.stdout.strip().splitlines()[-1]))


class Stack:
    def __init__(self, name: str, base: Path, doc: dict[str, Any], root: Path | None) -> None:
        self.name, self.base, self.doc, self.root = name, base, doc, root
        self.node = f"warm-path-{name}"
        base.mkdir(parents=True)
        (base / "template.yaml").write_text(yaml.safe_dump(doc))
        self.master: Any = None
        self.cubelet: Any = None
        self.fd: Any = None

    def start(self) -> Stack:
        with checkout(self.root):
            self.master = MasterProcess(self.base / "master").start()
            (self.base / "cubelet").mkdir()
            self.cubelet = emulated_cubelet(
                self.master,
                self.base / "cubelet",
                self.node,
                "--emulated-devices",
                "2",
                "--warm",
                f"{self.base / 'template.yaml'}=1",
            )
            self.cubelet.start()
            node = self.node
            poll(lambda: any(n["node"] == node and n["state"] == "ready" for n in self.master.client.nodes()), 600)
            self.master.client.register_template(self.doc)
            self.fd = FrontDoorProcess(self.base / "fd", self.master.url, self.master.admin_key).start()
        return self

    def stop(self) -> None:
        for part in (self.fd, self.cubelet, self.master):
            if part is not None:
                with contextlib.suppress(Exception):
                    part.stop()
        kill_started_vmms(self.base)

    @property
    def opts(self) -> dict[str, Any]:
        url = self.fd.url
        return {"api_key": self.master.tenant_key, "api_url": url, "sandbox_url": url, "request_timeout": 900}

    def pool_full(self) -> bool:
        pool = self.cubelet.client.request("GET", "/v1/warm/pools")["pools"][0]
        nodes = self.master.client.nodes()
        seen = sum(p.get("warm", 0) for n in nodes if n["node"] == self.node for p in n.get("warm_pools", []))
        return bool(pool["warm"] >= 1 and pool["starting"] == 0 and seen >= 1)

    def cubelet_url(self) -> str:
        return str(next(n["cubelet_url"] for n in self.master.client.nodes() if n["node"] == self.node))


def envelope(message: dict[str, Any]) -> bytes:
    raw = json.dumps(message).encode()
    return b"\x00" + struct.pack(">I", len(raw)) + raw


def raw_start(client: httpx.Client, url: str, headers: dict[str, str]) -> float:
    """One `process.Process/Start` of `/bin/bash -l -c true`, its streamed reply read to the end; ms."""
    t0 = time.perf_counter()
    with client.stream("POST", url, content=envelope(LOGIN_TRUE), headers=headers) as r:
        body = b"".join(r.iter_raw())
    ms = (time.perf_counter() - t0) * 1000
    if r.status_code != 200 or b'"end"' not in body:
        raise RuntimeError(f"{url}: {r.status_code} {body[-300:]!r}")
    return ms


def median_of(n: int, f: Callable[[], float]) -> float:
    return statistics.median(f() for _ in range(n))


def one_create(stack: Stack) -> dict[str, Any]:
    load_before = loadavg()
    t0 = time.time()
    sbx = Sandbox.create(TEMPLATE, **stack.opts)
    t1 = time.time()
    sbx.commands.run("true")
    t2 = time.time()
    sbx.commands.run("true")
    t3 = time.time()
    sid = sbx.sandbox_id
    token = str(sbx._envd_access_token)
    row = stack.master.client.sandbox(sid)
    tl = {e["phase"]: e for e in row["timeline"]}
    path = tl.get("path", {})
    connect = {"content-type": "application/connect+json", "connect-protocol-version": "1"}
    auth = {"X-Access-Token": token}
    with httpx.Client(timeout=120) as http:
        fd_ms = median_of(
            3,
            lambda: raw_start(
                http, stack.fd.url + START, {**connect, **auth, "E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"}
            ),
        )
        cubelet_ms = median_of(
            3, lambda: raw_start(http, f"{stack.cubelet_url()}/v1/sandboxes/{sid}/workload{START}", {**connect, **auth})
        )
    socks = list((stack.base / "cubelet").rglob(f"{path.get('warm_id', '?')}/workload.sock"))
    sock_ms = None
    if socks:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(socks[0])), timeout=120) as local:
            sock_ms = median_of(3, lambda: raw_start(local, "http://workload" + START, {**connect, **auth}))
    guest_ms = int(sbx.commands.run(GUEST_TIMED).stdout.strip()) / 1000
    stack.master.client.delete(sid)
    poll(lambda: stack.master.client.sandbox(sid)["state"] == "deleted", 300)
    reserved = tl.get("reserved", {})
    phases = reserved.get("phases") or {}
    requested_at = float(tl["requested"]["at"])
    answered_at = requested_at + (phases.get("master_ms", 0) + phases.get("claim_ms", 0)) / 1000
    lifetime_at = float(tl["timeout_set"]["at"]) if "timeout_set" in tl else None
    out: dict[str, Any] = {
        "path": path.get("path"),
        "create_ms": (t1 - t0) * 1000,
        "first_run_ms": (t2 - t1) * 1000,
        "create_to_first_run_ms": (t2 - t0) * 1000,
        "second_run_ms": (t3 - t2) * 1000,
        "client_to_master_ms": (requested_at - t0) * 1000,
        **{f"claim.{k}": v for k, v in phases.items()},
        "master_after_claim_ms": (float(reserved["at"]) - answered_at) * 1000 if reserved else None,
        "frontdoor_lifetime_ms": (lifetime_at - float(reserved["at"])) * 1000 if lifetime_at and reserved else None,
        "reply_to_client_ms": (t1 - (lifetime_at or float(reserved.get("at", t1)))) * 1000,
        "run_raw_via_frontdoor_ms": fd_ms,
        "run_raw_via_cubelet_ms": cubelet_ms,
        "run_raw_via_socket_ms": sock_ms,
        "guest_login_bash_ms": guest_ms,
        "load_before_after": [load_before, loadavg()],
    }
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", type=Path, help="a checkout whose src/ is measured beside this tree's")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="warm-path-"))
    stacks = [Stack("this", base / "this", edu_template(image_of(None), TEMPLATE), None)]
    if args.baseline is not None:
        root = args.baseline.resolve()
        stacks.insert(0, Stack("baseline", base / "baseline", edu_template(image_of(root), TEMPLATE), root))
    runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in stacks}
    load = [loadavg()]
    try:
        for s in stacks:
            s.start()
        for _ in range(args.rounds):
            for s in stacks:
                poll(lambda: all(x.pool_full() for x in stacks), 900, what="every pool full")
                runs[s.name].append(one_create(s))
    finally:
        load.append(loadavg())
        for s in stacks:
            s.stop()
    result: dict[str, Any] = {"rounds": args.rounds, "loadavg_before_after": load}
    for name, rs in runs.items():
        keys = [k for k in rs[0] if k not in ("path", "load_before_after")] if rs else []
        result[name] = {
            "paths": [r["path"] for r in rs],
            **{k: spread([r[k] for r in rs if isinstance(r.get(k), int | float)]) for k in keys},
            "load_per_create": [r["load_before_after"] for r in rs],
        }
    if len(stacks) == 2 and all(runs.values()):
        b, t = (statistics.median(r["create_to_first_run_ms"] for r in runs[n]) for n in ("baseline", "this"))
        result["this_over_baseline_median"] = round(t / b, 3)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
