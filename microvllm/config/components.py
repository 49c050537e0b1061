"""The course's hook: replace an engine component with your own class.

``LLM(components={"block_pool": MyBlockPool})`` hands the dict to the engine beside the
config (it is not a setting of the engine); each place that builds a component asks
``component(components, name, default)``.
"""

from __future__ import annotations

# What ``components=`` can replace, and where the engine builds each one.
COMPONENTS = {
    "detokenizer": "IncrementalDetokenizer, one per request (engine/output_processor.py)",
    "block_pool": "BlockPool, the KV block allocator (core/kv_cache_manager.py)",
    "kv_cache_manager": "KVCacheManager, the scheduler's door to the cache (engine/engine.py)",
    "scheduler": "Scheduler (engine/engine.py)",
    "model_runner": "ModelRunner (worker/worker.py)",
    "block_table": "BlockTable, the runner's persistent block tables (worker/model_runner.py)",
    "sampler": "Sampler (worker/model_runner.py)",
    "rejection_sampler": "RejectionSampler, speculative decoding's check of the drafts (worker/model_runner.py)",
    "token_trie": "TokenTrie, the course backend's vocabulary trie (structured_output/backend_regex.py)",
}


def check_components(components) -> None:
    """Refuse, saying what to change, anything but ``{name in COMPONENTS: a class}``."""
    if components is None:
        return
    if not isinstance(components, dict):
        raise TypeError(f"components={components!r} must be a dict such as {{'block_pool': MyBlockPool}}")
    for name, cls in components.items():
        if name not in COMPONENTS:
            raise ValueError(f"components has an unknown name {name!r}; the replaceable components "
                             f"are: {', '.join(COMPONENTS)}")
        if not isinstance(cls, type):
            raise TypeError(f"components[{name!r}] must be a class (the one your exercise defines, "
                            f"replacing the engine's {COMPONENTS[name]}), got {cls!r}")


def component(components: dict[str, type] | None, name: str, default: type) -> type:
    """The class to build for ``name``: ``components[name]`` if given, else ``default``."""
    if name not in COMPONENTS:
        raise KeyError(f"{name!r} is not a replaceable component: add it to COMPONENTS")
    return (components or {}).get(name, default)
