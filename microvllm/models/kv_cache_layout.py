"""Which layers share which KV cache group.

Layers with the same attention kind (full attention, or a sliding window of the
same size) form one *cache group*: they share a block table per request and one
single-type KV cache manager in ``microvllm/core``. Llama and Qwen3 have one
full-attention group; Mistral with ``sliding_window`` set has one sliding-window
group; a config with ``layer_types`` mixing both has two (vLLM V1's hybrid
allocator, made small)::

    layer:            0     1     2     3
    layer_types:    full  slide  full  slide      -> groups [full, sliding(W)]
    layer_to_group:   0     1     0     1
"""

from __future__ import annotations

from dataclasses import dataclass

from microvllm.core.kv_cache_spec import KVCacheSpec, attention_spec


@dataclass(frozen=True)
class KVCacheLayout:
    """``sliding_windows[g]``: the window of cache group ``g`` (None: full attention);
    ``layer_to_group[i]``: layer ``i``'s group. What each group needs is core's
    ``KVCacheSpec`` (``kv_cache_specs``): the kind of a group is written down there, once."""

    sliding_windows: tuple[int | None, ...]
    layer_to_group: tuple[int, ...]

    @property
    def num_groups(self) -> int:
        return len(self.sliding_windows)

    def kv_cache_specs(self, block_size: int) -> list[KVCacheSpec]:
        """One spec per cache group, for blocks of ``block_size`` tokens."""
        return [attention_spec(block_size, window) for window in self.sliding_windows]

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
                raise ValueError(f"layer type {layer_type!r} in config.layer_types is not "
                                 "supported (only full_attention and sliding_attention)")
            if layer_window not in windows:
                windows.append(layer_window)
            layer_to_group.append(windows.index(layer_window))
        return cls(tuple(windows), tuple(layer_to_group))
