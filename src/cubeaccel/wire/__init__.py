"""Everything that crosses a process boundary: versioned pydantic models, the HTTP edges and both HTTP clients.

wire/ may import model/ (and pydantic, fastapi, httpx) but nothing above it: the servers, the shim and the CLI
import their message shapes from here, so a reader finds each message in one place.
"""
