"""Running a MicroVM's VMM on this host: which QEMU and accelerator, its confinement (uid, limits, launcher),
its writable disk, the memory it may lock, and finding it again in /proc."""
