"""How much of a request the server waits for, and how long: the three limits and their
defaults, each a ``microvllm serve`` flag (enforced by ``request_guard.py``)::

    connect ─── headers ─────────────┬── body ───────────────────────┬── route
    |<- --request-header-timeout ->| |<- --request-body-timeout -->|
                                       |<- --max-request-body-bytes ->|

Nothing here imports the server's packages, so ``microvllm --help`` can list the flags
without them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

# A body carries a prompt and its options: 32 MiB holds /detokenize's 2M token ids.
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_REQUEST_HEADER_TIMEOUT = 30.0   # seconds (hyper's and Go's usual ReadHeaderTimeout)
DEFAULT_REQUEST_BODY_TIMEOUT = 60.0     # seconds for the whole body: >= 0.5 MiB/s at the size limit


@dataclass(frozen=True)
class RequestLimits:
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    request_header_timeout: float = DEFAULT_REQUEST_HEADER_TIMEOUT
    request_body_timeout: float = DEFAULT_REQUEST_BODY_TIMEOUT

    @classmethod
    def from_cli_args(cls, args) -> RequestLimits:
        """The flags of the same names (``microvllm serve``); a missing one keeps its default."""
        defaults = cls()
        return cls(**{field.name: getattr(args, field.name, getattr(defaults, field.name)) for field in fields(cls)})
