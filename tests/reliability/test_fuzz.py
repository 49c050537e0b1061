"""A seeded fuzzer for the engine: random workloads on a tiny model, checked exactly.

Each seed draws one workload (``make_workload``) and drives the engine by hand:

    engine settings  block_size 1..16, max_model_len 64..128, a token budget from one
                     block up, max_num_seqs 1..8, chunked prefill and prefix caching
                     on or off, a KV pool from "barely the largest request alone" up
    4..10 requests   prompt lengths 1..max_model_len-1 (many short, some long), shared
                     prefixes and duplicates, 1..12 output tokens, n = 1..3, eos on or
                     off, min_tokens, stop_token_ids; each arrives at a random step
                     (``engine.add_request`` between ``engine.step()`` calls) and some
                     are aborted at a random step (waiting, prefilling, decoding, done)
    interrupts       in a quarter of the seeds, Ctrl-C (KeyboardInterrupt) inside the
                     model at a few steps; the loop catches it and steps on

After every step ``check_invariants()`` runs (``debug_invariants=True``) and every
output so far must be a prefix of the expected one. At the end every request was
aborted or finished with a reason, every non-aborted one generated exactly what the
same prompt and parameters generate *alone* (the engine on a roomy configuration:
no preemption, no chunking, no prefix cache; cached per prompt), some of those
references are checked against Hugging Face ``generate``, and the pool holds no
referenced block.

A failure names the seed and the workload and says how to rerun just that seed:

    MICROVLLM_FUZZ_FIRST_SEED=17 MICROVLLM_FUZZ_SEEDS=1 pytest tests/reliability/test_fuzz.py
"""

from __future__ import annotations

import functools
import os
import random
from dataclasses import dataclass, field

import pytest

from microvllm import LLM, SamplingParams
from microvllm.core import FullAttentionSpec, SlidingWindowSpec
from microvllm.core.kv_cache_utils import cdiv
from tests.engine.conftest import hf_greedy

NUM_SEEDS = int(os.environ.get("MICROVLLM_FUZZ_SEEDS", "200"))
FIRST_SEED = int(os.environ.get("MICROVLLM_FUZZ_FIRST_SEED", "0"))
HF_CHECK_EVERY = 5          # every 5th seed also checks one reference against Hugging Face
MAX_OUTPUT = 12             # output tokens per request at most
MAX_STEPS = 3000            # a workload that needs more steps than this has hung
EOS = 2                     # the tiny models' eos token
SLIDING_WINDOW = 8          # the tiny Mistral's window (see microvllm/models/tiny.py)
VOCAB = 512


@dataclass
class FuzzRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival_step: int
    abort_step: int | None

    def describe(self) -> str:
        p = self.params
        extras = [f"n={p.n}"] if p.n > 1 else []
        extras += [] if p.ignore_eos else ["eos on"]
        extras += [f"min_tokens={p.min_tokens}"] if p.min_tokens else []
        extras += [f"stop_token_ids={p.stop_token_ids}"] if p.stop_token_ids else []
        abort = f", abort at step {self.abort_step}" if self.abort_step is not None else ""
        return (f"{self.request_id}: {len(self.prompt)} prompt tokens, max_tokens={p.max_tokens}"
                f"{''.join(', ' + e for e in extras)}, arrives at step {self.arrival_step}{abort}")


@dataclass
class Workload:
    seed: int
    arch: str
    settings: dict
    requests: list[FuzzRequest] = field(default_factory=list)
    interrupt_steps: set[int] = field(default_factory=set)  # KeyboardInterrupt in the model

    def describe(self) -> str:
        lines = [f"arch={self.arch} " + " ".join(f"{k}={v}" for k, v in self.settings.items())]
        if self.interrupt_steps:
            lines.append(f"  KeyboardInterrupt inside the model at steps {sorted(self.interrupt_steps)}")
        return "\n".join(lines + ["  " + r.describe() for r in self.requests])


def make_workload(seed: int, folders: dict[str, str]) -> Workload:
    rng = random.Random(seed)
    arch = rng.choice(["llama", "llama", "mistral"])
    folder = folders[arch]
    block_size = rng.choice([1, 2, 4, 4, 8, 16])
    max_model_len = rng.choice([64, 96, 128])
    chunked = rng.random() < 0.8
    if chunked:
        budget = max(block_size, rng.choice([1, 4, 8, 16, 32, 64, 256]))
    else:  # a prompt is scheduled whole: the budget must hold the longest
        budget = max_model_len + rng.choice([0, 0, 16])
    settings = dict(block_size=block_size, max_model_len=max_model_len, max_num_batched_tokens=budget,
                    max_num_seqs=rng.choice([1, 2, 3, 4, 8]), enable_chunked_prefill=chunked,
                    enable_prefix_caching=rng.random() < 0.8)
    workload = Workload(seed, arch, settings)

    shared_prefix = [rng.randrange(3, VOCAB) for _ in range(max_model_len)]
    for index in range(rng.randint(4, 10)):
        shape = rng.random()
        if shape < 0.5:
            length = rng.randint(1, 8)
        elif shape < 0.85:
            length = rng.randint(1, 32)
        else:
            length = rng.randint(1, max_model_len - 1)
        if workload.requests and rng.random() < 0.1:  # an exact duplicate
            prompt = list(rng.choice(workload.requests).prompt)
        elif rng.random() < 0.4:  # a shared prefix, then its own tokens
            cut = rng.randint(1, length)
            prompt = shared_prefix[:cut] + [rng.randrange(3, VOCAB) for _ in range(length - cut)]
        else:
            prompt = [rng.randrange(3, VOCAB) for _ in range(length)]
        max_tokens = rng.randint(1, MAX_OUTPUT)
        stop_token_ids = None
        if rng.random() < 0.2:  # a token the prompt really generates, so that it stops
            stop_token_ids = [rng.choice(reference(folder, tuple(prompt), 0, True, ())[0])]
        params = SamplingParams(
            n=rng.choice([1, 1, 1, 1, 2, 3]), temperature=0.0, max_tokens=max_tokens,
            ignore_eos=rng.random() < 0.7, stop_token_ids=stop_token_ids,
            min_tokens=rng.randint(0, max_tokens) if rng.random() < 0.2 else 0)
        arrival = 0 if rng.random() < 0.5 else rng.randint(1, 30)
        abort = arrival + rng.randint(0, 25) if rng.random() < 0.15 else None
        workload.requests.append(FuzzRequest(f"r{index}", prompt, params, arrival, abort))

    if rng.random() < 0.25:  # Ctrl-C inside the model at a few steps
        workload.interrupt_steps = set(rng.sample(range(40), rng.randint(1, 3)))

    # The pool: enough for the largest request alone at its worst step ("barely one
    # request"), plus a random margin.
    need = max(_blocks_alone(arch, block_size, len(r.prompt), r.params.max_tokens, max_model_len, budget)
               for r in workload.requests)
    settings["num_kv_blocks"] = 1 + need + rng.choice([0, 0, 1, 2, 4, 8, 32])
    return workload


def _blocks_alone(arch, block_size, num_prompt_tokens, max_tokens, max_model_len, budget) -> int:
    """The most blocks one request can hold when it runs alone: any chunk of up to
    ``budget`` tokens from any position (prefill, or recompute after preemption), up
    to its final length."""
    spec = SlidingWindowSpec(block_size, SLIDING_WINDOW) if arch == "mistral" else FullAttentionSpec(block_size)
    final = min(num_prompt_tokens + max_tokens, max_model_len)
    if arch != "mistral":
        return cdiv(final, block_size)
    return max(spec.num_blocks_needed(start, min(budget, final - start)) for start in range(final))


# ------------------------------------------------------------------------- references
@functools.lru_cache(maxsize=None)
def _roomy_llm(folder: str) -> LLM:
    return LLM(folder, max_model_len=256, num_kv_blocks=40, enable_prefix_caching=False,
               max_num_batched_tokens=256)


@functools.lru_cache(maxsize=None)
def reference(folder: str, prompt: tuple, min_tokens: int, ignore_eos: bool,
              stop_token_ids: tuple) -> tuple[tuple[int, ...], str, object]:
    """(tokens, finish_reason, stop_reason) of this prompt alone, with MAX_OUTPUT tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_OUTPUT, min_tokens=min_tokens,
                            ignore_eos=ignore_eos, stop_token_ids=list(stop_token_ids) or None)
    out = _roomy_llm(folder).generate({"prompt_token_ids": list(prompt)}, params, use_tqdm=False)[0].outputs[0]
    return tuple(out.token_ids), out.finish_reason, out.stop_reason


def expected_output(folder: str, request: FuzzRequest, max_model_len: int):
    """What the request must generate: the MAX_OUTPUT reference, cut at its own limit.
    Stopping depends only on the tokens so far, so a shorter run is a prefix, ending
    with "length" if the limit comes first (the length check runs before eos/stop)."""
    p = request.params
    tokens, reason, stop_reason = reference(folder, tuple(request.prompt), p.min_tokens, p.ignore_eos,
                                            tuple(p.stop_token_ids))
    limit = min(p.max_tokens, max_model_len - len(request.prompt))
    if len(tokens) >= limit:
        return tokens[:limit], "length", None
    return tokens, reason, stop_reason


# ----------------------------------------------------------------------------- the run
def run_workload(folder: str, workload: Workload) -> None:
    settings = workload.settings
    llm = LLM(folder, debug_invariants=True, **settings)  # check_invariants() after every step
    engine = llm.engine
    requests = {r.request_id: r for r in workload.requests}
    expected = {rid: expected_output(folder, r, settings["max_model_len"]) for rid, r in requests.items()}
    added, aborted, finished = set(), set(), {}
    step = 0

    run_model = engine.executor.execute_model
    def execute_model(plan):
        if step in workload.interrupt_steps:
            raise KeyboardInterrupt
        return run_model(plan)
    engine.executor.execute_model = execute_model

    while len(added) < len(requests) or engine.has_unfinished_requests():
        if step > MAX_STEPS:
            raise AssertionError(f"no progress: still busy after {MAX_STEPS} steps "
                                 f"(unfinished: {sorted(engine.scheduler.requests)})")
        for r in workload.requests:
            if r.arrival_step == step:
                engine.add_request(r.request_id, {"prompt_token_ids": r.prompt}, r.params)
                added.add(r.request_id)
            if r.abort_step == step and r.request_id in added:
                if engine.abort_request(r.request_id):
                    assert r.request_id not in finished, f"{r.request_id} aborted after it finished"
                    aborted.add(r.request_id)
                else:
                    assert r.request_id in finished, f"abort({r.request_id!r}) returned False but it never finished"
        try:
            outputs = engine.step()  # an empty engine takes an empty step: that must work too
        except KeyboardInterrupt:  # the engine must stay consistent: check, then go on
            engine.check_invariants()
            outputs = []
        for out in outputs:
            rid = out.request_id
            assert rid in added and rid not in aborted and rid not in finished, \
                f"step {step}: output for {rid}, which is not live"
            tokens, _, _ = expected[rid]
            for completion in out.outputs:
                assert tuple(completion.token_ids) == tokens[:len(completion.token_ids)], (
                    f"step {step}: {rid} sample {completion.index} generated {completion.token_ids}, "
                    f"alone it generates {list(tokens)}")
            if out.finished:
                finished[rid] = out
        step += 1

    assert added == set(requests)
    assert finished.keys() | aborted == added and not finished.keys() & aborted, \
        f"lost requests: {sorted(added - finished.keys() - aborted)}"
    for rid, out in finished.items():
        tokens, reason, stop_reason = expected[rid]
        assert len(out.outputs) == requests[rid].params.n
        for completion in out.outputs:
            got = (tuple(completion.token_ids), completion.finish_reason, completion.stop_reason)
            assert got == (tokens, reason, stop_reason), \
                f"{rid} sample {completion.index}: got {got}, alone it gives {(tokens, reason, stop_reason)}"
    manager = engine.kv_cache_manager
    held = [b.block_id for b in manager.block_pool.blocks if b.ref_cnt]
    assert not held and manager.block_pool.get_num_free_blocks() == manager.num_usable_blocks, \
        f"blocks still referenced after every request ended: {held}"
    assert engine.get_num_unfinished_requests() == 0
    engine.check_invariants()


def check_against_hugging_face(folder: str, workload: Workload) -> None:
    """One reference of this seed, recomputed by Hugging Face ``generate``."""
    request = random.Random(workload.seed).choice(workload.requests)
    prompt = tuple(request.prompt)
    tokens, _, _ = reference(folder, prompt, 0, True, ())
    assert tokens == hf_greedy(folder, prompt, MAX_OUTPUT), \
        f"{request.request_id}: the engine's reference differs from Hugging Face generate"


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + NUM_SEEDS), ids=lambda s: f"seed={s}")
def test_fuzz(tiny_folders, seed):
    workload = make_workload(seed, {arch: str(folder) for arch, folder in tiny_folders.items()})
    folder = str(tiny_folders[workload.arch])
    try:
        run_workload(folder, workload)
        if seed % HF_CHECK_EVERY == 0:
            check_against_hugging_face(folder, workload)
    except Exception as error:
        raise AssertionError(
            f"fuzz seed={seed} failed: {type(error).__name__}: {error}\n"
            f"workload: {workload.describe()}\n"
            f"rerun it alone: MICROVLLM_FUZZ_FIRST_SEED={seed} MICROVLLM_FUZZ_SEEDS=1 "
            "python -m pytest tests/reliability/test_fuzz.py") from error
