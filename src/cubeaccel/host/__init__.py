"""The only code that touches the machine (or a simulation of it)."""
