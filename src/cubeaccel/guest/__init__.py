"""Guest-side helpers (stdlib only) shared by cube-agent and the workload service."""
