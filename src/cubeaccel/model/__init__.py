"""Pure host-side domain types and rules. No I/O, no frameworks.

What the guest shares with the host (messages, framing, error codes) is `cubeaccel.protocol`, below this package.
"""
