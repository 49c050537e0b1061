"""The models a server answers to: the base model under its served names, and LoRA adapters
(vLLM: ``vllm/entrypoints/openai/serving_models.py``, ``OpenAIServingModels``)::

    microvllm serve MODEL --enable-lora --lora-modules sql=/adapters/sql chat=/adapters/chat

    GET /v1/models
      {"id": "MODEL", "root": "MODEL",         "parent": null}      the base model
      {"id": "sql",   "root": "/adapters/sql", "parent": "MODEL"}   an adapter
      {"id": "chat",  "root": "/adapters/chat","parent": "MODEL"}

A request's ``model`` picks one: a base name runs the base model, an adapter's name runs it
through the base model with its ``LoRARequest``. Each adapter gets its own ``lora_int_id``
(1, 2, ...; never reused, so an id always means one folder).

With ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (vLLM's switch, off by default: it lets a
client choose a folder on the server's disk to load, for every user of the server to run)
``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` adds an adapter and
``POST /v1/unload_lora_adapter {"lora_name"}`` removes it: requests already running finish
with it, new ones are refused.

An adapter is checked (its config, its tensors' shapes) and its files' digest taken
(``LoRARequest.lora_digest``: its blocks' prefix-cache key) *before* its name is served::

    add(name, path, check)
      new id, LoRARequest(name, id, path)     a taken name: ValueError, nothing changed
      check(it) -> it with its lora_digest    a bad folder: the check's error, nothing changed
      served under name                       only now can a request name it

so a load that fails leaves nothing behind, and a name loaded again from another folder
(or from the same folder after its files changed) is keyed by its new files.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from microvllm.lora.peft_helper import PEFTHelper
from microvllm.lora.request import LoRARequest


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry (vLLM's class)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: list[str] | None) -> list[LoRAModulePath]:
    """``--lora-modules`` as vLLM takes it: ``name=path``, or a JSON object
    ``{"name": ..., "path": ..., "base_model_name": ...}``. ``ValueError`` saying the form."""
    modules = []
    for value in values or []:
        if value.lstrip().startswith("{"):
            try:
                given = json.loads(value)
                modules.append(LoRAModulePath(given["name"], given["path"], given.get("base_model_name")))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {value!r}: a JSON entry needs \"name\" and \"path\" "
                                 "(and may give \"base_model_name\")") from None
            continue
        name, equals, path = value.partition("=")
        if not equals or not name or not path:
            raise ValueError(f"--lora-modules {value!r}: write name=path (the adapter's served name, then "
                             "its peft folder)")
        modules.append(LoRAModulePath(name, path))
    return modules


def check_lora_modules(modules: list[LoRAModulePath], max_lora_rank: int) -> None:
    """``--lora-modules``' folders read and checked before the model loads (seconds, not the
    minutes a model takes): ``ValueError`` naming the module for a folder that is not a peft
    adapter, or one this engine does not serve (DoRA, a rank above ``max_lora_rank``, ...).
    Its tensors' shapes need the model's config: ``build_app`` checks them, once the engine is up."""
    for module in modules:
        try:
            PEFTHelper.from_local_dir(module.path).validate_legal(max_lora_rank)
        except ValueError as error:
            raise ValueError(f"--lora-modules {module.name}={module.path}: {error}") from None


class OpenAIServingModels:
    """The served names: ``base_names`` (the base model's), and adapters by name."""

    def __init__(self, base_names: list[str], lora_modules: list[LoRAModulePath] = ()):
        self.base_names = list(base_names)
        self.lora_requests: dict[str, LoRARequest] = {}
        self._next_lora_id = 1
        for module in lora_modules:
            self.add(module.name, module.path)

    @property
    def base_model(self) -> str:
        return self.base_names[0]

    def is_served(self, name: str) -> bool:
        return name in self.base_names or name in self.lora_requests

    def lora_request(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names, or None for the base model."""
        return self.lora_requests.get(name) if name is not None else None

    def new_lora_request(self, name: str, path: str) -> LoRARequest:
        """The adapter at ``path`` under a new id, not served yet (``ValueError`` if ``name``
        is taken). Ids are never reused, even one whose load failed."""
        self._check_free(name)
        request = LoRARequest(name, self._next_lora_id, path)
        self._next_lora_id += 1
        return request

    def register(self, request: LoRARequest) -> None:
        """Serve ``request`` (checked, with its digest) under its name (``ValueError`` if a
        load of the same name finished first)."""
        self._check_free(request.lora_name)
        self.lora_requests[request.lora_name] = request

    def add(self, name: str, path: str,
            check: Callable[[LoRARequest], LoRARequest | None] = lambda request: request) -> LoRARequest:
        """Serve the adapter at ``path`` as ``name`` once ``check`` accepts it (and returns it
        with its ``lora_digest``): whatever ``check`` raises leaves nothing served."""
        request = self.new_lora_request(name, path)
        request = check(request) or request
        self.register(request)
        return request

    def _check_free(self, name: str) -> None:
        if name in self.base_names or name in self.lora_requests:
            raise ValueError(f"lora_name {name!r} is already served: unload it first, or choose another name")

    def remove(self, name: str) -> LoRARequest:
        if name not in self.lora_requests:
            raise KeyError(f"no adapter named {name!r} is served: GET /v1/models lists them")
        return self.lora_requests.pop(name)

    def model_cards(self) -> list[dict]:
        """``/v1/models``'s entries (vLLM's ``ModelCard`` fields, with ``parent`` for an adapter)."""
        cards = [{"id": name, "root": self.base_model, "parent": None} for name in self.base_names]
        cards += [{"id": name, "root": request.lora_path, "parent": self.base_model}
                  for name, request in self.lora_requests.items()]
        return cards
