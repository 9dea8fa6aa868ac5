"""cube-agent: in-guest validation of an accelerator against the template's compatibility contract.

Runs inside small guests, so it imports only the Python standard library and `cubeaccel.model`.
"""

AGENT_VERSION = 1  # GuestReport.agent_version: bumped when the report's meaning changes
AGENT_PORT_NAME = "cube-agent"  # the virtserialport name the VMM gives the agent's channel
PROTOCOL_VERSION = 1  # "v" in every protocol line: bumped when the wire format changes
