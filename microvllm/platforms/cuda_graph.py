"""``CUDAGraphWrapper``: a decode step recorded once per batch size, then replayed
(vLLM: ``vllm/compilation/cuda_graph.py``, in ``cudagraph_mode`` FULL_DECODE_ONLY).

A decode step of a 1B model launches hundreds of small kernels; at batch 1 the GPU
spends more time waiting for Python to launch them than running them. A CUDA graph
records the launches of one step, with their arguments and addresses, and replays
them all with one call. The model runner applies it (``ModelRunner.run_model``),
never the model: ``llama.py`` stays the definition, and ``enforce_eager=True`` (no
wrapper) runs exactly that code::

    run_model(input_ids [3], positions [3], kv_caches, metadata)   a decode-only step
      applies(3, metadata)?  max_query_len == 1 and 3 <= largest capture size
      size = batch.fill(...)            copy into the persistent buffers, pad 3 -> 4
      graphs[4] exists?  no: capture    warm up once, then record model(inputs(4))
      graphs[4].replay()                the recorded launches, on the new values
      return graphs[4].output[:3]       the real rows; the padding row is dropped

Graphs are captured the first time each size is needed (vLLM captures them all at
start-up), into one shared memory pool. The recording is done by ``graph_factory``:
``TorchCUDAGraph`` on a GPU; the tests pass a plain-call stand-in so that the
wrapper's bookkeeping (padding, which graph, which rows) runs on a CPU.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

from microvllm.attention.metadata import AttentionMetadata
from microvllm.platforms.padded_decode_batch import PaddedDecodeBatch

logger = logging.getLogger(__name__)


class TorchCUDAGraph:
    """One recorded step: ``capture(fn)`` runs ``fn`` once to warm up (Triton compiles,
    cuBLAS picks its kernels), then records it; ``replay()`` relaunches the recording,
    which writes into the same ``output`` tensor."""

    def __init__(self, pool=None):
        self.pool = pool
        self.graph = None
        self.output: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up: nothing that allocates or compiles may happen during capture
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.output = fn()
        return self.output

    def replay(self) -> None:
        self.graph.replay()


class CUDAGraphWrapper:
    """Runs a decode-only step of ``model`` as a replayed graph (see the module docstring)."""

    def __init__(self, model: nn.Module, capture_sizes: list[int], *, max_model_len: int,
                 graph_factory: Callable[..., TorchCUDAGraph] = TorchCUDAGraph):
        self.model = model
        self.capture_sizes = list(capture_sizes)
        self.max_model_len = max_model_len
        self.graph_factory = graph_factory
        self.graphs: dict[int, TorchCUDAGraph] = {}
        self.batch: PaddedDecodeBatch | None = None   # made at the first call: needs the cache
        self._kv_caches: list[torch.Tensor] | None = None
        self._pool = None

    def applies(self, num_tokens: int, attn_metadata: list[AttentionMetadata]) -> bool:
        """A decode-only step (one token per request) no larger than the largest capture size."""
        return (bool(self.capture_sizes) and num_tokens <= self.capture_sizes[-1]
                and all(m.max_query_len == 1 and m.num_reqs == num_tokens for m in attn_metadata))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[torch.Tensor], attn_metadata: list[AttentionMetadata]) -> torch.Tensor:
        self._check_same_caches(kv_caches)
        if self.batch is None:
            block_size = kv_caches[0].shape[2]
            self.batch = PaddedDecodeBatch(self.capture_sizes, len(attn_metadata),
                                           -(-self.max_model_len // block_size), self.max_model_len,
                                           device=input_ids.device)
        num_reqs = len(input_ids)
        size = self.batch.fill(input_ids, positions, attn_metadata)
        graph = self.graphs.get(size)
        if graph is None:
            graph = self.graphs[size] = self._capture(size, kv_caches)
        graph.replay()
        return graph.output[:num_reqs]

    def _capture(self, size: int, kv_caches: list[torch.Tensor]) -> TorchCUDAGraph:
        ids, positions, metadata = self.batch.inputs(size)
        graph = self.graph_factory(pool=self._pool)
        graph.capture(lambda: self.model(ids, positions, kv_caches, metadata))
        if self._pool is None and getattr(graph, "graph", None) is not None:
            self._pool = graph.graph.pool()  # every later graph shares the first one's memory
        logger.debug("CUDA graph captured for decode batches of %d", size)
        return graph

    def _check_same_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """A graph recorded the KV cache's addresses: it must be the same tensors every step."""
        if self._kv_caches is None:
            self._kv_caches = list(kv_caches)
        elif len(kv_caches) != len(self._kv_caches) or any(
                a.data_ptr() != b.data_ptr() for a, b in zip(kv_caches, self._kv_caches)):
            raise RuntimeError("the KV cache tensors changed after CUDA graphs were captured: "
                               "a graph replays the addresses it recorded. Build a new engine "
                               "instead of reallocating its cache (or use enforce_eager=True)")
