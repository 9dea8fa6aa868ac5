"""A simulated fleet of Cubelets for CubeMaster's tests and benchmarks (sim.py)."""
