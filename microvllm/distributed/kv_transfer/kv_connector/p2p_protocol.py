"""The ``P2PConnector``'s side channel: its messages, their limits, and who is trusted.

One TCP connection per transfer, the decode side (consumer) asking, the prefill side
(producer) answering::

    consumer                                              producer (side channel)
    ── {"op": "read", "engine_id", "request_id",
        "first": 2, "count": 3,                   ──>   refuses unless: its engine id, a
        "prompt_digest": D(tokens[:5 * B])}              request it holds, blocks [2, 5) in
                                                         range, and D equal to ITS digest of
                                                         the tokens IT prefilled
    <── {"ok": true, "prompt_digest": D'}                 (D' = its own)
        consumer checks D' == D (its own prompt)
    <── blocks 2..4 of every layer, raw bytes
    ── {"done": true}                              ──>   the producer frees its blocks

Every control message is a 4-byte little-endian length and that much JSON, at most
``MAX_CONTROL_BYTES``: a peer-chosen length never decides how much memory is taken.
Every exchange runs against one ``Deadline`` (not a timeout per ``recv``: a peer that
trickles one byte every few seconds would otherwise hold a transfer for ever).

Trust, in one sentence: where a consumer connects is the operator's setting
(``allowed_producers``), never the request's; what it loads is checked against the
producer's digest of the tokens the producer computed, so a client that sends prompt V
with another prompt's ``kv_transfer_params`` loads nothing.
"""

from __future__ import annotations

import hashlib
import json
import socket
import struct
import time
from collections.abc import Iterable

MAX_CONTROL_BYTES = 1 << 20   # one control message (JSON), both directions


class Deadline:
    """One point in time that a whole exchange must finish by; each socket wait gets
    what is left of it."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def remaining(self) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError("the transfer's deadline passed")
        return left


def send_msg(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("<I", len(data)) + data)


def recv_exact(sock: socket.socket, size: int, deadline: Deadline, into: memoryview | None = None) -> bytes:
    """Exactly ``size`` bytes (into ``into`` if given, then returns b"") by ``deadline``."""
    buffer = into if into is not None else memoryview(bytearray(size))
    got = 0
    while got < size:
        sock.settimeout(deadline.remaining())
        n = sock.recv_into(buffer[got:], size - got)
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        got += n
    return bytes(buffer) if into is None else b""


def recv_msg(sock: socket.socket, deadline: Deadline) -> dict:
    """One control message; ``ValueError`` if its announced length is over the limit or it
    is not a JSON object (before any buffer of that length is made)."""
    (size,) = struct.unpack("<I", recv_exact(sock, 4, deadline))
    if size > MAX_CONTROL_BYTES:
        raise ValueError(f"a control message of {size} bytes is over the {MAX_CONTROL_BYTES}-byte limit")
    message = json.loads(recv_exact(sock, size, deadline))
    if not isinstance(message, dict):
        raise ValueError("a control message must be a JSON object")
    return message


def prompt_digests(token_ids: list[int], block_size: int) -> list[str]:
    """One digest per full block, each chaining the one before (as block hashes do), so
    ``digests[k]`` covers tokens ``[0, (k + 1) * block_size)``: the producer keeps the
    list for the tokens it prefilled, a consumer computes the entry for the range it reads."""
    digests, previous = [], b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = struct.pack(f"<{block_size}q", *token_ids[start:start + block_size])
        previous = hashlib.blake2b(previous + block, digest_size=16).digest()
        digests.append(previous.hex())
    return digests


def prompt_digest(token_ids: list[int], num_blocks: int, block_size: int) -> str:
    """The digest of the first ``num_blocks`` full blocks (``prompt_digests(...)[num_blocks - 1]``)."""
    if not 0 < num_blocks <= len(token_ids) // block_size:
        raise ValueError(f"{num_blocks} blocks of {block_size} tokens is past a prompt of {len(token_ids)} tokens")
    return prompt_digests(token_ids[:num_blocks * block_size], block_size)[-1]


def parse_producers(entries: Iterable[object] | None) -> frozenset[tuple[str, int]]:
    """``allowed_producers`` (``["127.0.0.1:14579", ...]``) as (host, port) pairs; a
    ``ValueError`` that says what to write for anything else. Hosts are compared as
    written (lower case), never resolved: "localhost" and "127.0.0.1" are two entries."""
    if entries is None:
        return frozenset()
    if isinstance(entries, str) or not isinstance(entries, (list, tuple)):
        raise ValueError(f"kv_connector_extra_config allowed_producers={entries!r} must be a list of "
                         '"host:port" strings, e.g. ["127.0.0.1:14579"]')
    pairs = set()
    for entry in entries:
        host, _, port = str(entry).rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"kv_connector_extra_config allowed_producers entry {entry!r} must be "
                             '"host:port" (a producer\'s side-channel address, its "port" setting)')
        pairs.add((host.strip("[]").lower(), int(port)))
    return frozenset(pairs)
