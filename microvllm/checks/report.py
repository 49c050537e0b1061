"""What every checker shares: run cases against a learner's code, report in a learner's words.

A checker is a list of *cases*. Each case calls the learner's code and either returns
(✓) or raises:

    CheckFailure(what, input=, expected=, got=, hint=)   ✗ the code ran but did the wrong thing
    NotImplementedError (anywhere inside)                 · a part is not written yet
    InvariantError / AssertionError                       ✗ with the message, plus a hint
    any other exception                                   ✗ "your code raised ..." and where

    check_block_pool(BlockPool)            prints          returns
        case 1  ✓                          ✓ lines,        CheckResult (.passed,
        case 2  ✗ -> input/expected/got    ✗ explanations   .not_implemented, .cases)
        case 3  · not implemented yet      · one line per missing part

Property cases run a hypothesis test (``derandomize=True``: the same examples on every
run, so a notebook's stored output stays the same) and report the shrunk failing
example as the input.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

PASS, FAIL, TODO, SKIP = "pass", "fail", "todo", "skip"


class CheckFailure(AssertionError):
    """A case found wrong behaviour: what was checked, on which input, what was expected,
    what came back, and a hint on what to change."""

    def __init__(self, what: str, *, input: object = None, expected: object = None,
                 got: object = None, hint: str | None = None):
        super().__init__(what)
        self.what, self.input, self.expected, self.got, self.hint = what, input, expected, got, hint

    def explain(self) -> list[str]:
        lines = [self.what]
        for label, value in (("input", self.input), ("expected", self.expected), ("got", self.got)):
            if value is not None:
                lines.append(f"{label + ':':9} {shorten_steps(str(value))}")
        if self.hint:
            lines.append(f"hint:     {self.hint}")
        return lines


# A float printed with its float32 noise (0.3499999940395355) reads as 0.35.
_LONG_FLOAT = re.compile(r"(?<![\w.])-?\d+\.\d{5,}(?:e[-+]?\d+)?(?![\w.])")


def round_floats(text: str) -> str:
    """Every float in ``text`` with 5 or more decimals, to 4 significant digits."""
    return _LONG_FLOAT.sub(lambda m: f"{float(m.group()):.4g}", text)


def trim_lines(lines: list[str], head: int = 2, tail: int = 4) -> list[str]:
    """A long list of lines (a shrunk example, step by step): its first ``head`` and last
    ``tail`` lines, the rest counted: '... (N more)'."""
    if len(lines) <= head + tail + 1:
        return lines
    return lines[:head] + [f"... ({len(lines) - head - tail} more)"] + lines[len(lines) - tail:]


def shorten_steps(text: str, head: int = 2, tail: int = 6) -> str:
    """An input written as 'op; op; op; ...': keep the first and last operations."""
    parts = text.split("; ")
    if len(parts) <= head + tail + 1:
        return text
    return "; ".join(parts[:head] + [f"... ({len(parts) - head - tail} more)"] + parts[len(parts) - tail:])


def expect(condition: bool, what: str, **details) -> None:
    """Raise ``CheckFailure(what, **details)`` unless ``condition``."""
    if not condition:
        raise CheckFailure(what, **details)


def expect_equal(got, expected, what: str, *, input: object = None, hint: str | None = None) -> None:
    if got != expected:
        raise CheckFailure(what, input=input, expected=expected, got=got, hint=hint)


@dataclass
class Case:
    """One check: ``run()`` calls the learner's code and raises on a problem."""

    name: str
    run: Callable[[], None]


@dataclass
class CaseResult:
    name: str
    status: str                       # PASS, FAIL, TODO or SKIP
    lines: list[str] = field(default_factory=list)   # explanation (FAIL) or the missing part (TODO)

    @property
    def message(self) -> str:
        return "\n".join(self.lines)


@dataclass
class CheckResult:
    """The outcome of one checker. ``print(result)`` shows the report again."""

    component: str
    cases: list[CaseResult]

    @property
    def passed(self) -> bool:
        return any(c.status == PASS for c in self.cases) and all(c.status in (PASS, SKIP) for c in self.cases)

    @property
    def not_implemented(self) -> bool:
        return any(c.status == TODO for c in self.cases)

    @property
    def failures(self) -> list[CaseResult]:
        return [c for c in self.cases if c.status == FAIL]

    @property
    def message(self) -> str:
        """Every failure's explanation (what the tests match against)."""
        return "\n".join(c.name + "\n" + c.message for c in self.failures)

    def report(self) -> str:
        total = len(self.cases)
        num_passed = sum(c.status == PASS for c in self.cases)
        todos: dict[str, int] = {}
        for case in self.cases:
            if case.status == TODO:
                todos[case.message] = todos.get(case.message, 0) + 1
        lines = []
        if todos:
            lines.append(f"{self.component}: not implemented yet")
            for message, count in todos.items():
                lines.append(f"  · {message}  ({count} check{'s' if count > 1 else ''} wait for it)")
        else:
            lines.append(f"{self.component}: {total} checks")
        first_failure = next((c for c in self.cases if c.status == FAIL), None)
        for case in self.cases:
            if case.status == PASS and not todos:
                lines.append(f"  ✓ {case.name}")
            elif case.status == SKIP:
                lines.append(f"  - {case.name}: skipped, {case.message}")
            elif case.status == FAIL and case is first_failure:
                lines.append(f"  ✗ {case.name}")
                lines += [f"      {line}" for part in case.lines for line in part.splitlines()]
            elif case.status == FAIL:
                # One bug often fails several checks: explain the first, name the others.
                what = case.lines[0] if case.lines else "failed"
                lines.append(f"  ✗ {case.name}: " + (what if len(what) <= 80 else what[:79] + "…"))
        if todos:
            lines.append(f"  {num_passed} of {total} checks pass so far: write the missing code, "
                         "then run this cell again.")
        elif self.passed:
            num_skipped = sum(c.status == SKIP for c in self.cases)
            lines.append(f"All {total} checks pass." if not num_skipped else
                         f"All {total - num_skipped} checks that ran pass ({num_skipped} skipped).")
        elif len(self.failures) == 1:
            lines.append(f"{num_passed} of {total} checks pass; 1 fails (see ✗ above).")
        else:
            lines.append(f"{num_passed} of {total} checks pass; {len(self.failures)} fail. Fix the first ✗ "
                         "(explained above) and run the check again: the others often have the same cause "
                         "(print(result.message) explains them all).")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()

    def __repr__(self) -> str:
        num_passed = sum(c.status == PASS for c in self.cases)
        return f"<CheckResult {self.component}: {num_passed}/{len(self.cases)} passed>"

    def _ipython_display_(self) -> None:
        """The checker printed the report already: show nothing more in a notebook."""


# --------------------------------------------------------------------------- running


def run_checks(component: str, cases: Iterable[Case], hints: Iterable[tuple[str, str]] = (),
               *, quiet: bool = False) -> CheckResult:
    """Run every case; print the report (unless ``quiet``) and return the result.

    ``hints``: (regex, hint) pairs; a failure whose message matches gets the hint."""
    hints = list(hints)
    results = [_run_case(case, hints) for case in cases]
    result = CheckResult(component, results)
    if not quiet:
        print(result.report())
    return result


def _run_case(case: Case, hints: list[tuple[str, str]]) -> CaseResult:
    try:
        case.run()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a report line
        if isinstance(exc, ModuleNotFoundError) and exc.name == "hypothesis":
            return CaseResult(case.name, SKIP, ["hypothesis is not installed (pip install hypothesis)"])
        todo = not_implemented_message(exc)
        if todo is not None:
            return CaseResult(case.name, TODO, [todo])
        failures = _distinct_failures(exc)
        if len(failures) == 1:
            lines = _explain_failure(failures[0], hints)
        else:   # hypothesis found several different bugs: each with its own smallest input
            lines = [f"hypothesis found {len(failures)} different failures; each with its smallest "
                     "failing input:"]
            for number, failure in enumerate(failures, 1):
                first, *rest = _explain_failure(failure, hints)
                lines += [f"({number}) {first}"] + [f"    {line}" for line in rest]
        return CaseResult(case.name, FAIL, [round_floats(line) for line in lines])
    return CaseResult(case.name, PASS)


def _distinct_failures(exc: BaseException) -> list[BaseException]:
    """Hypothesis reports several distinct bugs as an ExceptionGroup (a NotImplementedError
    was looked for before): its leaves, each carrying its own shrunk example; else [exc]."""
    subs = getattr(exc, "exceptions", None)   # an ExceptionGroup (the backport on Python 3.10)
    if not isinstance(subs, tuple) or not subs:
        return [exc]
    return [leaf for sub in subs for leaf in _distinct_failures(sub)]


def _explain_failure(exc: BaseException, hints: list[tuple[str, str]]) -> list[str]:
    lines = explain_exception(exc)
    text = "\n".join(lines)
    if not (isinstance(exc, CheckFailure) and exc.hint):
        for pattern, hint in hints:
            if re.search(pattern, text):
                lines.append(f"hint:     {hint}")
                break
    notes = _failing_example(exc)
    if notes and not (isinstance(exc, CheckFailure) and exc.input is not None):
        lines.append("the failing example (shrunk by hypothesis):")
        lines += [f"    {n}" for n in trim_lines(notes)]
    return lines


def _failing_example(exc: BaseException) -> list[str]:
    """The lines of hypothesis's failing example, from the exception's notes."""
    lines = []
    for note in getattr(exc, "__notes__", []):
        if note.startswith("You can reproduce"):
            continue
        note = note.removeprefix("Failing test case: ").removeprefix("Falsifying example: ")
        if note.strip() and note != "<state machine>":
            lines += note.splitlines()
    return lines


def _exception_chain(exc: BaseException):
    seen = set()
    stack = [exc]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        stack.extend(getattr(current, "exceptions", ()))  # ExceptionGroup
        stack.extend([current.__cause__, current.__context__])


_NOT_IMPLEMENTED_IN_TEXT = re.compile(r"NotImplementedError\((['\"])(.*?)\1\)")


def not_implemented_message(exc: BaseException) -> str | None:
    """The message of a NotImplementedError anywhere in ``exc``'s chain (also inside
    Triton's InterpreterError, which carries it as text), else None."""
    for current in _exception_chain(exc):
        if isinstance(current, NotImplementedError):
            return str(current) or "a part of the exercise is not written yet"
        # Triton wraps it: the interpreter's InterpreterError, or a CompilationError
        # that quotes the `raise` line of a kernel compiled for a GPU.
        match = _NOT_IMPLEMENTED_IN_TEXT.search(str(current))
        if match:
            return match.group(2)
    return None


def explain_exception(exc: BaseException) -> list[str]:
    """A failure in a learner's words: CheckFailure's fields, an assertion's message, or
    'your code raised X' with the line it came from."""
    if isinstance(exc, CheckFailure):
        return exc.explain()
    if isinstance(exc, AssertionError) and str(exc):
        return [str(exc)]
    where = _innermost_user_frame(exc)
    lines = [f"your code raised {type(exc).__name__}: {exc}"]
    if where:
        lines.append(f"at:       {where}")
    return lines


_LIBRARY_PARTS = ("/hypothesis/", "/torch/", "/triton/", "/microvllm/checks/", "/_pytest/",
                  "/pluggy/", "/numpy/")


def _innermost_user_frame(exc: BaseException) -> str | None:
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        if not any(part in frame.filename for part in _LIBRARY_PARTS):
            code = f": {frame.line.strip()}" if frame.line else ""
            return f"{frame.name}(), line {frame.lineno}{code}"
    return None


# ------------------------------------------------------------------------ hypothesis


def property_settings(max_examples: int, **overrides):
    """Deterministic hypothesis settings for checks (same examples every run)."""
    from hypothesis import HealthCheck, Phase, settings

    # No "explain" phase: its notes name lines of the checker, not of the learner's code.
    phases = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]
    return settings(max_examples=max_examples, derandomize=True, database=None, deadline=None,
                    print_blob=False, suppress_health_check=list(HealthCheck), phases=phases,
                    **overrides)


def run_property(test: Callable[[], None]) -> None:
    """Run a ``@given`` test (or a state machine runner) with hypothesis's own printing
    captured, so the failing example arrives only through the report."""
    from hypothesis.reporting import with_reporter

    with with_reporter(lambda _message: None):
        test()
