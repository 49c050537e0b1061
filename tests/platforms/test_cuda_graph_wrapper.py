"""``CUDAGraphWrapper`` (platforms/cuda_graph.py) applied by the model runner, with the
recording done by plain calls so that it runs on a CPU: which steps it takes, which
size each batch is padded to, that it captures each size once, and that the engine
then generates the same greedy tokens as without it. On a GPU, ``TorchCUDAGraph`` does
the recording (checked by ``python -m microvllm bench gpu``)."""

from __future__ import annotations

import pytest
import torch

from microvllm import LLM, SamplingParams
from microvllm.platforms.cuda_graph import CUDAGraphWrapper

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class PlainCallGraph:
    """Stands in for ``TorchCUDAGraph``: ``capture`` runs the step once (as the warm-up
    does) and keeps it; ``replay`` runs it again into the same output tensor, which is
    what replaying a recorded graph does."""

    def __init__(self, pool=None):
        self.fn, self.output, self.replays = None, None, 0

    def capture(self, fn):
        self.fn = fn
        self.output = fn().clone()
        return self.output

    def replay(self):
        self.output.copy_(self.fn())
        self.replays += 1


def triton_llm(folder, **settings):
    return LLM(str(folder), device="cpu", attention_backend="triton", max_model_len=64,
               max_num_batched_tokens=32, enable_prefix_caching=False, debug_invariants=True, **settings)


def greedy(llm, prompts, lengths):
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_decode_steps_replay_padded_graphs_with_the_same_tokens(tiny_models, arch):
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [20] * 17]
    lengths = [3, 6, 9]  # the batch shrinks 3 -> 2 -> 1 as requests finish
    eager = greedy(triton_llm(tiny_models[arch], enforce_eager=True), prompts, lengths)

    llm = triton_llm(tiny_models[arch])
    runner = llm.engine.executor.worker.model_runner
    wrapper = runner.decode_step_runner = CUDAGraphWrapper(
        runner.model, [1, 2, 4, 8], max_model_len=64, graph_factory=PlainCallGraph)
    assert greedy(llm, prompts, lengths) == eager
    # 3 decodes padded to 4, then 2, then 1: each size captured once, replayed every step.
    assert sorted(wrapper.graphs) == [1, 2, 4]
    assert [wrapper.graphs[s].replays for s in (4, 2, 1)] == [2, 3, 3]


def test_applies_only_to_small_decode_only_steps(tiny_models):
    from tests.platforms.test_padded_decode_batch import decode_batch

    wrapper = CUDAGraphWrapper(None, [1, 2, 4], max_model_len=64, graph_factory=PlainCallGraph)
    _, _, decodes = decode_batch([3, 4, 5], [[1], [2], [3]])
    assert wrapper.applies(3, [decodes])
    _, _, too_many = decode_batch([3] * 5, [[1]] * 5)
    assert not wrapper.applies(5, [too_many])
    decodes.max_query_len = 4  # a prefill chunk in the step
    assert not wrapper.applies(3, [decodes])


def test_a_reallocated_kv_cache_is_refused():
    from tests.platforms.test_padded_decode_batch import decode_batch

    wrapper = CUDAGraphWrapper(lambda *args: torch.zeros(len(args[0]), 4), [1, 2, 4], max_model_len=64,
                               graph_factory=PlainCallGraph)
    ids, positions, metadata = decode_batch([3, 4], [[1], [2]])
    cache = [torch.zeros(2, 4, 16, 1, 8)]
    assert wrapper(ids, positions, cache, [metadata]).shape == (2, 4)
    with pytest.raises(RuntimeError, match="KV cache tensors changed"):
        wrapper(ids, positions, [torch.zeros(2, 4, 16, 1, 8)], [metadata])


@NEEDS_CUDA
def test_cuda_engine_with_graphs_matches_eager_on_the_gpu(tiny_models):
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [20] * 17]
    settings = dict(device="cuda", dtype="float32", max_model_len=64)
    eager = greedy(LLM(str(tiny_models["llama"]), enforce_eager=True, **settings), prompts, [8] * 3)
    graphs = LLM(str(tiny_models["llama"]), **settings)
    assert isinstance(graphs.engine.executor.worker.model_runner.decode_step_runner, CUDAGraphWrapper)
    assert greedy(graphs, prompts, [8] * 3) == eager
