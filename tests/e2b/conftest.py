"""The VM fixtures (guest image, per-run cache, VMM cleanup) are the ones tests/vm uses."""

from tests.vm.conftest import guest_image

__all__ = ["guest_image"]
