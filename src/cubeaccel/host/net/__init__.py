"""A sandbox's network on this host: its namespace, TAP, uplink and nftables rules."""
