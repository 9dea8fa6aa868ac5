"""Regenerate docs/openapi/*.json: the OpenAPI documents CubeMaster and the Cubelet serve at /openapi.json, and the
E2B subset the front door serves (it has no /openapi.json; the document is built from its route table).

`--check` exits 1 (naming the stale files) when a committed document differs from the generated one, so an API
change shows in a diff (tests/unit/test_openapi_committed.py).
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[1] / "docs" / "openapi"


def master_doc(tmp: Path) -> dict[str, Any]:
    from cubeaccel.master.server import create_app
    from cubeaccel.master.service import CubeMaster, MasterConfig
    from cubeaccel.master.store import MasterStore

    store = MasterStore(str(tmp / "master.db"))
    try:
        return create_app(CubeMaster(store, MasterConfig())).openapi()
    finally:
        store.close()


def cubelet_doc(tmp: Path, local: bool) -> dict[str, Any]:
    from cubeaccel.backends.vfio import VfioBackend
    from cubeaccel.cubelet.lifecycle import CubeletConfig
    from cubeaccel.cubelet.runtime import assemble
    from cubeaccel.cubelet.server import create_app
    from cubeaccel.cubelet.shim_driver import SimulatedShimDriver
    from cubeaccel.cubelet.store import Store
    from cubeaccel.host.pci.simulated import SimulatedPciHost

    host = SimulatedPciHost("h100x8")
    store = Store(tmp / f"cubelet-{local}.db")
    try:
        cubelet = assemble(store, VfioBackend(host, allow=("10de:*",)), SimulatedShimDriver(host), CubeletConfig())
        return create_app(cubelet, local=local, token=None if local else "doc").openapi()
    finally:
        store.close()


def frontdoor_doc(tmp: Path) -> dict[str, Any]:
    from cubeaccel.frontdoor.openapi import e2b_openapi

    return e2b_openapi()


DOCUMENTS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "cubemaster.json": master_doc,
    "cubelet-unix.json": lambda tmp: cubelet_doc(tmp, local=True),
    "cubelet-tcp.json": lambda tmp: cubelet_doc(tmp, local=False),
    "frontdoor-e2b.json": frontdoor_doc,
}


def render(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def main() -> int:
    stale = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, build in DOCUMENTS.items():
            text = render(build(Path(tmp)))
            path = DOCS / name
            if "--check" in sys.argv:
                if not path.exists() or path.read_text() != text:
                    stale.append(name)
            else:
                DOCS.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    if stale:
        print(f"stale in docs/openapi: {', '.join(stale)}; run `python scripts/openapi-doc.py`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
