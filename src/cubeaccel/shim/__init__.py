"""CubeShim: one MicroVM per process — VMM, pinned memory, hot-plug, teardown ordering, reports to Cubelet."""
