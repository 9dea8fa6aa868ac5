"""Scrub-runner helpers for tests whose fake shim boots nothing."""

from __future__ import annotations

from cubeaccel.cubelet.scrub import ProcessScrubRunner
from cubeaccel.images.scrub_image import ScrubImage


def image_present(runner: ProcessScrubRunner) -> ProcessScrubRunner:
    """The runner's image check answers "here and intact" for its `--scrub-image`: these tests' fake shim boots no
    image, so the image-readiness rule (tested in test_scrub_image_choice.py) must not stop them first."""
    digest = runner.image_digest
    runner.images.choose = lambda stack: ScrubImage(stack, digest)  # type: ignore[method-assign]
    return runner
