"""Pure domain types and rules. No I/O, no frameworks."""
