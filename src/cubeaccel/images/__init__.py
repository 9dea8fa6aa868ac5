"""Guest image building: kernel, modules.img, rootfs with cube-agent, digests (see builder.py)."""
