"""The decode fast path (platforms/cpu/decode_fast_path.py), applied by the model runner:
the same result as ``LlamaForCausalLM.forward`` bit for bit, taken only by the steps it is
for, refused with a reason elsewhere, and absent with ``enforce_eager=True``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from microvllm import LLM, SamplingParams
from microvllm.models.tiny import make_tiny_model
from microvllm.platforms.cpu import decode_fast_path, gemm_kernels as cpu_kernels
from tests.engine.conftest import varied_prompts
from tests.platforms.test_vec_linear import VEC_MARKS

# The fast path runs each dtype's projections through that dtype's decode kernel: AMX
# tiles for bfloat16, or vdpbf16ps panels on an AVX512-BF16 CPU without AMX; for float32
# the vector kernel, on every target with a vector unit (AVX-512, AVX2, NEON), where a
# build that fails fails these tests (VEC_MARKS).
BF16_MISSING = (cpu_kernels.amx_status() and cpu_kernels.dpbf16_status())   # None: one of them runs
DTYPES = [pytest.param("bfloat16", marks=pytest.mark.skipif(BF16_MISSING is not None,
                                                            reason=f"bfloat16 decode kernel: {BF16_MISSING}")),
          pytest.param("float32", marks=VEC_MARKS)]


def make_llm(folder, dtype, **settings):
    return LLM(str(folder), dtype=dtype, max_model_len=128, max_num_batched_tokens=64,
               enable_prefix_caching=False, debug_invariants=True, **settings)


def the_runner(llm):
    return llm.engine.executor.worker.model_runner


class Both:
    """Stands in for the fast path: runs the model's forward, then the fast path, on the
    same inputs (the cache writes are the same values to the same slots), and records
    whether the hidden states are equal bit for bit."""

    def __init__(self, fast, model):
        self.fast, self.model, self.compared = fast, model, []

    def applies(self, num_tokens, metadata):
        return self.fast.applies(num_tokens, metadata)

    def __call__(self, input_ids, positions, kv_caches, metadata):
        expected = self.model(input_ids, positions, kv_caches, metadata)
        got = self.fast(input_ids, positions, kv_caches, metadata)
        self.compared.append((len(input_ids), torch.equal(got, expected)))
        return got


def generate(llm, prompts, max_tokens=10):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


@pytest.mark.parametrize("arch", ["llama", "mistral"])   # mistral: sliding window, head_dim 16
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_decode_step_matches_the_modules_bit_for_bit(tmp_path, arch, dtype, monkeypatch):
    """Each decode-only step runs twice, the model's forward then the fast path, on the
    same inputs: the final hidden states are equal bit for bit. Then whole generations
    with and without it, and with enforce_eager=True (no kernel at all): equal tokens."""
    folder = make_tiny_model(tmp_path / arch, arch, seed=5)
    prompts = varied_prompts(512, count=10, seed=2, max_len=40)
    llm = make_llm(folder, dtype)
    runner = the_runner(llm)
    fast = runner.decode_step_runner
    assert fast is not None, decode_fast_path.unsupported_reason(runner.model)
    both = runner.decode_step_runner = Both(fast, runner.model)
    with_fast_path = generate(llm, prompts)
    sizes = {n for n, _ in both.compared}
    assert len(both.compared) >= 5 and max(sizes) >= 10 and 1 in sizes, both.compared   # all at once, down to 1
    assert all(same for _, same in both.compared), both.compared

    runner.decode_step_runner = None
    assert generate(llm, prompts) == with_fast_path
    eager = make_llm(folder, dtype, enforce_eager=True)
    assert the_runner(eager).decode_step_runner is None
    if dtype == "float32":
        assert generate(eager, prompts) == with_fast_path
    else:
        # bfloat16: the eager path's torch matmuls and the packed kernels both round to
        # bfloat16, but in another order (oneDNN's AMX blocking is not ours), so a near-tie
        # may go either way. Teacher-forced instead: every token the fast path chose is,
        # under the eager model, within bfloat16's rounding of the most likely one.
        assert_each_token_is_eagers_choice_up_to_rounding(eager, prompts, with_fast_path)


BF16_LOGPROB_SLACK = 0.1   # logits of magnitude ~10 carry ~0.04 of bfloat16 rounding each


def assert_each_token_is_eagers_choice_up_to_rounding(eager, prompts, generations):
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    outs = eager.generate([{"prompt_token_ids": p + g} for p, g in zip(prompts, generations)], params,
                          use_tqdm=False)
    exact = 0
    for prompt, tokens, out in zip(prompts, generations, outs):
        for position, token in enumerate(tokens, start=len(prompt)):
            row = out.prompt_logprobs[position]
            best = max(lp.logprob for lp in row.values())
            gap = best - row[token].logprob
            assert gap <= BF16_LOGPROB_SLACK, (position, token, gap, row)
            exact += row[token].rank == 1
    # Near-ties are rare: nearly every token is exactly the eager model's argmax.
    assert exact >= 0.9 * sum(len(t) for t in generations)


@pytest.mark.parametrize("dtype", DTYPES)
def test_only_decode_only_steps_of_few_enough_rows_take_it(tmp_path, dtype):
    fast = the_runner(make_llm(make_tiny_model(tmp_path / "llama", "llama"), dtype)).decode_step_runner

    def step(num_decodes, num_reqs):
        return [SimpleNamespace(num_decodes=num_decodes, num_reqs=num_reqs)]
    with torch.no_grad():   # as in the runner (inference mode)
        assert fast.applies(3, step(3, 3))
        assert fast.applies(fast.max_rows, step(fast.max_rows, fast.max_rows))
        assert not fast.applies(4, step(2, 3))         # a prefill chunk in the step
        assert not fast.applies(3, step(None, 3))      # no promise that decodes come first
        assert not fast.applies(0, step(0, 0))
        rows = fast.max_rows + 1
        assert not fast.applies(rows, step(rows, rows))   # the GEMM kernel's row limit
    with torch.enable_grad():   # autograd: the modules, which record it
        assert not fast.applies(3, step(3, 3))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_slot_outside_the_cache_is_refused(tmp_path, dtype, monkeypatch):
    """A bad slot mapping raises the IndexError the write_kv wrapper raises, naming it."""
    llm = make_llm(make_tiny_model(tmp_path / "llama", "llama"), dtype)
    fast = the_runner(llm).decode_step_runner

    class BadSlots:
        applies = staticmethod(fast.applies)

        def __call__(self, input_ids, positions, kv_caches, metadata):
            num_slots = kv_caches[0].shape[1] * kv_caches[0].shape[2]
            metadata[0].slot_mapping = torch.full_like(metadata[0].slot_mapping, num_slots)
            return fast(input_ids, positions, kv_caches, metadata)

    monkeypatch.setattr(the_runner(llm), "decode_step_runner", BadSlots())
    with pytest.raises(IndexError, match=r"slot_mapping\[0\] = \d+ is outside the cache's \d+ slots"):
        generate(llm, [[5, 6, 7]], max_tokens=3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_it_times_its_kernels_and_is_one_profiler_range(tmp_path, dtype):
    """bench throughput --profile sees the fast path as one range and splits it by the
    times decode_layers() measures itself."""
    llm = make_llm(make_tiny_model(tmp_path / "llama", "llama"), dtype)
    fast = the_runner(llm).decode_step_runner
    llm.engine.add_request("a", {"prompt_token_ids": [5, 6, 7]},
                           SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    llm.engine.step()   # the prefill
    fast.seconds = {}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.engine.step()   # a decode: the fast path
    assert "microvllm::decode_fast_path" in {event.key for event in prof.key_averages()}
    assert set(fast.seconds) == set(decode_fast_path.KERNEL_KINDS)
    assert all(seconds > 0 for seconds in fast.seconds.values())


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_weight_changed_in_place_is_used(tmp_path, dtype):
    """The layer records point at packed weights; changing a weight remakes them (as the
    modules' PackedGemm repacks), so both paths still agree bit for bit."""
    llm = make_llm(make_tiny_model(tmp_path / "llama", "llama"), dtype)
    runner = the_runner(llm)
    fast = runner.decode_step_runner
    prompts = [[5, 6, 7, 8], [9, 10]]
    before = generate(llm, prompts)
    with torch.no_grad():
        runner.model.layers[1].mlp.down_proj.weight.mul_(-3.0)
    after = generate(llm, prompts)
    runner.decode_step_runner = None
    assert generate(llm, prompts) == after != before
    runner.decode_step_runner = fast


def test_where_it_cannot_run_the_model_says_why(tmp_path):
    qwen3 = the_runner(LLM(str(make_tiny_model(tmp_path / "qwen3", "qwen3")), max_model_len=64))
    assert qwen3.decode_step_runner is None
    assert "per-head query / key norms" in decode_fast_path.unsupported_reason(qwen3.model)

    folder = make_tiny_model(tmp_path / "llama", "llama")
    on_torch = the_runner(LLM(str(folder), attention_backend="torch", max_model_len=64))
    assert on_torch.decode_step_runner is None
    assert decode_fast_path.unsupported_reason(on_torch.model) == "the attention backend is not 'cpu'"

    half = the_runner(LLM(str(folder), dtype="float16", max_model_len=64))
    assert half.decode_step_runner is None
    assert "float16" in decode_fast_path.unsupported_reason(half.model)
    with pytest.raises(ValueError, match="the decode fast path does not apply: .*float16"):
        decode_fast_path.DecodeFastPath(half.model)
