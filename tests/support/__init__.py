"""Harnesses shared by more than one test directory: real processes, fake sysfs trees, and the one `poll`."""
