"""Run the real engine on a learner's components and compare it with the reference engine.

    run_engine_with({"scheduler": Scheduler})

builds (once per process) a tiny random Llama with its tiny tokenizer, picks a workload
that exercises the components it is given, runs it twice — with your components and
with the engine's own (the reference), same settings, same seeds — and prints what differs:

    component              workload                                  compared
    scheduler              6 prompts; 3 seats, 16 tokens a step, 6   every step's plan (requests, tokens,
                           usable blocks: chunks, queueing,          preemptions, prefix hits) and the limits
                           preemption, prefix hits
    block_pool             5 prompts sharing prefixes in a pool of   every step's plan, block tables, free and
                           5 blocks: hits, revived and evicted       cached blocks; the pool after every call
                           blocks, preemption
    kv_cache_manager,      7 prompts in blocks of 8: shared          every step's plan, block tables, free and
    hash_block_tokens=     prefixes, a block whose tokens recur      cached blocks
                           after another parent, a salted repeat,
                           a resumed request's hit on its output
    sampler                greedy rows and seeded random rows with   the tokens (a seeded request draws the
                           temperature, top-k, top-p, min-p          same tokens from the same logits)
    model_runner,          6 of those prompts, budget 8, 7 blocks    the tokens
    block_table            of 8: mixed steps, requests preempted
                           and resumed (prompt + outputs again)
    token_trie             5 prompts, each under a regex (the        the tokens, and each text matches its
                           course backend), greedy and seeded        regex (or can still, if cut by max_tokens)
    rejection_sampler      6 self-repeating prompts, n-gram drafts,  the tokens, and at every step the drafts
                           greedy and seeded                         kept and the token after them
    anything else          4 prompts, greedy                         the tokens (and the text: detokenizer)

Every run also checks the engine's invariants after each step (``check_invariants``).
Float32 on one machine is deterministic, so a correct component gives exactly the
reference's tokens and decisions; the tests check that the reference agrees with
Hugging Face ``generate`` too.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from microvllm.checks.engine_outputs import compare_samples, compare_streams
from microvllm.checks.engine_spec import SPEC_HINTS, first_spec_difference
from microvllm.checks.engine_steps import (
    HINT_HITS,
    HINT_HITS_MANAGER,
    HINT_HITS_POOL,
    first_difference,
    watch_scheduler,
)
from microvllm.checks.engine_workloads import (
    GREEDY,
    GREEDY_RUN,
    PREFIX_HASH_RUN,
    WORKLOADS,
    Workload,
    params_text,
    sampling_hint,
)
from microvllm.checks.pool_watch import POOL_HINTS, watch_block_pool
from microvllm.checks.report import CheckFailure, explain_exception, not_implemented_message, round_floats


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


@dataclass
class _Run:
    outputs: dict = field(default_factory=dict)   # request id -> final RequestOutput
    trace: object = None
    error: BaseException | None = None
    where: str = ""                                # "at step 3", "while building the engine", ...
    streamed: dict = field(default_factory=dict)   # request id -> [(step, text shown so far), ...]

    def tokens(self, rid: str) -> list[int]:
        out = self.outputs.get(rid)
        return list(out.outputs[0].token_ids) if out is not None else []

    def samples(self, rid: str) -> list[list[int]]:
        """Every completion's tokens (``n > 1``: each sample has its own seed)."""
        out = self.outputs.get(rid)
        return [list(c.token_ids) for c in sorted(out.outputs, key=lambda c: c.index)] if out is not None else []

    def text(self, rid: str) -> str:
        out = self.outputs.get(rid)
        return out.outputs[0].text if out is not None else ""


def _drive(components, workload: Workload, settings: dict, max_tokens: int, arch: str, *,
           check: bool, max_steps: int | None = None) -> _Run:
    """Run ``workload`` step by step (no ``LLM.generate``: a failure must not be followed by
    an abort that fails again and hides it), checking the invariants after each step."""
    from microvllm import LLM, SamplingParams

    run = _Run(where="while building the engine")
    settings = {"dtype": "float32", **settings}  # float32 on a GPU too: only it keeps tokens comparable
    try:
        with _quiet():
            llm = LLM(str(tiny_model_folder(arch)), components=components, trace=True, **settings)
            engine = llm.engine
            run.trace = engine.trace
            for index, (prompt, params) in enumerate(zip(workload.prompts, workload.params)):
                run.where = f"while adding prompt {index}"
                engine.add_request(str(index), prompt,
                                   SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params))
            while engine.has_unfinished_requests():
                run.where = f"at step {engine.num_steps}"
                if max_steps is not None and engine.num_steps >= max_steps:
                    raise AssertionError(f"the requests are not done after {max_steps} steps (the reference "
                                         "needs far fewer): does every step schedule something?")
                step = engine.num_steps
                for out in engine.step():
                    if out.outputs:
                        run.streamed.setdefault(out.request_id, []).append((step, out.outputs[0].text))
                    if out.finished:
                        run.outputs[out.request_id] = out
                if check:
                    run.where = f"after step {engine.num_steps - 1} (the engine's invariant checks)"
                    engine.check_invariants()
    except Exception as exc:  # noqa: BLE001 - a learner's bug becomes a report, not a traceback wall
        run.error = exc
    return run


_REFERENCE_RUNS: dict = {}


def _reference(workload: Workload, settings: dict, max_tokens: int, arch: str) -> _Run:
    key = repr((workload, sorted(settings.items()), max_tokens, arch))
    if key not in _REFERENCE_RUNS:
        run = _drive(None, workload, settings, max_tokens, arch, check=False)
        if run.error is not None:
            raise run.error
        _REFERENCE_RUNS[key] = run
    return _REFERENCE_RUNS[key]


def run_engine_with(components: dict | None = None, *, label: str | None = None, prompts=None,
                    max_tokens: int = 12, compare_text: bool = False, quiet: bool = False,
                    arch: str = "llama", hash_block_tokens=None, **settings) -> EngineRunResult:
    """Run your ``components`` (and ``settings`` such as ``num_kv_blocks=10`` or
    ``attention_backend="my-decode"``, which override the workload's) in the engine on a
    workload chosen for them, compare with the reference engine, print the verdict.
    ``hash_block_tokens``: your block hash, used for every request's block hashes in your run."""
    components = dict(components or {})
    label = label or ", ".join([f"your {cls.__name__}" for cls in components.values()]
                               + (["your hash_block_tokens"] if hash_block_tokens else [])) or "your code"
    workload = next((WORKLOADS[name] for name in components if name in WORKLOADS),
                    PREFIX_HASH_RUN if hash_block_tokens else GREEDY_RUN)
    if prompts is not None:
        prompts = tuple(prompts)
        workload = Workload(workload.name, prompts, (workload.params * len(prompts))[:len(prompts)],
                            workload.settings, workload.steps, workload.blocks)
    settings = {"max_model_len": 128, **dict(workload.settings), **settings}
    compare_text = compare_text or "detokenizer" in components
    who = "your scheduler" if "scheduler" in components else label
    hits_hint = (HINT_HITS_POOL if "block_pool" in components else
                 HINT_HITS_MANAGER if "kv_cache_manager" in components else HINT_HITS)
    if "block_pool" in components:
        components["block_pool"] = watch_block_pool(components["block_pool"])
    if "scheduler" in components:
        components["scheduler"] = watch_scheduler(components["scheduler"])

    if "attention_backend" in settings:   # a learner's kernel is checked before the engine launches it
        from microvllm.checks.attention import decode_kernel_preflight

        refusal = decode_kernel_preflight(settings["attention_backend"])
        if refusal is not None:
            if not quiet:
                print(refusal)
            return EngineRunResult(False, message=refusal)
    reference_settings = {k: v for k, v in settings.items() if k != "attention_backend"}
    reference = _reference(workload, reference_settings, max_tokens, arch)
    with _block_hash(hash_block_tokens):
        yours = _drive(components or None, workload, settings, max_tokens, arch, check=True,
                       max_steps=4 * len(reference.trace) + 20)
    if yours.error is not None:
        earlier = None
        if workload.steps and yours.trace is not None:  # a wrong decision may have led to the crash
            earlier = first_difference(reference.trace, yours.trace, who=who, blocks=workload.blocks,
                                       partial=True, hits_hint=hits_hint)
        return _crashed(yours, label, quiet, earlier, components)

    lines = []
    say = lines.append
    greedy = all(p.get("temperature", 1.0) == 0.0 for p in workload.params)
    shown = ", ".join(f"{k}={v}" for k, v in settings.items() if k != "max_model_len")
    say(f"The engine with {label} on a tiny random Llama: {len(workload.prompts)} prompts x {max_tokens} "
        + ("greedy tokens" if greedy else "tokens, greedy and seeded sampling") + (f"\n({shown})" if shown else ""))
    ids = [str(i) for i in range(len(workload.prompts))]
    same = True
    for rid, params in zip(ids, workload.params):
        if params.get("n", 1) > 1:   # many seeded draws from one distribution: every one must match
            same &= compare_samples(rid, params, reference.samples(rid), yours.samples(rid), say)
            continue
        ref_ids, got = reference.tokens(rid), yours.tokens(rid)
        ok = ref_ids == got and (not compare_text or reference.text(rid) == yours.text(rid))
        same &= ok
        tokens = ", ".join(map(str, got[:8])) + (", ..." if len(got) > 8 else "")
        shown_params = "" if greedy and params == GREEDY else f" ({params_text(params)})"
        if "structured_outputs" in params:   # the text says more than the ids
            tokens = repr(yours.text(rid))
            ok &= _matches_so_far(params["structured_outputs"].regex, yours, rid)
            same &= ok
        say(f"  prompt {rid}{shown_params}: {'✓' if ok else '✗'} [{tokens}]")
        if ref_ids != got:
            say(f"      reference: {ref_ids}\n      yours:     {got}")
        elif not ok:
            say(f"      reference text: {reference.text(rid)!r}\n      your text:      {yours.text(rid)!r}")
    if same and compare_text:   # the same final text: was it also shown at the same steps?
        same = compare_streams(reference.streamed, yours.streamed, ids, say)
    say("  (" + "; ".join(_notes(yours.trace)) + ")")
    if not same and "sampler" in components:
        wrong = [reference.samples(r) != yours.samples(r) for r in ids]
        say(f"    hint: {sampling_hint(workload.params, wrong)}")
    if not same and "model_runner" in components:
        from microvllm.checks.model_runner import runner_hint

        say(f"    hint: {runner_hint(reference.trace, [r for r in ids if reference.tokens(r) != yours.tokens(r)])}")
    difference = None
    if "speculative_config" in settings and settings["speculative_config"].get("method") == "ngram":
        prompt_ids = {r: list(out.prompt_token_ids) for r, out in reference.outputs.items()}
        greedy_ids = {r for r, p in zip(ids, workload.params) if p.get("temperature", 1.0) == 0.0}
        difference = first_spec_difference(reference, yours, settings["speculative_config"], prompt_ids, greedy_ids)
        if difference is None:
            say("  ✓ every step kept the reference's drafts and drew the same token after them")
        else:
            step_lines, hint = difference
            say("  ✗ " + step_lines[0])
            lines.extend("    " + line for line in step_lines[1:])
            say(f"    hint: {hint}")
    elif workload.steps:
        difference = first_difference(reference.trace, yours.trace, who=who, blocks=workload.blocks,
                                      hits_hint=hits_hint)
        if difference is None:
            checked = "the same requests, tokens, preemptions and prefix hits" + (
                ", block tables, free and cached blocks" if workload.blocks else "")
            say(f"  ✓ every step made the reference engine's decisions: {checked}")
        else:
            step_lines, hint = difference
            say("  ✗ " + step_lines[0])
            lines.extend("    " + line for line in step_lines[1:])
            if hint:
                say(f"    hint: {hint}")
    ok = same and difference is None
    if ok:
        say("✓ Same " + ("tokens and text" if compare_text else "greedy tokens" if greedy else "tokens")
            + " as the reference engine for every prompt" + (", and the same decisions at every step"
                                                              if workload.steps or "speculative_config" in settings
                                                              else "")
            + ": your code runs the real engine.")
    elif not same:
        say("✗ Your code changed what the engine generates: compare the lines above, then rerun the checker.")
    else:
        say("✗ Same tokens, but your code decided differently from the reference engine (see the step above).")
    message = "\n".join(lines)
    if not quiet:
        print(message)
    return EngineRunResult(ok, [reference.tokens(r) for r in ids], [yours.tokens(r) for r in ids], message)


def _matches_so_far(pattern: str, run: _Run, rid: str) -> bool:
    """A structured output that stopped matches its regex whole; one cut by max_tokens can
    still be completed (its DFA state is live)."""
    from microvllm.structured_output.regex_dfa import RegexDFA

    out = run.outputs.get(rid)
    if out is None:
        return False
    dfa = RegexDFA(pattern)
    state = dfa.walk(dfa.start, out.outputs[0].text)
    return dfa.is_accepting(state) if out.outputs[0].finish_reason == "stop" else state != dfa.DEAD


@contextlib.contextmanager
def _block_hash(hash_block_tokens):
    """Every request's block hashes made with ``hash_block_tokens`` (the one function
    ``hash_new_full_blocks`` calls), for the duration of one run."""
    from microvllm.core import kv_cache_utils

    engine_hash = kv_cache_utils.hash_block_tokens
    if hash_block_tokens is not None:
        kv_cache_utils.hash_block_tokens = hash_block_tokens
    try:
        yield
    finally:
        kv_cache_utils.hash_block_tokens = engine_hash


def _notes(trace) -> list[str]:
    notes = []
    if trace is not None:
        chunked = {r.request_id for step in trace for r in step.scheduled if r.kind == "prefill"
                   and r.num_computed_tokens_before + r.num_scheduled_tokens < r.num_prompt_tokens}
        if chunked:
            notes.append(f"{len(chunked)} prompt{'s' if len(chunked) > 1 else ''} prefilled in chunks")
        if trace.preemption_steps():
            count = len(trace.preemption_steps())
            notes.append(f"preemptions in {count} step{'s' if count > 1 else ''}")
        hits = sum(s.prefix_hit_tokens for step in trace for s in step.scheduled if s.prefix_hit_tokens)
        if hits:
            notes.append(f"{hits} prompt tokens were prefix-cache hits")
        notes.append(f"{len(trace)} engine steps")
    return notes


def _crashed(run: _Run, label: str, quiet: bool, earlier=None, components=()) -> EngineRunResult:
    exc = run.error
    todo = not_implemented_message(exc)
    if todo is not None:
        message = f"not implemented yet: {todo}\nFinish the exercise above, then run this cell again."
    else:
        lines = explain_exception(exc)
        if not (isinstance(exc, CheckFailure) and exc.hint):
            from microvllm.checks.scheduler import SCHEDULER_HINTS

            text = "\n".join(lines)
            known = POOL_HINTS + SCHEDULER_HINTS + SPEC_HINTS
            if "model_runner" in components:   # its hints first: a runner's crash is about the runner
                from microvllm.checks.model_runner import MODEL_RUNNER_HINTS

                known = MODEL_RUNNER_HINTS + known
            hint = next((h for pattern, h in known if re.search(pattern, text)), None)
            if hint:
                lines.append(f"hint:     {hint}")
        where = "" if lines[0].startswith("step ") else f" {run.where}"  # the message names its step
        message = (f"✗ the engine stopped with {label}{where}:\n"
                   + "\n".join("    " + round_floats(line) for line in lines))
        if earlier is not None:
            step_lines, hint = earlier
            first, *rest = step_lines
            message += "\n  the first difference from the reference: " + first
            message += "".join("\n    " + line for line in rest)
            if hint:
                message += f"\n    hint: {hint}"
    if not quiet:
        print(message)
    return EngineRunResult(False, message=message)
