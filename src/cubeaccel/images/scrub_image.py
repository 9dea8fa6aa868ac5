"""The guest image a scrub VM boots for a vendor stack, and whether this node can boot it.

The scrub registry (backends/scrub_methods.py) names, per device kind, the stack of the image its scrub VM boots
(`nvidia` for CUDA GPUs, "" for the CPU-only image). The image must be in `cubeaccel image build`'s cache, carry
*this* release's agent (the scrub op is the one this code ships: after an upgrade the images built before it do
not), and its files must still match the digests its manifest pins. A node where that fails cannot clear a device
of that kind between tenants, so its Cubelet holds those devices back before any tenant has one instead of
quarantining each one after its first tenant. This module only finds and verifies; Cubelet decides.

Verification hashes every file of the image (hundreds of MiB for a GPU image): done once per change of the files
(their stat signature), and remembered in a file when one is given, so a restarted Cubelet does not hash again.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cubeaccel.images.manifest import Manifest

MISSING = "host.scrub_image_missing"
MISMATCH = "host.scrub_image_mismatch"

Signature = tuple[tuple[int, int, int, int], ...]


@dataclass(frozen=True)
class ScrubImage:
    """The image for one stack: `digest` what the scrub VM boots (None: nothing here fits); `code` None when it is
    present and intact, else MISSING or MISMATCH with `message` saying what to do."""

    stack: str
    digest: str | None
    code: str | None = None
    message: str = ""

    @property
    def usable(self) -> bool:
        return self.code is None and self.digest is not None


def stack_of(m: Manifest) -> str:
    return m.vendor.stack if m.vendor is not None else ""


def _label(stack: str) -> str:
    return f"{stack} guest image" if stack else "CPU-only guest image"


def _build_hint(stack: str) -> str:
    return "`cubeaccel image build" + (f" --vendor {stack}`" if stack else "`")


class ScrubImages:
    """Chooses the image for a stack and verifies it. `named`: the operator's `--scrub-image` digest (used for the
    stacks it is of; an image the cache does not have is missing). `memo`: where verifications are remembered."""

    def __init__(
        self,
        named: str | None = None,
        *,
        images: Callable[[], list[Manifest]],
        agent: Callable[[], str],
        memo: Path | None = None,
    ) -> None:
        self.named = named
        self._images = images
        self._agent = agent
        self._memo_path = memo
        self._memo: dict[str, tuple[Signature, tuple[str, ...]]] = self._load()

    def choose(self, stack: str) -> ScrubImage:
        images = self._images()
        if self.named is not None:
            named = next((m for m in images if m.image_digest == self.named), None)
            if named is None:
                why = f"--scrub-image {self.named} is not in this node's image cache: build or import it"
                return ScrubImage(stack, self.named, MISSING, why)
            if stack_of(named) == stack:
                return self._verified(stack, [named])
        mine = self._agent()
        of_stack = [m for m in images if stack_of(m) == stack]
        fits = [m for m in of_stack if m.agent_sha256 == mine]
        # The validation flavour first (newest first within each): a scrub runs no user's tools, and the userland's
        # larger initrd may not even fit the scrub VM's memory.
        fits.sort(key=lambda m: m.flavour != "validation")
        if not fits:
            why = f"no built {_label(stack)} carries this Cubelet's agent"
            if of_stack:
                why += f" ({len(of_stack)} built by another release: rebuild after an upgrade)"
            return ScrubImage(stack, None, MISSING, f"{why}: run {_build_hint(stack)}")
        return self._verified(stack, fits)

    def _verified(self, stack: str, candidates: list[Manifest]) -> ScrubImage:
        """The first candidate whose files match its manifest; none: MISMATCH naming what differs."""
        seen = []
        for m in candidates:
            bad = self.bad_files(m)
            if not bad:
                return ScrubImage(stack, m.image_digest)
            seen.append(f"{m.image_digest} ({', '.join(bad)})")
        why = (
            f"the {_label(stack)} on this node no longer matches the digests its manifest pins: {'; '.join(seen)}; "
            f"rebuild it with {_build_hint(stack)}"
        )
        return ScrubImage(stack, candidates[0].image_digest, MISMATCH, why)

    def bad_files(self, m: Manifest) -> tuple[str, ...]:
        """Files of `m` missing or not matching their pinned digest, hashed once per change of the files."""
        files = [m.directory / "manifest.json", *(m.path(a) for a in (m.vmlinux, m.modules_img, m.rootfs, m.initrd))]
        try:
            sig = tuple((st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) for st in (f.stat() for f in files))
        except OSError:
            return tuple(a.path for a in (m.vmlinux, m.modules_img, m.rootfs, m.initrd) if not m.path(a).exists())
        key = str(m.directory)
        known = self._memo.get(key)
        if known is not None and known[0] == sig:
            return known[1]
        bad = tuple(m.verify())
        self._memo[key] = (sig, bad)
        self._save()
        return bad

    def _load(self) -> dict[str, tuple[Signature, tuple[str, ...]]]:
        if self._memo_path is None:
            return {}
        out: dict[str, tuple[Signature, tuple[str, ...]]] = {}
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            for key, entry in json.loads(self._memo_path.read_text()).items():
                sig = tuple((int(a), int(b), int(c), int(d)) for a, b, c, d in entry["sig"])
                out[str(key)] = (sig, tuple(str(p) for p in entry["bad"]))
        return out

    def _save(self) -> None:
        if self._memo_path is None:
            return
        self._memo = {k: v for k, v in self._memo.items() if Path(k).is_dir()}  # images pruned since: forgotten
        data = {k: {"sig": [list(s) for s in sig], "bad": list(bad)} for k, (sig, bad) in self._memo.items()}
        tmp = self._memo_path.with_suffix(".tmp")
        with contextlib.suppress(OSError):  # a memo that cannot be written only costs a hash after a restart
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self._memo_path)
