"""``LoRARequest``: which adapter a request runs with (vLLM: ``vllm/lora/request.py``)::

    llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql-lora"))

``lora_name`` is what a client calls it (a served model's name); ``lora_int_id`` (>= 1) the
engine's number for it: the same id must always mean the same adapter. ``lora_path`` is a
peft folder (``adapter_config.json`` + ``adapter_model.safetensors``).

``lora_digest`` is what the adapter *is*: the sha256 of those two files
(``peft_helper.adapter_digest``), which the engine's front end fills in the first time
it sees an id (``AdapterDigests``) and a server when it registers the adapter. The prefix
cache keys the adapter's blocks by it, not by the name (``core/kv_cache_utils.py``): a
name loaded again from another folder, or from the same folder after its files were
replaced, is another adapter with other KV. Replace a served adapter's files only by
loading it again: the digest is of the files as they were when it was taken.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field

from microvllm.lora.peft_helper import adapter_digest


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    # Filled in by the engine, not by a user; not compared (a request with it and one
    # without are the same adapter).
    lora_digest: str = field(default="", compare=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id={self.lora_int_id!r} must be an int >= 1 (0 is the base model)")
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string (the name clients use for the adapter)")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id


class AdapterDigests:
    """Each adapter id's digest, taken once per id: the worker, too, reads an id's files
    once and keeps them, so the key and the weights it names agree. An id seen again with
    another folder is refused (it would run the first folder's weights)."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[str, str]] = {}   # lora_int_id -> (lora_path, digest)
        self._lock = threading.Lock()   # a server checks requests on several threads

    def with_digest(self, lora_request: LoRARequest) -> LoRARequest:
        """``lora_request`` with its ``lora_digest`` (reading its files the first time)."""
        if lora_request.lora_digest:
            return lora_request
        with self._lock:
            known = self._by_id.get(lora_request.lora_int_id)
        if known is None:
            taken = (lora_request.lora_path, adapter_digest(lora_request.lora_path))
            with self._lock:
                known = self._by_id.setdefault(lora_request.lora_int_id, taken)
        path, digest = known
        if path != lora_request.lora_path:
            raise ValueError(f"lora_int_id={lora_request.lora_int_id} already names the adapter in {path!r}, not "
                             f"{lora_request.lora_path!r}: give each adapter folder its own lora_int_id")
        return dataclasses.replace(lora_request, lora_digest=digest)
