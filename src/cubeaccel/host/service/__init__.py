"""What every daemon of ours needs from the host, whatever it serves: one process per state directory,
systemd readiness, owner-only files, allowlisted child environments, the audit log, backups, auth throttling,
long unix socket paths and a process title."""
