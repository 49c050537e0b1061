"""The decode fast path (models/decode_fast_path.py): the same layers as the modules,
bit for bit, taken only by the steps it is for, and refused with a reason elsewhere."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from microvllm import LLM, SamplingParams
from microvllm.layers import cpu_kernels
from microvllm.models import decode_fast_path
from microvllm.models.tiny import make_tiny_model
from tests.engine.conftest import varied_prompts

# The fast path runs each dtype's projections through that dtype's decode kernel.
KERNEL_STATUS = {"bfloat16": cpu_kernels.amx_status, "float32": cpu_kernels.avx512_status}
DTYPES = [pytest.param(dtype, marks=pytest.mark.skipif(status() is not None,
                                                       reason=f"{dtype} decode kernel: {status()}"))
          for dtype, status in KERNEL_STATUS.items()]


def make_llm(folder, dtype, **settings):
    return LLM(str(folder), dtype=dtype, max_model_len=128, max_num_batched_tokens=64,
               enable_prefix_caching=False, debug_invariants=True, **settings)


def the_model(llm):
    return llm.engine.executor.worker.model_runner.model


def generate(llm, prompts, max_tokens=10):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


@pytest.mark.parametrize("arch", ["llama", "mistral"])   # mistral: sliding window, head_dim 16
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_decode_step_matches_the_modules_bit_for_bit(tmp_path, arch, dtype, monkeypatch):
    """Each decode-only step runs twice, modules then fast path, on the same inputs (the
    cache writes are the same values to the same slots): the final hidden states are
    equal bit for bit. Then whole generations with and without it: equal tokens."""
    folder = make_tiny_model(tmp_path / arch, arch, seed=5)
    prompts = varied_prompts(512, count=10, seed=2, max_len=40)
    llm = make_llm(folder, dtype)
    model = the_model(llm)
    fast = model.decode_fast_path
    assert fast is not None, decode_fast_path.unsupported_reason(model)
    forward, compared = model.forward, []

    def both(input_ids, positions, kv_caches, metadata):
        if not fast.applies(len(input_ids), metadata):
            return forward(input_ids, positions, kv_caches, metadata)
        model.decode_fast_path = None
        expected = forward(input_ids, positions, kv_caches, metadata)
        model.decode_fast_path = fast
        got = forward(input_ids, positions, kv_caches, metadata)
        compared.append((len(input_ids), torch.equal(got, expected)))
        return got

    monkeypatch.setattr(model, "forward", both)
    with_fast_path = generate(llm, prompts)
    sizes = {n for n, _ in compared}
    assert len(compared) >= 5 and max(sizes) >= 10 and 1 in sizes, compared   # all at once, down to 1
    assert all(same for _, same in compared), compared
    monkeypatch.undo()

    model.decode_fast_path = None
    assert generate(llm, prompts) == with_fast_path


@pytest.mark.parametrize("dtype", DTYPES)
def test_only_decode_only_steps_of_few_enough_rows_take_it(tmp_path, dtype):
    model = the_model(make_llm(make_tiny_model(tmp_path / "llama", "llama"), dtype))
    fast = model.decode_fast_path

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
    model = the_model(llm)
    fast, forward = model.decode_fast_path, model.forward

    def bad_slots(input_ids, positions, kv_caches, metadata):
        if fast.applies(len(input_ids), metadata):
            num_slots = kv_caches[0].shape[1] * kv_caches[0].shape[2]
            metadata[0].slot_mapping = torch.full_like(metadata[0].slot_mapping, num_slots)
        return forward(input_ids, positions, kv_caches, metadata)

    monkeypatch.setattr(model, "forward", bad_slots)
    with pytest.raises(IndexError, match=r"slot_mapping\[0\] = \d+ is outside the cache's \d+ slots"):
        generate(llm, [[5, 6, 7]], max_tokens=3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_it_times_its_kernels_and_is_one_profiler_range(tmp_path, dtype):
    """bench throughput --profile sees the fast path as one range and splits it by the
    times decode_layers() measures itself."""
    llm = make_llm(make_tiny_model(tmp_path / "llama", "llama"), dtype)
    fast = the_model(llm).decode_fast_path
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
    model = the_model(llm)
    fast = model.decode_fast_path
    prompts = [[5, 6, 7, 8], [9, 10]]
    before = generate(llm, prompts)
    with torch.no_grad():
        model.layers[1].mlp.down_proj.weight.mul_(-3.0)
    after = generate(llm, prompts)
    model.decode_fast_path = None
    assert generate(llm, prompts) == after != before
    model.decode_fast_path = fast


def test_where_it_cannot_run_the_model_says_why(tmp_path):
    qwen3 = the_model(LLM(str(make_tiny_model(tmp_path / "qwen3", "qwen3")), max_model_len=64))
    assert qwen3.decode_fast_path is None
    assert "per-head query / key norms" in decode_fast_path.unsupported_reason(qwen3)

    folder = make_tiny_model(tmp_path / "llama", "llama")
    on_torch = the_model(LLM(str(folder), attention_backend="torch", max_model_len=64))
    assert on_torch.decode_fast_path is None
    assert decode_fast_path.unsupported_reason(on_torch) == "the attention backend is not 'cpu'"

    half = the_model(LLM(str(folder), dtype="float16", max_model_len=64))
    assert half.decode_fast_path is None
    assert "float16" in decode_fast_path.unsupported_reason(half)
    with pytest.raises(ValueError, match="the decode fast path does not apply: .*float16"):
        decode_fast_path.DecodeFastPath(half)
