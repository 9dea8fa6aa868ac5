"""`cubeaccel image ...`: build the guest image from Debian packages (cached), show its manifest."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer

from cubeaccel.model.errors import CubeError

app = typer.Typer(no_args_is_help=True, help="guest image: kernel, modules.img, rootfs with cube-agent")


@app.command("build")
def build(
    force: bool = typer.Option(False, "--force", help="rebuild even when the cached image matches its inputs"),
    cache: Path | None = typer.Option(None, "--cache-dir", help="default: ~/.cache/cubeaccel"),
) -> None:
    """Build (or reuse) the image; prints its manifest path, digests and whether it was built now."""
    from cubeaccel.cli.output import Progress
    from cubeaccel.images.builder import build as build_image

    t0 = time.monotonic()
    try:
        with Progress("image build") as progress:
            manifest, built = build_image(cache, force=force, on_phase=progress.phase)
    except CubeError as e:
        print(json.dumps(e.to_json()), file=sys.stderr)
        raise typer.Exit(1) from e
    out = {
        "manifest": str(manifest.directory / "manifest.json"),
        "built": built,
        "seconds": round(time.monotonic() - t0, 2),
        **manifest.to_json(),
    }
    print(json.dumps(out, indent=2))


@app.command("show")
def show(cache: Path | None = typer.Option(None, "--cache-dir", help="default: ~/.cache/cubeaccel")) -> None:
    """The most recently built image's manifest (no apt queries); exit 1 if none was built."""
    from cubeaccel.images.builder import latest

    try:
        manifest = latest(cache)
    except CubeError as e:
        print(json.dumps(e.to_json()), file=sys.stderr)
        raise typer.Exit(1) from e
    if manifest is None:
        print("no image built yet: run `cubeaccel image build`", file=sys.stderr)
        raise typer.Exit(1)
    bad = manifest.verify()
    print(
        json.dumps(
            {
                "manifest": str(manifest.directory / "manifest.json"),
                "intact": not bad,
                "corrupt": bad,
                **manifest.to_json(),
            },
            indent=2,
        )
    )
