"""Run the real engine on a learner's components and compare it with the reference engine.

    run_engine_with({"block_pool": BlockPool}, num_kv_blocks=10)

builds (once per process) a tiny random Llama with its tiny tokenizer, generates greedy
tokens for a few prompts with the engine's own components (the reference) and with
yours, and prints one line per prompt. Greedy decoding on float32 is deterministic, so
the two must agree token for token; the tests check that the reference agrees with
Hugging Face ``generate`` too.
"""

from __future__ import annotations

import contextlib
import functools
import io
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from microvllm.checks.report import explain_exception, not_implemented_message

# Prompts that share a prefix (prefix-cache hits), of mixed lengths (chunking), one with
# characters the tiny tokenizer splits into byte tokens (detokenization).
PROMPTS = [
    "The scheduler decides which requests run in each step; the model runner",
    "The scheduler decides which requests run in each step, and the sampler",
    "Héllo wörld 🙂, the capital of France is",
    {"prompt_token_ids": [5, 17, 42, 99, 3, 250, 11, 7, 64, 128, 33, 2, 90, 45, 6, 301, 12, 8, 77]},
]


@functools.cache
def tiny_model_folder(arch: str = "llama") -> Path:
    """A tiny random model folder (weights + tokenizer), written once per process, quietly."""
    from microvllm.models.tiny import make_tiny_model

    folder = Path(tempfile.mkdtemp(prefix=f"microvllm-tiny-{arch}-")) / arch
    with _quiet():
        make_tiny_model(folder, arch, seed=7)
    return folder


@contextlib.contextmanager
def _quiet():
    """Hide progress bars and warnings (a notebook's stored output must not change)."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    root_level = logging.getLogger("microvllm").level
    logging.getLogger("microvllm").setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        hf_logging.enable_progress_bar()
        logging.getLogger("microvllm").setLevel(root_level)


@dataclass
class EngineRunResult:
    same: bool
    reference: list[list[int]] = field(default_factory=list)
    yours: list[list[int]] = field(default_factory=list)
    message: str = ""

    def _ipython_display_(self) -> None:
        """Already printed."""


def generate(components=None, *, prompts=None, max_tokens: int = 12, arch: str = "llama", **settings):
    """Greedy outputs of the engine on the tiny model: (outputs, llm)."""
    from microvllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # float32 on a GPU too (dtype="auto" would be bfloat16 there): yours and the reference
    # may use different kernels, and only float32 keeps their greedy tokens comparable.
    settings.setdefault("dtype", "float32")
    with _quiet():
        llm = LLM(str(tiny_model_folder(arch)), components=components, **settings)
        outputs = llm.generate(list(prompts or PROMPTS), params, use_tqdm=False)
    return outputs, llm


def run_engine_with(components: dict | None = None, *, label: str | None = None, prompts=None,
                    max_tokens: int = 12, compare_text: bool = False, quiet: bool = False,
                    **settings) -> EngineRunResult:
    """Generate with your ``components`` (and ``settings`` such as ``num_kv_blocks=10`` or
    ``attention_backend="my-decode"``), compare with the reference engine, print the verdict."""
    settings.setdefault("max_model_len", 128)
    label = label or ", ".join(f"your {cls.__name__}" for cls in (components or {}).values()) or "your code"
    lines = []
    say = lines.append
    try:
        yours, llm = generate(components, prompts=prompts, max_tokens=max_tokens, debug_invariants=True,
                              trace=True, **settings)
    except Exception as exc:  # noqa: BLE001 - a learner's bug becomes a report, not a traceback wall
        todo = not_implemented_message(exc)
        if todo is not None:
            message = f"not implemented yet: {todo}\nFinish the exercise above, then run this cell again."
        else:
            message = "✗ the engine stopped with " + label + ":\n" + "\n".join(
                "    " + line for line in explain_exception(exc))
        result = EngineRunResult(False, message=message)
        if not quiet:
            print(message)
        return result

    reference_settings = {k: v for k, v in settings.items() if k != "attention_backend"}
    reference, _ = generate(None, prompts=prompts, max_tokens=max_tokens, **reference_settings)
    shown = ", ".join(f"{k}={v}" for k, v in settings.items() if k != "max_model_len")
    say(f"The engine with {label} on a tiny random Llama: {len(reference)} prompts x {max_tokens} greedy tokens"
        + (f"\n({shown})" if shown else ""))
    same = True
    for index, (ref, out) in enumerate(zip(reference, yours)):
        ref_ids, ids = list(ref.outputs[0].token_ids), list(out.outputs[0].token_ids)
        ok = ref_ids == ids and (not compare_text or ref.outputs[0].text == out.outputs[0].text)
        same &= ok
        tokens = ", ".join(map(str, ids[:8])) + (", ..." if len(ids) > 8 else "")
        say(f"  prompt {index}: {'✓' if ok else '✗'} [{tokens}]")
        if ref_ids != ids:
            say(f"      reference: {ref_ids}\n      yours:     {ids}")
        elif compare_text and ref.outputs[0].text != out.outputs[0].text:
            say(f"      reference text: {ref.outputs[0].text!r}\n      your text:      {out.outputs[0].text!r}")
    trace = llm.trace
    notes = []
    if trace is not None:
        if trace.preemption_steps():
            count = len(trace.preemption_steps())
            notes.append(f"preemptions in {count} step{'s' if count > 1 else ''}")
        hits = sum(s.prefix_hit_tokens for step in trace for s in step.scheduled if s.prefix_hit_tokens)
        if hits:
            notes.append(f"{hits} prompt tokens were prefix-cache hits")
        notes.append(f"{len(trace)} engine steps")
    say("  (" + "; ".join(notes) + ")")
    if same:
        say("✓ Same " + ("tokens and text" if compare_text else "greedy tokens")
            + " as the reference engine for every prompt: your code runs the real engine.")
    else:
        say("✗ Your code changed what the engine generates: compare the lines above, then rerun the checker.")
    message = "\n".join(lines)
    if not quiet:
        print(message)
    return EngineRunResult(same, [list(o.outputs[0].token_ids) for o in reference],
                           [list(o.outputs[0].token_ids) for o in yours], message)
