"""What crosses the socket between the front end and an engine core process, as bytes
(vLLM: ``vllm/v1/serial_utils.py``, ``MsgpackEncoder`` / ``MsgpackDecoder``).

msgspec writes dataclasses, lists, dicts, numbers and strings as MessagePack, and reads
them back into the declared type (``EngineCoreRequest``, ``EngineCoreOutputs``),
checking every field on the way::

    EngineCoreRequest("7", [1, 2, 3], SamplingParams(...), ...)  ──encode──>  bytes
    bytes  ──decode(EngineCoreRequest)──>  the same request, or msgspec.ValidationError

No pickle: a socket that unpickles runs whatever code it is sent. A type msgspec does
not know is refused (``TypeError``) unless a hook below says how to write it as plain
data. ``SamplingParams`` (a class with ``__slots__``) is written as its fields and read
back through its constructor, so its checks run again in the core.

A message that does not decode (a bug of ours, or a same-user process on the socket) is
refused, never fatal: the reading thread logs it and goes on, and ``field_of`` reads the
one field that names what it was for (a request id, a utility call's id), so that the
waiter can be failed rather than left waiting::

    {"request_id": "7", "prompt_token_ids": "oops", ...}  ──decode(EngineCoreRequest)──>  ValidationError
                                                          ──field_of(data, "request_id")──>  "7"
"""

from __future__ import annotations

from typing import Any

import msgspec

from microvllm.sampling_params import SamplingParams, StructuredOutputsParams


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, SamplingParams):
        fields = {name: getattr(obj, name) for name in SamplingParams.FIELDS}
        fields["output_kind"] = int(obj.output_kind)
        return {"fields": fields, "bad_words_token_ids": obj.bad_words_token_ids}
    if isinstance(obj, StructuredOutputsParams):
        return {name: getattr(obj, name) for name in StructuredOutputsParams.__slots__}
    raise TypeError(f"{type(obj).__name__} cannot cross to an engine core process (only plain data does: "
                    "add an encoding for it in engine/serial_utils.py)")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is SamplingParams:
        fields = dict(obj["fields"])
        if fields.get("structured_outputs") is not None:
            fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
        if fields.get("logit_bias") is not None:   # MessagePack keeps int keys; JSON-like input may not
            fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
        params = SamplingParams(**fields)
        params.bad_words_token_ids = [list(ids) for ids in obj["bad_words_token_ids"]]
        return params
    raise TypeError(f"cannot read a {kind.__name__} from an engine core message")


class MsgpackEncoder:
    """Objects to bytes (one encoder per thread: it reuses a buffer)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)

    def encode(self, obj: Any) -> bytes:
        return self._encoder.encode(obj)


class MsgpackDecoder:
    """Bytes to an object of type ``kind`` (``Any``: plain data only)."""

    def __init__(self, kind: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(kind, dec_hook=_dec_hook)

    def decode(self, data: bytes | memoryview) -> Any:
        return self._decoder.decode(data)


def field_of(data: bytes | memoryview, key: str | int) -> Any:
    """One field of a message that did not decode as its type: the value under ``key``
    in a MessagePack map, or at index ``key`` in an array, as plain data; None where the
    bytes are not MessagePack at all or hold no such field. (Its caller checks the
    field's type: it may be anything.)"""
    try:
        message = msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, RecursionError):   # not MessagePack, or nested past Python's limit
        return None
    if isinstance(key, str) and isinstance(message, dict):
        return message.get(key)
    if isinstance(key, int) and isinstance(message, list) and 0 <= key < len(message):
        return message[key]
    return None
