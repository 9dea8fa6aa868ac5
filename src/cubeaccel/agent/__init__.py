"""cube-agent: in-guest validation of an accelerator against the template's compatibility contract.

Runs inside small guests, so it imports only the Python standard library and `cubeaccel.protocol`. What the host side
shares with it (versions, port name, step timeouts) is in `cubeaccel.protocol.agent_protocol`: nothing outside the
guest imports this package.
"""
