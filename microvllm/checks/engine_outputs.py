"""What ``run_engine_with`` compares beyond each prompt's tokens: the text a request had shown
after every step (a detokenizer that stalls or runs ahead ends with the same text), and every
sample of an ``n > 1`` prompt (many seeded draws from one distribution: a sampling filter that
is skipped, or one token too wide, changes some of them)."""

from __future__ import annotations

from microvllm.checks.engine_workloads import params_text


def compare_streams(reference: dict, yours: dict, ids: list[str], say) -> bool:
    """The text each request had shown after every step: a stalled or early stream differs."""
    for rid in ids:
        for (step, ref_text), (_, your_text) in zip(reference.get(rid, []), yours.get(rid, [])):
            if ref_text != your_text:
                say(f"  ✗ prompt {rid}, step {step}: the same final text, but not streamed at the same time:\n"
                    f"      reference had shown {ref_text!r}\n      yours had shown     {your_text!r}\n"
                    "    hint: emit text as soon as its characters are complete; hold back only a '\\ufffd' at "
                    "the END of the window (one in the middle is an invalid byte no token will complete)")
                return False
    return True


def compare_samples(rid: str, params: dict, reference: list[list[int]], yours: list[list[int]], say) -> bool:
    wrong = [i for i, (r, y) in enumerate(zip(reference, yours)) if r != y]
    wrong += list(range(min(len(reference), len(yours)), max(len(reference), len(yours))))
    count = len(reference)
    if not wrong:
        say(f"  prompt {rid} ({params_text(params)}): ✓ all {count} samples, {sum(map(len, reference))} tokens")
        return True
    i = wrong[0]
    say(f"  prompt {rid} ({params_text(params)}): ✗ {len(wrong)} of {count} samples differ; the first, sample {i}:")
    say(f"      reference: {reference[i] if i < len(reference) else None}\n"
        f"      yours:     {yours[i] if i < len(yours) else None}")
    return False
