"""cubeaccel: accelerator control plane for Cube Sandbox MicroVMs."""

__version__ = "0.1.0"
