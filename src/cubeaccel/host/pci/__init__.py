"""PCI functions as the kernel shows them (sysfs, or a simulation), who holds their device files, and whether
this host can pass them through. Nothing here knows about VMMs or sandbox networks."""
