"""The only code that touches the machine (or a simulation of it), one subpackage per concern: `pci` (PCI
functions and who holds them), `vmm` (running a VMM), `net` (a sandbox's network), `service` (what every daemon
needs). The `host-concerns` import-linter contract keeps them apart."""
