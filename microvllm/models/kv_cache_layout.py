"""Which layers share which KV cache group, and which KV tensor each layer's pages live in.

Layers with the same attention kind (full attention, or a sliding window of the
same size) form one *cache group*: they share a block table per request and one
single-type KV cache manager in ``microvllm/core``. Llama and Qwen3 have one
full-attention group; Mistral with ``sliding_window`` set has one sliding-window
group; a config with ``layer_types`` mixing both has two (vLLM V1's hybrid
allocator, made small)::

    layer:            0     1     2     3
    layer_types:    full  slide  full  slide      -> groups [full, sliding(W)]
    layer_to_group:   0     1     0     1

A **hybrid** (Qwen3.5: ``linear_attention`` layers, whose memory is a state, beside
``full_attention`` ones) keeps its states in the same pool, in pages of the same size
(vLLM's hybrid KV cache manager). Its linear layers are cut into *state groups* of as many
layers as the attention group has, and the k-th layer of every group shares KV tensor k:
a block id is then a page of every shared tensor, used by whichever group holds the block::

    layer:            0     1     2     3     4     5     6     7
    layer_types:     lin   lin   lin  full   lin   lin   lin  full
    layer_to_group:   1     1     2     0     2     3     3     0     groups [full, state, state, state]
    layer_to_buffer:  0     1     0     0     1     0     1     1     2 KV tensors, not 8

    block 5 held by group 0 (attention): tensor 0 page 5 = layer 3's keys and values,
                                         tensor 1 page 5 = layer 7's
    block 5 held by group 2 (a state):   tensor 0 page 5 = layer 2's state, tensor 1 page 5 = layer 4's

So a block costs the same whoever holds it, and no byte of the pool is set aside for one
kind of layer (``microvllm/layers/linear_attention/paged_state.py`` lays a state over a page).
"""

from __future__ import annotations

from dataclasses import dataclass

from microvllm.config.model import is_hybrid
from microvllm.core.kv_cache_spec import KVCacheSpec, MambaSpec, attention_spec


@dataclass(frozen=True)
class KVCacheLayout:
    """``sliding_windows[g]``: the window of cache group ``g`` (None: full attention, or a
    state group); ``layer_to_group[i]``: layer ``i``'s group; ``state_groups``: the groups
    of linear-attention layers; ``layer_to_buffer[i]``: the KV tensor holding layer ``i``'s
    pages (every layer its own, but in a hybrid). What each group needs is core's
    ``KVCacheSpec`` (``kv_cache_specs``): the kind of a group is written down there, once."""

    sliding_windows: tuple[int | None, ...]
    layer_to_group: tuple[int, ...]
    state_groups: tuple[int, ...] = ()
    layer_to_buffer: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.layer_to_buffer:
            object.__setattr__(self, "layer_to_buffer", tuple(range(len(self.layer_to_group))))

    @property
    def num_groups(self) -> int:
        return len(self.sliding_windows)

    @property
    def num_kv_buffers(self) -> int:
        """KV tensors the worker allocates, each ``num_blocks`` pages."""
        return max(self.layer_to_buffer) + 1

    @property
    def is_hybrid(self) -> bool:
        return bool(self.state_groups)

    def kv_cache_specs(self, block_size: int, mamba_prefix_caching: bool = True) -> list[KVCacheSpec]:
        """One spec per cache group, for blocks of ``block_size`` tokens
        (``mamba_prefix_caching``: state snapshots, ``mamba_cache_mode`` "align" or "all")."""
        return [MambaSpec(block_size, mamba_prefix_caching) if group in self.state_groups
                else attention_spec(block_size, window) for group, window in enumerate(self.sliding_windows)]

    @classmethod
    def from_config(cls, config) -> "KVCacheLayout":
        num_layers = config.num_hidden_layers
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None:
            layer_types = ["sliding_attention" if window else "full_attention"] * num_layers
        if len(layer_types) != num_layers:
            raise ValueError(f"config.layer_types has {len(layer_types)} entries but "
                             f"num_hidden_layers is {num_layers}")
        if is_hybrid(config):
            return cls._hybrid(layer_types)
        windows: list[int | None] = []
        layer_to_group = []
        for layer_type in layer_types:   # Hugging Face's names for the two kinds of layer
            if layer_type == "full_attention":
                layer_window = None
            elif layer_type == "sliding_attention":
                if not window:
                    raise ValueError("config.layer_types asks for sliding_attention "
                                     "but config.sliding_window is not set")
                layer_window = int(window)
            else:
                raise ValueError(f"layer type {layer_type!r} in config.layer_types is not supported "
                                 "(full_attention, sliding_attention, linear_attention)")
            if layer_window not in windows:
                windows.append(layer_window)
            layer_to_group.append(windows.index(layer_window))
        return cls(tuple(windows), tuple(layer_to_group))

    @classmethod
    def _hybrid(cls, layer_types: list[str]) -> "KVCacheLayout":
        """Group 0: the full-attention layers; then state groups of as many linear layers."""
        unknown = set(layer_types) - {"full_attention", "linear_attention"}
        if unknown:
            raise ValueError(f"layer types {sorted(unknown)} beside linear_attention are not supported "
                             "(a hybrid here mixes full_attention and linear_attention)")
        attention = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        linear = [i for i, t in enumerate(layer_types) if t == "linear_attention"]
        if not attention:
            raise ValueError("config.layer_types has no full_attention layer: a model of linear-attention "
                             "layers only is not supported")
        size = len(attention)
        groups = [attention] + [linear[start:start + size] for start in range(0, len(linear), size)]
        layer_to_group, layer_to_buffer = [0] * len(layer_types), [0] * len(layer_types)
        for group_id, layers in enumerate(groups):
            for index, layer in enumerate(layers):
                layer_to_group[layer], layer_to_buffer[layer] = group_id, index
        return cls((None,) * len(groups), tuple(layer_to_group), tuple(range(1, len(groups))),
                   tuple(layer_to_buffer))
