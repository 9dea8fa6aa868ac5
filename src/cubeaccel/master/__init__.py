"""CubeMaster: cluster placement from node summaries, templates, sandbox records."""
