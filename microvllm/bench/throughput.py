"""Offline throughput: ``python -m microvllm bench throughput`` (or ``microvllm bench throughput``).

Workload ``random`` (seeded): N requests of random token ids, prompt and output
lengths uniform in their ranges, ``ignore_eos``, run through

    HF one at a time    transformers ``generate``, one request after another
    HF static batch     transformers ``generate`` on one left-padded batch that generates
                        the longest requested length (only requested tokens count as useful)
    microvllm           ``LLM(...).generate`` with one SamplingParams per request

and compared with what this machine could do at best, measured in the same run:

    roofline    FLOPs of the work microvllm did / a large matmul's FLOP/s
    time floor  sum over microvllm's steps of max(FLOPs / matmul rate,
                bytes read (weights + attended KV) / large-copy bandwidth)

The floor needs each step's batch, so one run records the trace (``trace=True``,
which also warms up) and untraced runs of the same workload (same deterministic
schedule) are the ones timed. HF's static batch and microvllm are timed in turn,
``--repeat`` times (3; ``--quick``: 1), each microvllm run on a fresh engine, and
the pair whose ratio is the median is reported: a shared machine's speed drifts
over minutes, so only runs made side by side compare fairly. Then the time of one
decode-only step at batch 1 and at batch 32 (``llm.engine.step()`` timed by hand).

Workload ``prefix``: requests that share a long system prompt, with prefix caching
off and on: prefill tokens computed (prompt tokens minus ``num_cached_tokens``) and
time. ``--workload all`` (default) runs both; ``--quick`` is a small version for CI.
``--workload moe``: a random mixture of experts, its three expert loops side by side (bench/moe.py).
Greedy token ids of microvllm and HF are compared and reported, never asserted.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from microvllm.bench.roofline import ModelCost, StepCost, copy_bandwidth, cpu_description, matmul_rate, trace_step_costs

FIRST_TOKEN_ID = 32   # random prompts avoid the lowest ids, where special tokens live


# ---------------------------------------------------------------- workloads
@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def random_workload(num_requests: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int],
                    vocab_size: int, seed: int) -> Workload:
    """Prompts of random ids, lengths uniform in ``prompt_lens``; outputs uniform in ``output_lens``."""
    rng = random.Random(seed)
    low = min(FIRST_TOKEN_ID, vocab_size // 4)
    prompts, outs = [], []
    for _ in range(num_requests):
        length = rng.randint(*prompt_lens)
        prompts.append([rng.randrange(low, vocab_size) for _ in range(length)])
        outs.append(rng.randint(*output_lens))
    return Workload(prompts, outs)


def prefix_workload(num_requests: int, prefix_len: int, question_lens: tuple[int, int],
                    output_len: int, vocab_size: int, seed: int) -> Workload:
    """One shared ``prefix_len``-token system prompt, then a distinct random question each."""
    rng = random.Random(seed + 1)
    low = min(FIRST_TOKEN_ID, vocab_size // 4)
    system = [rng.randrange(low, vocab_size) for _ in range(prefix_len)]
    prompts = [system + [rng.randrange(low, vocab_size) for _ in range(rng.randint(*question_lens))]
               for _ in range(num_requests)]
    return Workload(prompts, [output_len] * num_requests)


@dataclass
class RunResult:
    name: str
    wall_s: float
    useful_tokens: int
    total_tokens: int
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def useful_rate(self) -> float:
        return self.useful_tokens / self.wall_s

    @property
    def total_rate(self) -> float:
        return self.total_tokens / self.wall_s


# ------------------------------------------------------------ Hugging Face
@dataclass
class TimedPair:
    """One turn of ``--repeat``: HF's static batch (None with --skip-hf), then microvllm."""
    static: RunResult | None
    result: RunResult
    step_times: list[float]
    num_steps: int

    @property
    def ratio(self) -> float | None:
        """How many times faster than HF's static batch (None without it)."""
        return self.static.wall_s / self.result.wall_s if self.static else None


def load_hf(model_path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    pad = model.generation_config.pad_token_id
    pad = model.config.pad_token_id if pad is None else pad
    return model, (0 if pad is None else int(pad))


@torch.inference_mode()
def _hf_generate(model, ids, mask, max_new_tokens: int, pad_id: int):
    # eos_token_id=None: generation neither stops at nor bans eos (= ignore_eos).
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                          eos_token_id=None, pad_token_id=pad_id)


def hf_one_at_a_time(model, pad_id: int, workload: Workload) -> RunResult:
    outputs = []
    start = time.perf_counter()
    for prompt, n in zip(workload.prompts, workload.output_lens):
        ids = torch.tensor([prompt])
        out = _hf_generate(model, ids, torch.ones_like(ids), n, pad_id)
        outputs.append(out[0, len(prompt):].tolist())
    wall = time.perf_counter() - start
    return RunResult("HF one at a time", wall, workload.num_output_tokens,
                     workload.num_prompt_tokens + workload.num_output_tokens, outputs)


def _left_padded(prompts: list[list[int]], pad_id: int):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def hf_static_batch(model, pad_id: int, workload: Workload) -> RunResult:
    start = time.perf_counter()
    ids, mask = _left_padded(workload.prompts, pad_id)
    out = _hf_generate(model, ids, mask, max(workload.output_lens), pad_id)
    wall = time.perf_counter() - start
    width = ids.shape[1]
    outputs = [out[i, width:width + n].tolist() for i, n in enumerate(workload.output_lens)]
    return RunResult("HF static batch", wall, workload.num_output_tokens,
                     workload.num_prompt_tokens + workload.num_output_tokens, outputs)


def hf_warm_up(model, pad_id: int, workload: Workload) -> None:
    short = [p[:8] for p in workload.prompts[:2]]
    _hf_generate(model, *_left_padded(short[:1], pad_id), 2, pad_id)
    _hf_generate(model, *_left_padded(short, pad_id), 2, pad_id)


# --------------------------------------------------------------- microvllm
def make_llm(model_path: Path, args, **options):
    from microvllm import LLM

    if args.attention_backend is not None:
        options["attention_backend"] = args.attention_backend
    return LLM(str(model_path), dtype=args.dtype, seed=args.seed, enforce_eager=args.enforce_eager,
               tensor_parallel_size=args.tensor_parallel_size, **options)


def microvllm_generate(llm, workload: Workload, name: str = "microvllm",
                       step_times: list[float] | None = None):
    """``llm.generate`` the workload, timed. With ``step_times``, also the seconds of each
    ``engine.step()`` call (a wrapper on this engine instance: two clock reads per step)."""
    from microvllm import SamplingParams

    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in workload.output_lens]
    engine = llm.engine
    if step_times is not None:
        step = engine.step

        def timed_step():
            begin = time.perf_counter()
            out = step()
            step_times.append(time.perf_counter() - begin)
            return out
        engine.step = timed_step
    try:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
    finally:
        if step_times is not None:
            del engine.step
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    useful = sum(len(o) for o in outputs)
    result = RunResult(name, wall, useful, workload.num_prompt_tokens + useful, outputs)
    return result, outs


def decode_steps(llm, cost: ModelCost, batch: int, prompt_len: int, output_len: int,
                 seed: int) -> tuple[list[float], list[StepCost]]:
    """Run ``batch`` requests through ``llm.engine.step()`` by hand; return the seconds and
    the cost of every decode-only step (every request already has an output token, so
    the step computes exactly one token each; the prompts were prefilled before)."""
    from microvllm import SamplingParams

    workload = random_workload(batch, (prompt_len, prompt_len), (output_len, output_len),
                               cost.vocab_size, seed)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    produced: dict[str, int] = {}
    for i, prompt in enumerate(workload.prompts):
        request_id = f"decode-b{batch}-{i}"
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        produced[request_id] = 0
    times, costs = [], []
    while engine.has_unfinished_requests():
        decode_only = all(n > 0 for n in produced.values())
        chunks = [(1, prompt_len + n - 1) for n in produced.values()]
        start = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - start
        for out in outs:
            produced[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                del produced[out.request_id]
        if decode_only:
            times.append(elapsed)
            costs.append(cost.step_cost(chunks, len(chunks)))
    return times, costs


# ----------------------------------------------------------------- printing
def _fmt_int(n: float) -> str:
    return f"{n:,.0f}"


def _params(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n / 1e3:.1f}k"


def _si(value: float, unit: str) -> str:
    """``value`` with a k/M/G/T prefix and 3 significant digits: 1.23 GFLOP, 45.6 MB."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            break
    else:
        prefix, scale = "", 1.0
    scaled = value / scale
    digits = 0 if abs(scaled) >= 100 else 1 if abs(scaled) >= 10 else 2
    return f"{scaled:,.{digits}f} {prefix}{unit}"


def _pct(fraction: float) -> str:
    return f"{fraction:.1%}" if fraction >= 0.01 else f"{fraction * 100:.2g}%"


def _s(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 0.1 else _ms(seconds)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e3:.3f} ms"


def _identical(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b))


def _first_divergence(a: list[list[int]], b: list[list[int]]) -> str:
    where = [next(i for i, (s, t) in enumerate(zip(x, y)) if s != t) if x != y else None
             for x, y in zip(a, b)]
    diverged = [w for w in where if w is not None]
    if not diverged:
        return ""
    return f" (the others first differ at output token {min(diverged)}..{max(diverged)})"


def _print_row(name: str, r: RunResult | str) -> RunResult | str:
    if isinstance(r, str):
        print(f"{name:24}{r:>37}")
    else:
        print(f"{name:24}{r.useful_rate:>13.1f}{r.total_rate:>14.1f}{r.wall_s:>10.2f}")
    sys.stdout.flush()
    return r


# ---------------------------------------------------------------- sections
def bench_random(args, model_path: Path, cost: ModelCost, dtype: torch.dtype,
                 flop_rate: float, bandwidth: float) -> None:
    workload = random_workload(args.num_requests, args.prompt_lens, args.output_lens,
                               cost.vocab_size, args.seed)
    (p_lo, p_hi), (o_lo, o_hi) = args.prompt_lens, args.output_lens
    print(f"workload: {args.num_requests} requests, prompts {p_lo}-{p_hi}, outputs {o_lo}-{o_hi} "
          f"(seed {args.seed}), {args.dtype}, {model_path.name}")
    print(f"  {_fmt_int(workload.num_prompt_tokens)} prompt + {_fmt_int(workload.num_output_tokens)} "
          "output tokens, random ids, ignore_eos, greedy")
    sys.stdout.flush()

    # Built first, so that a model the engine cannot load fails before the long HF runs.
    traced_llm = make_llm(model_path, args, trace=True)
    print(f"{'':24}{'useful tok/s':>13}{'total tok/s':>14}{'wall s':>10}")
    hf_results: dict[str, RunResult | str] = {}
    model, pad_id = None, 0
    if args.skip_hf:
        for name in ("HF one at a time", "HF static batch"):
            hf_results[name] = _print_row(name, "skipped (--skip-hf)")
    else:
        model, pad_id = load_hf(model_path, dtype)
        hf_warm_up(model, pad_id, workload)
        name = "HF one at a time"
        if args.skip_hf_one_at_a_time:
            hf_results[name] = _print_row(name, "skipped (--quick)" if args.quick else "skipped")
        else:
            hf_results[name] = _print_row(name, hf_one_at_a_time(model, pad_id, workload))
    sys.stdout.flush()

    # The traced run warms up and records the schedule; the untraced runs are timed.
    traced, _ = microvllm_generate(traced_llm, workload)
    trace = traced_llm.trace
    del traced_llm
    gc.collect()
    # HF's static batch and microvllm, timed in turn (--repeat pairs): this machine's speed
    # drifts over minutes, so a ratio is only fair between runs made side by side.
    pairs = []
    llm = None
    for i in range(args.repeat):
        static = hf_static_batch(model, pad_id, workload) if model is not None else None
        del llm
        gc.collect()
        llm = make_llm(model_path, args)   # a fresh engine: nothing cached from the last run
        step_times: list[float] = []
        result, _ = microvllm_generate(llm, workload, step_times=step_times)
        pairs.append(TimedPair(static, result, step_times, llm.engine.num_steps))
        if args.repeat > 1:
            pair = pairs[-1]
            versus = (f"HF static batch {static.wall_s:.2f} s, " if static else "")
            ratio = (f" ({pair.ratio:.1f}x)" if static else "")
            print(f"  pair {i + 1}/{args.repeat}: {versus}microvllm {result.wall_s:.2f} s{ratio}")
            sys.stdout.flush()
    if model is not None:
        del model
        gc.collect()
    # The pair of median ratio (or, without HF, of median microvllm time) is the one reported.
    ordered = sorted(pairs, key=lambda p: p.ratio if p.static else p.result.wall_s)
    chosen = ordered[(len(ordered) - 1) // 2]   # the lower median: one of the pairs
    if chosen.static is not None:
        hf_results["HF static batch"] = _print_row("HF static batch", chosen.static)
    result, step_times, num_steps = chosen.result, chosen.step_times, chosen.num_steps
    config = llm.engine.config
    _print_row("microvllm", result)
    report_vllm_style(result, workload, args.output_json)
    if len(pairs) > 1:
        print(f"  the rows above: the pair of median {'ratio' if chosen.static else 'microvllm time'} "
              f"of {len(pairs)} (HF static batch and microvllm timed in turn)")

    ratios = [f"microvllm / {name.replace('one at a time', 'one-at-a-time')}: "
              f"{result.useful_rate / r.useful_rate:.1f}x"
              for name, r in hf_results.items() if isinstance(r, RunResult)]
    if ratios:
        print("   ".join(ratios))
    tensor_parallel, device = config.parallel_config.tensor_parallel_size, config.device_config
    scheduler = config.scheduler_config
    print(f"  microvllm: {num_steps} steps, attention backend {device.attention_backend!r}, "
          + (f"tensor_parallel_size {tensor_parallel}, " if tensor_parallel > 1 else "") +
          f"{'enforce_eager (plain torch), ' if device.enforce_eager else ''}"
          f"max_num_batched_tokens {scheduler.max_num_batched_tokens}, max_num_seqs {scheduler.max_num_seqs}, "
          f"prefix caching {'on' if config.cache_config.enable_prefix_caching else 'off'}")
    if result.useful_tokens != workload.num_output_tokens:
        print(f"warning: microvllm produced {result.useful_tokens} output tokens, "
              f"{workload.num_output_tokens} were requested")

    parity = []
    for name in ("HF one at a time", "HF static batch"):
        r = hf_results.get(name)
        if isinstance(r, RunResult):
            same = _identical(result.outputs, r.outputs)
            parity.append(f"{same}/{len(r.outputs)} identical to {name}"
                          f"{_first_divergence(result.outputs, r.outputs)}")
    same = _identical(result.outputs, traced.outputs)
    if same != len(result.outputs):   # the same engine, same schedule: should never differ
        parity.append(f"only {same}/{len(result.outputs)} identical to microvllm's own traced run")
    print("greedy token ids: " + ("; ".join(parity) if parity else "not compared with HF (--skip-hf)"))

    # Roofline: the FLOPs of the work microvllm did, at the large-matmul rate.
    costs = trace_step_costs(trace, cost)
    flops = sum(c.flops for c in costs)
    tokens = sum(c.tokens for c in costs)
    rows_ = sum(c.logit_rows for c in costs)
    attention = sum(c.attention_flops for c in costs)
    limit_s = flops / flop_rate
    print(f"roofline: {_si(flops, 'FLOP')} of work / {_si(flop_rate, 'FLOP/s')} measured = "
          f"{_s(limit_s)}; microvllm at {_pct(limit_s / result.wall_s)} of the matmul limit")
    print(f"  work = 2 x {_params(cost.body_params)} body params x {_fmt_int(tokens)} tokens "
          f"+ 2 x {_params(cost.lm_head_params)} lm_head x {_fmt_int(rows_)} sampled rows "
          f"+ {_si(attention, 'FLOP')} attention")
    floor = sum(c.floor_s(flop_rate, bandwidth) for c in costs)
    compute_s = sum(c.flops / flop_rate for c in costs)
    memory_s = sum(c.bytes_read / bandwidth for c in costs)
    num_compute = sum(c.compute_bound(flop_rate, bandwidth) for c in costs)
    print(f"time floor: {_s(floor)} (sum over {len(costs)} steps of max(compute, memory); "
          f"{num_compute} compute-bound, {len(costs) - num_compute} memory-bound); "
          f"microvllm wall = {result.wall_s / floor:.1f} x the floor")
    print(f"  all compute alone {_s(compute_s)}, all memory alone {_s(memory_s)}; reading the "
          f"{_si(cost.weight_bytes, 'B')} of weights once at {_si(bandwidth, 'B/s')} takes "
          f"{_ms(cost.weight_bytes / bandwidth)} per step")
    if num_steps != len(costs):
        print(f"  note: the timed run took {num_steps} steps, the traced run {len(costs)}: "
              "the floor is that of the traced schedule")
    else:
        decode_only = [all(r.kind == "decode" for r in s.scheduled) for s in trace]
        parts = []
        for label, want in (("steps with prefill", False), ("decode-only steps", True)):
            picked = [(t, c) for t, c, d in zip(step_times, costs, decode_only) if d == want]
            if picked:
                measured = sum(t for t, _ in picked)
                floor_part = sum(c.floor_s(flop_rate, bandwidth) for _, c in picked)
                label = label if len(picked) > 1 else label.replace("steps", "step")
                parts.append(f"{len(picked)} {label} {_s(measured)} (floor {_s(floor_part)}, "
                             f"{_fmt_int(sum(c.tokens for _, c in picked))} tokens)")
        parts.append(f"outside steps {_s(result.wall_s - sum(step_times))}")
        print(f"where the time goes: {'; '.join(parts)}")
    sys.stdout.flush()

    # Decode-only steps at batch 1 and at the largest batch.
    parts = []
    for batch in args.decode_batches:
        times, step_costs = decode_steps(llm, cost, batch, args.decode_prompt_len,
                                         args.decode_output_len, args.seed + batch)
        if not times:
            parts.append(f"batch {batch} = no decode-only step")
            continue
        floor_ms = statistics.median(c.floor_s(flop_rate, bandwidth) for c in step_costs)
        step_s = statistics.median(times)
        achieved = statistics.median(c.flops for c in step_costs) / step_s
        parts.append(f"batch {batch} = {_ms(step_s)} (floor {_ms(floor_ms)}; "
                     f"{_si(achieved, 'FLOP/s')}, {_pct(achieved / flop_rate)} of the matmul ceiling)")
    print(f"decode step: {', '.join(parts)}  [median of decode-only steps, "
          f"{args.decode_prompt_len}-token prompts, {args.decode_output_len} outputs; "
          f"ceiling: the {_si(flop_rate, 'FLOP/s')} above, as `bench roofline` measures it]")
    if args.profile:
        profile_decode(llm, cost, max(args.decode_batches), args)
    del llm
    gc.collect()


def bench_prefix(args, model_path: Path, cost: ModelCost) -> None:
    workload = prefix_workload(args.num_requests, args.prefix_len, args.question_lens,
                               args.prefix_output_len, cost.vocab_size, args.seed)
    print()
    print(f"prefix workload: {args.num_requests} requests sharing a {args.prefix_len}-token system "
          f"prompt + {args.question_lens[0]}-{args.question_lens[1]}-token questions, "
          f"{args.prefix_output_len} output tokens each (seed {args.seed})")
    print(f"  {_fmt_int(workload.num_prompt_tokens)} prompt tokens")
    print(f"{'':24}{'prefill computed':>17}{'wall s':>10}{'total tok/s':>14}")
    results = {}
    for enabled in (False, True):
        llm = make_llm(model_path, args, enable_prefix_caching=enabled)
        if args.workload == "prefix" and not enabled:   # nothing warmed this process up yet
            microvllm_generate(llm, random_workload(2, (8, 8), (2, 2), cost.vocab_size, args.seed))
        result, outs = microvllm_generate(llm, workload)
        computed = workload.num_prompt_tokens - sum(o.num_cached_tokens for o in outs)
        results[enabled] = (result, computed)
        name = f"prefix caching {'on' if enabled else 'off'}"
        print(f"{name:24}{_fmt_int(computed):>17}{result.wall_s:>10.2f}{result.total_rate:>14.1f}")
        del llm
        gc.collect()
    (off, off_computed), (on, on_computed) = results[False], results[True]
    same = _identical(off.outputs, on.outputs)
    print(f"prefix caching on: {off_computed / max(on_computed, 1):.1f}x fewer prefill tokens, "
          f"{off.wall_s / on.wall_s:.1f}x faster; token ids identical to caching off: "
          f"{same}/{len(off.outputs)}")


# torch operators by the part of a decode step they belong to; the rest is "other":
# norms, RoPE, residual adds, views, sampling.
PROJECTION_OPS = {"mkldnn::_linear_pointwise", "aten::mm", "aten::addmm",
                  "microvllm::amx_linear", "microvllm::vec_linear"}  # C++ kernels: kernels.profiled ranges
ATTENTION_OPS = {"aten::index_select", "aten::index_copy_", "aten::scaled_dot_product_attention",
                 "microvllm::paged_attention_decode", "microvllm::paged_attention_prefill",
                 "microvllm::write_kv"}


def op_kind(name: str) -> str:
    if name in PROJECTION_OPS:
        return "projections"
    if name in ATTENTION_OPS or name.startswith("aten::_scaled_dot_product"):  # SDPA's kernels
        return "attention"
    return "other"


# The decode fast path runs every layer in one C call (one profiler range); its own
# clock (DecodeFastPath.seconds) splits that call by kernel.
FAST_PATH_RANGE = "microvllm::decode_fast_path"
FAST_PATH_KINDS = {"gemm": "projections", "attention": "attention", "write_kv": "attention"}


def where_the_time_goes(averages, num_steps: int, fast_path_seconds: dict | None = None) -> str:
    """One line from a torch.profiler table: self CPU time per step by kind of operator
    (the fast path's range split by ``fast_path_seconds``, its kernels' own times)."""
    totals = {"projections": 0.0, "attention": 0.0, "other": 0.0}
    for event in averages:
        ms = event.self_cpu_time_total / 1e3 / num_steps  # us -> ms
        if event.key == FAST_PATH_RANGE and fast_path_seconds:
            inside = sum(fast_path_seconds.values()) * 1e3 / num_steps
            for kernel, seconds in fast_path_seconds.items():
                totals[FAST_PATH_KINDS.get(kernel, "other")] += seconds * 1e3 / num_steps
            ms -= inside   # the call's own Python and setup
        totals[op_kind(event.key)] += ms
    whole = sum(totals.values()) or 1.0
    parts = [f"{kind} {ms:.1f} ms ({ms / whole:.0%})" for kind, ms in totals.items()]
    return f"per decode step (torch ops, self CPU time): {', '.join(parts)}"


def profile_decode(llm, cost: ModelCost, batch: int, args) -> None:
    """Where a decode step's time goes: torch ops, then the Python functions."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    from microvllm import SamplingParams

    num_steps = 8
    print(f"\nprofile: {num_steps} decode-only steps at batch {batch} (torch.profiler, then cProfile)")
    for profiler_kind in ("torch", "python"):
        workload = random_workload(batch, (args.decode_prompt_len,) * 2, (1, 1), cost.vocab_size,
                                   args.seed + 7)
        params = SamplingParams(temperature=0.0, max_tokens=num_steps + 4, ignore_eos=True)
        waiting = set()
        for i, prompt in enumerate(workload.prompts):
            waiting.add(f"profile-{profiler_kind}-{i}")
            llm.engine.add_request(f"profile-{profiler_kind}-{i}", {"prompt_token_ids": prompt}, params)
        while waiting:                       # prefill until every request has its first token
            waiting -= {o.request_id for o in llm.engine.step() if o.outputs[0].token_ids}
        llm.engine.step()                    # one decode step, unprofiled
        if profiler_kind == "torch":
            fast = llm.engine.executor.worker.model_runner.decode_step_runner
            if fast is not None:
                fast.seconds = {}   # its kernels' times, from inside its one C call
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(num_steps):
                    llm.engine.step()
            averages = prof.key_averages()
            print(averages.table(sort_by="self_cpu_time_total", row_limit=12,
                                 max_name_column_width=40))
            if fast is not None:
                print(f"inside {FAST_PATH_RANGE}, per step: " + ", ".join(
                    f"{kernel} {seconds * 1e3 / num_steps:.1f} ms" for kernel, seconds in fast.seconds.items()))
            print(where_the_time_goes(averages, num_steps, fast.seconds if fast is not None else None))
            if fast is not None:
                fast.seconds = None
        else:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(num_steps):
                llm.engine.step()
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(r"microvllm", 18)
            print("\n".join(line for line in text.getvalue().splitlines()
                            if line.strip() and not line.startswith(("   Ordered", "   List"))))
        while llm.engine.has_unfinished_requests():
            llm.engine.step()


def report_vllm_style(result: RunResult, workload, output_json: str | None) -> None:
    """vLLM's ``bench throughput`` summary line (and ``--output-json``) for microvllm's run:
    requests/s, all tokens (prompt + output) per second, output tokens per second."""
    num_requests = len(workload.prompts)
    total_tokens = workload.num_prompt_tokens + result.useful_tokens
    print(f"Throughput: {num_requests / result.wall_s:.2f} requests/s, "
          f"{total_tokens / result.wall_s:.2f} total tokens/s, "
          f"{result.useful_tokens / result.wall_s:.2f} output tokens/s")
    if output_json:
        Path(output_json).write_text(json.dumps({
            "elapsed_time": result.wall_s, "num_requests": num_requests,
            "total_num_tokens": total_tokens, "requests_per_second": num_requests / result.wall_s,
            "tokens_per_second": total_tokens / result.wall_s}, indent=4) + "\n")


# --------------------------------------------------------------------- main
def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    low, high = int(low), int(high or low)
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MIN-MAX with 1 <= MIN <= MAX")
    return low, high


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= 1")
    return int(text)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


QUICK = dict(repeat=1, num_requests=4, prompt_lens=(16, 48), output_lens=(8, 16), prefix_len=64,
             question_lens=(8, 16), prefix_output_len=4, decode_batches=[1, 4],
             decode_prompt_len=16, decode_output_len=8, matmul_size=1024, copy_mib=64)
FULL = dict(repeat=3, num_requests=32, prompt_lens=(32, 256), output_lens=(32, 128), prefix_len=512,
            question_lens=(16, 64), prefix_output_len=16, decode_batches=[1, 32],
            decode_prompt_len=32, decode_output_len=64, matmul_size=2048, copy_mib=256)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="microvllm bench throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="a Hugging Face model folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--workload", default=None,
                        choices=["random", "prefix", "all", "spec", "quantization", "moe"],
                        help="all (random + prefix); spec: with and without --speculative-config "
                             "(the default when it is given); quantization: the embedded model as f32 / "
                             "int8 / Q4_1 side by side (bench/quantized.py); moe: a random mixture of experts, "
                             "its expert loops and the engine with each (bench/moe.py, its own options)")
    parser.add_argument("--speculative-config", type=json.loads, default=None, metavar="JSON",
                        help='e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\': compare decoding '
                             "with and without it (bench/spec_decode.py)")
    parser.add_argument("--spec-batches", type=_int_list, default=[1, 8], metavar="B1,B2",
                        help="batch sizes of the speculative comparison (1,8)")
    parser.add_argument("--spec-output-len", type=_positive, default=128, metavar="N",
                        help="most tokens per request in the speculative comparison (128)")
    parser.add_argument("--quick", action="store_true",
                        help="a small version for CI: 4 short requests, no HF one-at-a-time")
    parser.add_argument("--num-requests", "--num-prompts", dest="num_requests", type=int,
                        help="requests per workload (32; quick: 4); --num-prompts is vLLM's name")
    parser.add_argument("--input-len", type=_positive, metavar="N",
                        help="vLLM's flag: every prompt N tokens (same as --prompt-lens N-N)")
    parser.add_argument("--output-len", type=_positive, metavar="N",
                        help="vLLM's flag: every output N tokens (same as --output-lens N-N)")
    parser.add_argument("--output-json", metavar="PATH",
                        help="also write microvllm's throughput as JSON (vLLM's fields)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true", help="do not run Hugging Face at all")
    parser.add_argument("--skip-hf-one-at-a-time", action="store_true",
                        help="skip the (slow) HF one-request-at-a-time run (implied by --quick)")
    parser.add_argument("--prompt-lens", type=_range, metavar="MIN-MAX", help="32-256")
    parser.add_argument("--output-lens", type=_range, metavar="MIN-MAX", help="32-128")
    parser.add_argument("--prefix-len", type=int, help="shared system prompt tokens (512)")
    parser.add_argument("--question-lens", type=_range, metavar="MIN-MAX", help="16-64")
    parser.add_argument("--prefix-output-len", type=int, help="output tokens per prefix request (16)")
    parser.add_argument("--decode-batches", type=_int_list, metavar="B1,B2", help="1,32")
    parser.add_argument("--decode-prompt-len", type=int, help="32")
    parser.add_argument("--decode-output-len", type=int, help="64")
    parser.add_argument("--matmul-size", type=int,
                        help="n of the n^3 matmul that sets the FLOP rate (2048)")
    parser.add_argument("--copy-mib", type=int, help="MiB of the copy that sets the bandwidth (256)")
    parser.add_argument("--attention-backend", default=None, help="default: the engine's default")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run the plain torch code the notebooks show (no C++ kernels, no fast path)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's own, one per core); on a machine "
                             "shared with other busy processes, fewer threads than cores avoids "
                             "threads waiting on each other at every op")
    parser.add_argument("--repeat", type=int,
                        help="time HF's static batch and microvllm this many times, in turn, and "
                             "report the pair of median ratio (3; quick: 1)")
    parser.add_argument("--tensor-parallel-size", type=_positive, default=1, metavar="N",
                        help="run microvllm's model over N worker processes (tensor parallelism; "
                             "each uses cpu_count / N threads)")
    parser.add_argument("--profile", action="store_true",
                        help="profile decode steps at the largest decode batch (torch ops, Python)")
    args = parser.parse_args(argv)
    if args.workload is None:
        args.workload = "spec" if args.speculative_config is not None else "all"
    if args.workload == "spec" and args.speculative_config is None:
        parser.error("--workload spec compares with and without --speculative-config: give one")
    if args.input_len is not None:
        args.prompt_lens = args.prompt_lens or (args.input_len, args.input_len)
    if args.output_len is not None:
        args.output_lens = args.output_lens or (args.output_len, args.output_len)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.quick:
        args.skip_hf_one_at_a_time = True
    if args.num_requests < 1:
        parser.error("--num-requests must be at least 1")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.profile and args.tensor_parallel_size > 1:
        parser.error("--profile profiles this process, but with --tensor-parallel-size > 1 the model "
                     "runs in worker processes: profile with --tensor-parallel-size 1")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args) -> int:
    from transformers.utils import logging as hf_logging

    if args.workload == "quantization":   # bench/quantized.py, which uses this module's parts
        raise ValueError("--workload quantization runs as `microvllm bench throughput --workload quantization` "
                         "(or python -m microvllm.bench.quantized)")
    if args.workload == "moe":   # bench/moe.py, which uses this module's parts, with options of its own
        raise ValueError("--workload moe runs as `microvllm bench throughput --workload moe` "
                         "(or python -m microvllm.bench.moe)")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if args.model is None:
        from microvllm.models.default_model import default_model_path
        model_path = default_model_path()
    else:
        model_path = Path(args.model).expanduser()
    dtype = getattr(torch, args.dtype)
    if args.workload == "spec":
        from microvllm.bench.spec_decode import bench_speculative

        print(f"microvllm bench throughput: {model_path.name}, {args.dtype}, torch {torch.__version__} "
              f"on {torch.get_num_threads()} threads; cpu: {cpu_description()}")
        bench_speculative(args, model_path)
        return 0
    cost = ModelCost.from_folder(model_path, dtype)

    flop_rate = matmul_rate(dtype, n=args.matmul_size)
    bandwidth = copy_bandwidth(args.copy_mib << 20)
    print(f"microvllm bench throughput: {model_path.name} ({_params(cost.num_params)} params), "
          f"{args.dtype}, torch {torch.__version__} on {torch.get_num_threads()} threads")
    print(f"cpu: {cpu_description()}")
    print(f"machine: {args.matmul_size}^3 matmul {_si(flop_rate, 'FLOP/s')} ({args.dtype}), "
          f"{args.copy_mib} MiB copy {_si(bandwidth, 'B/s')} (read + write; best of 5 each)")
    print()
    if args.workload in ("random", "all"):
        bench_random(args, model_path, cost, dtype, flop_rate, bandwidth)
    if args.workload in ("prefix", "all"):
        bench_prefix(args, model_path, cost)
    return 0


if __name__ == "__main__":
    sys.exit(main())
