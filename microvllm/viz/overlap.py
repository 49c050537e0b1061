"""Async scheduling's overlap, measured on one real run: when the core's thread plans and
updates, and when the execute thread runs each forward.

    recorder = OverlapRecorder(llm)          # an LLM whose core runs in this process
    with recorder:                           # times the core's own scheduler and executor
        llm.generate(prompts, params)
    plot_overlap({"async": recorder.spans})  # one lane per thread, one bar per call

    core thread      [schedule N][schedule N+1]......[update N][schedule N+2]......[update N+1]
    execute thread               [forward N ..................][forward N+1 ...................]

Without async scheduling both lanes are one thread and the bars take turns. The
recorder wraps the core's objects for the ``with`` block only (their own methods run,
timed), so what it draws is what executed.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from matplotlib.figure import Figure

COLORS = {"forward": "#C44E52", "schedule": "#4C72B0", "update": "#55A868"}   # drawn in this order


@dataclass(frozen=True)
class Span:
    thread: str    # the thread's name
    what: str      # "schedule", "update" or "forward"
    start: float   # seconds since the recording began
    end: float


class OverlapRecorder:
    """Times ``scheduler.schedule``, ``scheduler.update_from_output`` and
    ``executor.execute_model`` of an in-process engine core while the ``with`` block runs."""

    def __init__(self, llm):
        core = getattr(llm.llm_engine.engine_core, "engine_core", None)
        if core is None:
            raise ValueError("OverlapRecorder needs the engine core in this process (the default: "
                             "VLLM_ENABLE_V1_MULTIPROCESSING unset)")
        self.core = core
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        self._origin = 0.0

    def _timed(self, function, what: str):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                end = time.perf_counter()
                with self._lock:
                    self.spans.append(Span(threading.current_thread().name, what,
                                           start - self._origin, end - self._origin))
        return timed

    def __enter__(self) -> "OverlapRecorder":
        self._origin = time.perf_counter()
        scheduler, executor = self.core.scheduler, self.core.executor
        # Instance attributes shadow the class's methods; deleted again on exit.
        scheduler.schedule = self._timed(scheduler.schedule, "schedule")
        scheduler.update_from_output = self._timed(scheduler.update_from_output, "update")
        executor.execute_model = self._timed(executor.execute_model, "forward")
        return self

    def __exit__(self, *exc) -> None:
        for owner, name in ((self.core.scheduler, "schedule"), (self.core.scheduler, "update_from_output"),
                            (self.core.executor, "execute_model")):
            owner.__dict__.pop(name, None)

    def plans_made_during_a_forward(self) -> int:
        """How many plans were made while a forward ran (0 without async scheduling)."""
        forwards = [s for s in self.spans if s.what == "forward"]
        return sum(any(f.start < s.start < f.end for f in forwards) for s in self.spans if s.what == "schedule")


def plot_overlap(runs: dict[str, list[Span]], width: float = 10.0) -> Figure:
    """One panel per run (its title the dict's key), one lane per thread, one bar per call:
    schedule, update (the core's thread) and forward (wherever it ran). A call shorter than
    1/300 of the run is drawn that wide (a plan takes well under a millisecond)."""
    figure = Figure(figsize=(width, 1.3 + 1.1 * len(runs)))
    axes = figure.subplots(len(runs), 1, squeeze=False)[:, 0]
    end = max((s.end for spans in runs.values() for s in spans), default=1.0)
    narrowest = end * 1e3 / 300   # a call shorter than this is drawn this wide, to be seen
    for ax, (title, spans) in zip(axes, runs.items()):
        lanes = list(dict.fromkeys(s.thread for s in spans))
        for row, lane in enumerate(lanes):
            for what, color in COLORS.items():
                bars = [(s.start * 1e3, max((s.end - s.start) * 1e3, narrowest))
                        for s in spans if s.thread == lane and s.what == what]
                # schedule above update (they follow each other within a millisecond)
                band = {"schedule": (row - 0.35, 0.35), "update": (row, 0.35)}.get(what, (row - 0.35, 0.7))
                ax.broken_barh(bars, band, facecolor=color, label=what,
                               **({"edgecolor": "white", "linewidth": 0.8} if what == "forward" else {}))
        ax.set_yticks(range(len(lanes)), lanes)
        ax.set_ylim(-0.6, len(lanes) - 0.4)
        ax.set_xlim(0, end * 1e3)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10, loc="left")
    axes[-1].set_xlabel("milliseconds")
    handles = {h.get_label(): h for ax in axes for h in ax.get_legend_handles_labels()[0]}
    figure.legend(list(handles.values()), list(handles), loc="upper right", ncol=3, fontsize=8)
    figure.tight_layout(rect=(0, 0, 1, 0.93))
    return figure
