"""``Exercise`` and ``Part``: what one exercise notebook is made of (``course/specs/`` fills
them in; ``course/build.py`` turns them into notebooks)."""

from __future__ import annotations

import inspect
import textwrap
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Part:
    """One code cell made from the package: the whole source of ``obj`` (a function or
    class), or, with ``methods``, a subclass holding only those methods::

        class Scheduler(microvllm.core.scheduler.Scheduler):
            \"\"\"The engine's Scheduler, with your schedule().\"\"\"

            def schedule(self) -> SchedulerOutput: ...    (inspect.getsource of the method)
    """

    obj: object
    methods: tuple[str, ...] = ()
    intro: str = ""  # Markdown shown above the cell

    @property
    def target(self):
        """The Python function or class (a ``@triton.jit`` kernel wraps its function in ``.fn``)."""
        return self.obj if inspect.isfunction(self.obj) or inspect.isclass(self.obj) else self.obj.fn

    @property
    def name(self) -> str:
        return self.target.__name__

    def source(self) -> str:
        if not self.methods:
            return textwrap.dedent(inspect.getsource(self.target)).rstrip() + "\n"
        cls = self.obj
        listed = " and ".join(f"{m}()" for m in self.methods)
        header = (f"class {cls.__name__}({cls.__module__}.{cls.__qualname__}):\n"
                  f'    """The engine\'s {cls.__name__}, with your {listed}."""\n')
        bodies = [inspect.getsource(getattr(cls, m)).rstrip() + "\n" for m in self.methods]
        return header + "\n" + "\n".join(bodies)


@dataclass(frozen=True)
class Exercise:
    """Everything one notebook pair needs; the code comes from ``parts``."""

    number: str                 # the lecture it follows: "03"
    slug: str                   # file name: 03_block_pool.ipynb
    title: str
    lecture: str                # "03 · KV cache and the block allocator"
    intro: str                  # Markdown: what you build and why
    setup: str                  # code: the imports the parts need
    parts: tuple[Part, ...]
    todos: dict                 # "Class.method" or "function" -> what to write (a list for several blocks)
    contract: str               # Markdown
    hints: tuple[str, ...]      # Markdown, revealed one at a time
    checks: tuple[str, ...]     # code, one cell each
    engine_intro: str           # Markdown
    engine: str                 # code: run the engine on your code
    extra_setup_first: str = ""  # code that must run before anything imports triton
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def filename(self) -> str:
        return f"{self.number}_{self.slug}.ipynb"
