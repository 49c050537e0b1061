"""``bench throughput --workload quantization``: the same model stored three ways, side by side.

    f32     the embedded model's float32 expansion (what ``LLM()`` runs)
    int8    that folder with ``quantization="int8"`` (int8 weights, a scale per row)
    Q4_1    the GGUF file itself, ``LLM(model="<file>.gguf")`` (Q4_1 layers, a Q8_0 embedding)
    HF      transformers ``from_pretrained`` + tokenizer on the float folder (start and memory only)
    llama.cpp  the same GGUF file through ``llama_cpp``'s C API (only when it is importable):
               B sequences decoded together, one token each per ``llama_decode``

Each measurement runs in a fresh Python process, so that its start time and the resident
memory it adds are its own: the memory ``LLM()`` adds to a process that has already
imported torch and transformers (``/proc/self/status`` VmRSS before and after), its start
time (``LLM()`` returning, weights loaded and kernels built: a warm start), and decode-only
steps at batch 1 and at batch 32 timed by hand (the median step). The formats take turns,
``--repeat`` rounds (3), and each figure is the median over rounds: a shared machine's speed
drifts over minutes, so only runs made side by side compare.

Budget (issue 33): the memory ``LLM()`` adds should be at most (weights as stored + KV
cache) x 1.25; the table says whether each run is.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BATCHES = (1, 32)


def rss_bytes() -> int:
    """This process's resident memory (Linux; 0 elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def measure_microvllm(model: str, quantization: str | None, float_folder: str, threads: int,
                      prompt_len: int, output_len: int, seed: int) -> dict:
    """In this (fresh) process: start, memory, decode steps of one format."""
    import torch
    import transformers  # noqa: F401  (part of the runtime both sides load)

    from microvllm import LLM
    from microvllm.bench.roofline import ModelCost
    from microvllm.bench.throughput import decode_steps

    torch.set_num_threads(threads)
    before = rss_bytes()
    start = time.perf_counter()
    llm = LLM(model=model, quantization=quantization)
    start_s = time.perf_counter() - start
    added = rss_bytes() - before
    worker = llm.engine.executor.worker
    weights = sum(t.numel() * t.element_size() for t in [*worker.model.parameters(), *worker.model.buffers()])
    kv_cache = sum(c.numel() * c.element_size() for c in worker.kv_caches)
    cost = ModelCost.from_folder(float_folder, torch.float32)
    steps = {}
    for batch in BATCHES:
        times, _ = decode_steps(llm, cost, batch, prompt_len, output_len, seed + batch)
        steps[batch] = statistics.median(times) if times else float("nan")
    return {"start_s": start_s, "rss_added": added, "weights": weights, "kv_cache": kv_cache,
            "step_s": steps, "rss_peak_added": _peak_rss() - before}


def _peak_rss() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def measure_hf(float_folder: str, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    before = rss_bytes()
    start = time.perf_counter()
    AutoModelForCausalLM.from_pretrained(float_folder, dtype=torch.float32)
    AutoTokenizer.from_pretrained(float_folder)
    return {"start_s": time.perf_counter() - start, "rss_added": rss_bytes() - before}


def measure_llama_cpp(gguf_file: str, threads: int, prompt_len: int, output_len: int) -> dict:
    """llama.cpp on the GGUF file: start, memory, and the median decode step at each of
    ``BATCHES``, through its C API (``llama_decode`` on a ``llama_batch``; the Python
    ``Llama`` class serves one sequence): B prompts prefilled as B sequences in one call,
    then steps of one token per sequence, as microvllm's decode-only steps are."""
    import importlib.util
    import types

    if importlib.util.find_spec("diskcache") is None:
        # llama_cpp imports diskcache for its optional on-disk prompt cache, unused here
        sys.modules["diskcache"] = types.ModuleType("diskcache")
    import llama_cpp as C

    C.llama_backend_init()
    before = rss_bytes()
    start = time.perf_counter()
    model = C.llama_model_load_from_file(gguf_file.encode(), C.llama_model_default_params())
    start_s = time.perf_counter() - start
    steps = {}
    for batch_size in BATCHES:
        params = C.llama_context_default_params()
        params.n_ctx = batch_size * (prompt_len + output_len) + 256
        params.n_batch = params.n_ubatch = batch_size * prompt_len
        params.n_seq_max, params.kv_unified = batch_size, False   # a KV stream per sequence
        params.n_threads = params.n_threads_batch = threads
        ctx = C.llama_init_from_model(model, params)
        batch = C.llama_batch_init(batch_size * prompt_len, 0, 1)

        def decode(entries: list[tuple[int, int, int, bool]]) -> None:   # (token, position, sequence, logits?)
            batch.n_tokens = len(entries)
            for i, (token, position, sequence, logits) in enumerate(entries):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
                batch.seq_id[i][0], batch.logits[i] = sequence, logits
            if C.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")

        decode([(100 + (7 * s + p) % 1000, p, s, p == prompt_len - 1)
                for s in range(batch_size) for p in range(prompt_len)])
        times = []
        for step in range(output_len):   # the token ids do not change the time of a step
            begin = time.perf_counter()
            decode([(200 + (s + step) % 1000, prompt_len + step, s, True) for s in range(batch_size)])
            times.append(time.perf_counter() - begin)
        steps[batch_size] = statistics.median(times)
        C.llama_batch_free(batch)
        C.llama_free(ctx)
    rss_added = rss_bytes() - before
    C.llama_model_free(model)
    return {"start_s": start_s, "rss_added": rss_added, "step_s": steps}


def _child(kind: str, spec: dict) -> dict:
    """Run one measurement in a fresh interpreter; its result comes back as JSON."""
    code = (f"import json, sys; from microvllm.bench import quantized as q; "
            f"print('RESULT ' + json.dumps(q.{kind}(**json.loads(sys.argv[1]))))")
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"])}
    done = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True,
                          env=env)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            if "step_s" in result:
                result["step_s"] = {int(k): v for k, v in result["step_s"].items()}
            return result
    raise RuntimeError(f"{kind} failed (exit status {done.returncode}):\n{done.stderr[-3000:]}")


def _median(runs: list[dict], *keys):
    values = [run for run in runs]
    for key in keys:
        values = [v[key] for v in values]
    return statistics.median(values)


def bench_quantization(args) -> None:
    from microvllm.models.default_model import default_model_path, find_gguf

    if args.model is not None:
        print("--workload quantization compares the embedded model's three forms; drop --model")
        return
    float_folder, gguf_file = str(default_model_path()), str(find_gguf())
    threads = args.threads or os.cpu_count() or 1
    prompt_len, output_len = args.decode_prompt_len, args.decode_output_len
    formats = {"f32": (float_folder, None), "int8": (float_folder, "int8"), "Q4_1 GGUF": (gguf_file, None)}
    try:
        import importlib.util
        has_llama_cpp = importlib.util.find_spec("llama_cpp") is not None
    except ValueError:
        has_llama_cpp = False
    runs: dict[str, list[dict]] = {name: [] for name in [*formats, "HF", *(["llama.cpp"] if has_llama_cpp else [])]}
    print(f"quantization: the embedded model as f32 / int8 / Q4_1, {args.repeat} rounds in turn, each run a "
          f"fresh process on {threads} threads; decode-only steps after {prompt_len}-token prompts, "
          f"{output_len} outputs (median step)")
    for _ in range(args.repeat):
        for name, (model, quantization) in formats.items():
            runs[name].append(_child("measure_microvllm", dict(
                model=model, quantization=quantization, float_folder=float_folder, threads=threads,
                prompt_len=prompt_len, output_len=output_len, seed=args.seed)))
        runs["HF"].append(_child("measure_hf", dict(float_folder=float_folder, threads=threads)))
        if has_llama_cpp:
            try:
                runs["llama.cpp"].append(_child("measure_llama_cpp", dict(
                    gguf_file=gguf_file, threads=threads, prompt_len=prompt_len, output_len=output_len)))
            except RuntimeError as error:   # a crash of the library itself is reported, not fatal
                print(f"llama.cpp: no result ({str(error).strip().splitlines()[-1][:200]})")
                has_llama_cpp = False
    print(f"{'':11}{'weights':>9}{'start s':>9}{'RSS added':>11}{'peak':>9}{'budget':>9}"
          + "".join(f"{f'batch {b} tok/s':>15}{'x f32':>7}" for b in BATCHES))
    base = {b: _median(runs["f32"], "step_s", b) for b in BATCHES}
    for name, results in runs.items():
        if not results:
            continue
        row = f"{name:11}"
        weights = results[0].get("weights")
        row += f"{weights / 2**20:>7.0f}MB" if weights else f"{'':>9}"
        row += f"{_median(results, 'start_s'):>9.2f}{_median(results, 'rss_added') / 2**20:>9.0f}MB"
        peak = _median(results, "rss_peak_added") if "rss_peak_added" in results[0] else None
        row += f"{peak / 2**20:>7.0f}MB" if peak is not None else f"{'':>9}"
        if weights:
            budget = (weights + results[0]["kv_cache"]) * 1.25
            row += f"{'within' if max(_median(results, 'rss_added'), peak or 0) <= budget else 'OVER':>9}"
        else:
            row += f"{'':>9}"
        for batch in BATCHES:
            if "step_s" in results[0] and batch in results[0]["step_s"]:
                step = _median(results, "step_s", batch)
                row += f"{batch / step:>15.1f}{base[batch] / step:>6.2f}x"
            else:
                row += f"{'-':>15}{'':>7}"
        print(row)
    print("(tok/s of a decode-only step = batch / its median seconds; start = LLM() (HF: model + "
          "tokenizer), warm; RSS added over a process with torch and transformers imported, when LLM() "
          "returns and at its peak after the decode runs (the KV cache's pages become resident as "
          "blocks are first written); budget = (weights + KV cache) x 1.25, for both; llama.cpp: its C API, "
          "B sequences per llama_decode, start = the model "
          "file loaded, RSS after both batch sizes ran)")
    report_quality(formats)


# A quantized format passes when its perplexity on quality.PARAGRAPHS is within this
# fraction of float32's (Q4_1 native computes with float32's own values: it should be equal).
PERPLEXITY_BOUND = 0.05


def report_quality(formats: dict) -> None:
    """Greedy agreement with f32 on 32 fixed prompts (logit margins where they part) and
    perplexity on fixed paragraphs, each format against the first (f32); in this process."""
    from microvllm import LLM
    from microvllm.bench.quality import PARAGRAPHS, PROMPTS, describe, greedy_agreement, perplexity

    print(f"\nquality against f32: greedy outputs of {len(PROMPTS)} fixed prompts (32 tokens) and perplexity "
          f"of {len(PARAGRAPHS)} fixed paragraphs (bound: within {PERPLEXITY_BOUND:.0%} of f32)")
    engines = {name: LLM(model=model, quantization=quantization, kv_cache_memory_bytes=128 << 20)
               for name, (model, quantization) in formats.items()}
    reference_name, reference = next(iter(engines.items()))
    base = perplexity(reference)
    print(f"{reference_name}: perplexity {base:.3f}")
    for name, llm in list(engines.items())[1:]:
        same, divergences = greedy_agreement(reference, llm)
        ppl = perplexity(llm)
        verdict = "within" if abs(ppl - base) <= PERPLEXITY_BOUND * base else "OUTSIDE"
        print(f"{name}: perplexity {ppl:.3f} ({ppl / base - 1:+.1%}, {verdict} the bound); "
              + describe(name, same, divergences, len(PROMPTS)).split(": ", 1)[1])


def main(argv: list[str] | None = None) -> int:
    """``bench throughput --workload quantization`` (the CLI routes it here): the options of
    ``bench throughput`` that apply (--threads, --repeat, --decode-prompt-len, ...)."""
    from microvllm.bench.throughput import parse_args

    argv = sys.argv[1:] if argv is None else list(argv)
    if "--workload" not in argv:
        argv += ["--workload", "quantization"]
    bench_quantization(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
