"""`cube-agent` command line (argparse: the guest has no typer).

  cube-agent probe --contract FILE [--json] [--root /]     one-shot check on any Linux host; exit 0 = all pass
  cube-agent serve --port NAME|PATH | --stdio               the guest's protocol server (started by init)
  cube-agent scrub --cuda [--max-bytes N] | --bar ADDRESS    zero the device's memory and verify samples (scrub VM;
                                                            --max-bytes bounds it to measure the rate on a real GPU)

`probe` is read-only by default: it loads no modules and never changes persistence mode unless told to.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from cubeaccel.agent.probes import ProbeContext
from cubeaccel.agent.protocol import DEFAULT_MAX_REQUEST_BYTES, Agent
from cubeaccel.agent.report import probe_reply
from cubeaccel.agent.serve import ServeOptions, log, poweroff, serve
from cubeaccel.agent.spec import parse_spec
from cubeaccel.guest.virtio_port import open_port, resolve_port
from cubeaccel.protocol.agent_messages import PCI_ADDRESS
from cubeaccel.protocol.agent_protocol import CUDA_TIMEOUT_S, MODPROBE_TIMEOUT_S
from cubeaccel.protocol.errors import CubeError

LIB_PATH_ENV = "CUBE_AGENT_LIB_PATH"  # colon-separated directories tried before the dynamic linker


def _load_contract(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise CubeError("agent.invalid_contract", f"cannot read contract {path}: {exc}", layer="template") from None
    if not isinstance(data, dict):
        raise CubeError("agent.invalid_contract", "contract must be a JSON object", layer="template")
    return data


def _context(args: argparse.Namespace, load_modules: bool, set_persistence: bool) -> ProbeContext:
    lib_path = args.lib_path if args.lib_path is not None else os.environ.get(LIB_PATH_ENV, "")
    return ProbeContext(
        root=Path(args.root),
        lib_dirs=tuple(d for d in lib_path.split(":") if d),
        modprobe=tuple(shlex.split(args.modprobe)),
        load_modules=load_modules,
        set_persistence=set_persistence,
        modprobe_timeout_s=args.modprobe_timeout,
        cuda_timeout_s=args.cuda_timeout,
    )


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", default="/", help="guest root holding proc/, sys/, dev/ (tests use a fake one)")
    p.add_argument(
        "--lib-path", default=None, help=f"directories searched first for driver libraries (env {LIB_PATH_ENV})"
    )
    p.add_argument("--modprobe", default="modprobe", help="modprobe command line (default: modprobe)")
    p.add_argument("--modprobe-timeout", type=float, default=MODPROBE_TIMEOUT_S, metavar="S")
    p.add_argument(
        "--cuda-timeout", type=float, default=CUDA_TIMEOUT_S, metavar="S", help="deadline for cuInit/NVML calls"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cube-agent", description="in-guest accelerator validation")
    sub = parser.add_subparsers(dest="command", required=True)
    probe = sub.add_parser("probe", help="run the contract's probes once and print the result")
    probe.add_argument("--contract", required=True, metavar="FILE")
    probe.add_argument("--json", action="store_true", help="print the full JSON reply instead of a table")
    probe.add_argument("--load-modules", action="store_true", help="modprobe the contract's modules first")
    probe.add_argument(
        "--allow-set-persistence", action="store_true", help="turn NVML persistence on if the contract asks"
    )
    _common(probe)
    srv = sub.add_parser("serve", help="serve the JSON-lines protocol on a port")
    where = srv.add_mutually_exclusive_group(required=True)
    where.add_argument("--port", metavar="NAME|PATH", help="virtio-serial port name (cube-agent) or device path")
    where.add_argument("--stdio", action="store_true", help="serve on stdin/stdout")
    srv.add_argument("--contract", metavar="FILE", help="default contract when a probe request carries none")
    srv.add_argument("--wait-port", type=float, default=10.0, metavar="S", help="wait this long for the port to appear")
    srv.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES)
    srv.add_argument("--read-timeout", type=float, default=5.0, metavar="S", help="drop an unfinished line after S")
    srv.add_argument(
        "--eof", choices=("exit", "wait"), default=None, help="on EOF: exit, or wait for the host (port default)"
    )
    srv.add_argument("--no-load-modules", action="store_true", help="probe does not modprobe unless asked")
    srv.add_argument("--no-set-persistence", action="store_true", help="never change NVML persistence mode")
    srv.add_argument(
        "--allow-poweroff", action="store_true", help="honour shutdown {poweroff: true} (guest PID 1 helper)"
    )
    _common(srv)
    scrub = sub.add_parser("scrub", help="zero the device's memory and verify samples (the trusted scrub VM's op)")
    what = scrub.add_mutually_exclusive_group(required=True)
    what.add_argument("--cuda", action="store_true", help="CUDA device memory through libcuda (NVIDIA classes)")
    what.add_argument("--bar", metavar="ADDRESS", help="registers behind BAR0 of this PCI function (emulated edu)")
    scrub.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    scrub.add_argument("--max-bytes", type=int, default=None, metavar="N", help="zero at most N bytes (default: all)")
    scrub.add_argument("--chunk-mib", type=int, default=256, metavar="MIB", help="allocation size (default 256)")
    scrub.add_argument("--timeout", type=float, default=600.0, metavar="S")
    _common(scrub)
    return parser


def _scrub(args: argparse.Namespace) -> int:
    from cubeaccel.agent.scrub import EDU_REGISTERS, MiB, scrub_bar, scrub_cuda

    if args.bar is not None:
        if not PCI_ADDRESS.fullmatch(args.bar):
            raise CubeError("agent.invalid_params", f"not a PCI address: {args.bar!r}", layer="agent")
        result = scrub_bar(Path(args.root) / "sys/bus/pci/devices" / args.bar, EDU_REGISTERS)
    else:
        lib_path = args.lib_path if args.lib_path is not None else os.environ.get(LIB_PATH_ENV, "")
        lib_dirs = tuple(d for d in lib_path.split(":") if d)
        result = scrub_cuda(lib_dirs, args.device, args.max_bytes, args.chunk_mib * MiB, args.timeout)
    body = result.to_json()
    seconds = (result.zero_ms + result.verify_ms) / 1000 or None
    body["zero_gib_per_s"] = round(result.bytes_zeroed / 2**30 / (result.zero_ms / 1000), 3) if result.zero_ms else None
    body["seconds"] = seconds
    print(json.dumps(body, indent=2))
    return 0 if result.ok else 1


def _table(reply: dict[str, Any]) -> str:
    rows = [("ok", "probe", "layer", "expected", "found", "ms", "code")]
    for p in reply["report"]["probes"]:
        rows.append(
            (
                "ok" if p["ok"] else "FAIL",
                p["name"],
                p["layer"],
                str(p["expected"]),
                str(p["found"]),
                f"{p['duration_ms']:.1f}",
                p["code"],
            )
        )
    widths = [min(40, max(len(r[i]) for r in rows)) for i in range(len(rows[0]))]
    lines = ["  ".join(c[:40].ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.append(f"kernel {reply['report']['kernel_release']}; contract check: {reply['contract_check']}")
    for v in reply["violations"]:
        lines.append(f"violation: {json.dumps(v)}")
    lines.append("PASS" if reply["ok"] else f"FAIL: layers {', '.join(reply['failed_layers'])}")
    return "\n".join(lines)


def _probe(args: argparse.Namespace) -> int:
    contract = _load_contract(args.contract)
    spec = parse_spec(contract)
    ctx = _context(args, load_modules=args.load_modules, set_persistence=args.allow_set_persistence)
    reply = probe_reply(contract, spec, ctx).to_json()
    print(json.dumps(reply, indent=2, default=str) if args.json else _table(reply))
    return 0 if reply["ok"] else 1


def _serve(args: argparse.Namespace) -> int:
    contract = _load_contract(args.contract) if args.contract else None
    if contract is not None:
        parse_spec(contract)  # fail at start, not at the first probe
    ctx = _context(args, load_modules=False, set_persistence=not args.no_set_persistence)
    agent = Agent(ctx=ctx, contract=contract, load_modules_default=not args.no_load_modules)
    options = ServeOptions(args.max_request_bytes, args.read_timeout, args.eof or ("exit" if args.stdio else "wait"))
    if args.stdio:
        rc = serve(agent, sys.stdin.fileno(), sys.stdout.fileno(), options)
    else:
        path = resolve_port(args.port, wait_s=args.wait_port)
        fd = open_port(path)
        log(f"serving on {path}")
        try:
            rc = serve(agent, fd, fd, options)
        finally:
            os.close(fd)
    if agent.poweroff_requested and args.allow_poweroff:
        poweroff()
    return rc


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "scrub":
            return _scrub(args)
        return _probe(args) if args.command == "probe" else _serve(args)
    except CubeError as err:
        print(json.dumps(err.to_json()), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `cube-agent probe | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
