"""StepExplorer: a Play button and a slider over the steps of a recorded trace.

    [▶] step ━━━━━●━━━━━━━ 14
    Step 14 (15 of 24): 20/32 tokens for 2 request(s): 2 prefill, 0 decode.
    New in the batch: r2 (resumed, 16 tokens from the prefix cache); ...
    +--------------------------------------------+
    | block pool | batch  /  block tables  /  timeline |   (one PNG, redrawn per step)
    +--------------------------------------------+

    explorer = StepExplorer(llm)                  # an LLM made with trace=True, or its llm.trace,
                                                  # or StepExplorer.from_json("run.json")
    explorer                                      # the widget (needs a live kernel)
    explorer.show_static(14)                      # a plain matplotlib Figure of step 14

    StepExplorer(llm, preset="projector")         # for the back of a room: text >= 14 px, fits 1080p
    StepExplorer(llm, scale=1.5)                  # 1.5 times bigger (more pixels, same layout)

Presets (`step_figure.PRESETS`): "notebook" (default, 936 x 756 px) and
"projector" (1600 x 900 px, no text under 14 px at that size; JupyterLab draws a
widget image as wide as its output area, which on a 1920-pixel screen is wider);
`scale` multiplies either; `figsize` (inches) and `dpi` override the preset's.

Moving the slider redraws only the per-step plots into one reused figure and
sends a PNG to an `ipywidgets.Image`. Without a kernel (an exported notebook,
nbval) the widget cannot redraw, so the explorer's display also carries a PNG of
its current step, and `show_static` gives ordinary figures.
"""

from __future__ import annotations

import base64
import html
import time
from pathlib import Path

import ipywidgets as widgets

from microvllm.trace import Trace
from microvllm.viz.step_figure import StepFigure, look, plot_step
from microvllm.viz.summary import describe_step


class StepExplorer:
    def __init__(self, llm_or_trace, *, step: int = 0, interval_ms: int = 800, preset: str = "notebook",
                 scale: float = 1.0, figsize: tuple[float, float] | None = None, dpi: float | None = None) -> None:
        trace = getattr(llm_or_trace, "trace", llm_or_trace)      # an LLM (or engine) carries .trace
        if not isinstance(trace, Trace):
            raise TypeError(f"StepExplorer needs a Trace or an LLM made with trace=True, got "
                            f"{type(llm_or_trace).__name__}" + (" whose trace is None: pass trace=True to LLM(...)"
                                                                 if trace is None else ""))
        self.trace = trace
        self.look = look(preset, scale, figsize, dpi)
        self.preset, self.scale = preset, scale
        self.figure = StepFigure(trace, figsize=self.look.figsize, dpi=self.look.dpi,
                                 min_fontsize=self.look.min_fontsize, layout=self.look.layout)
        last = len(trace) - 1
        self.play = widgets.Play(value=step, min=0, max=last, interval=interval_ms, description="Play",
                                 layout=widgets.Layout(width="auto"))
        self.slider = widgets.IntSlider(value=step, min=0, max=last, description="step",
                                        continuous_update=False, layout=widgets.Layout(width="60%"))
        widgets.jslink((self.play, "value"), (self.slider, "value"))
        self.caption = widgets.HTML()
        self.image = widgets.Image(format="png")
        self.widget = widgets.VBox([widgets.HBox([self.play, self.slider]), self.caption, self.image])
        self.last_render_seconds = 0.0
        self.slider.observe(lambda change: self.show_step(change["new"]), names="value")
        self.show_step(step)

    @classmethod
    def from_json(cls, path: str | Path, **kwargs) -> "StepExplorer":
        """An explorer over a trace saved with `Trace.save(path)`."""
        return cls(Trace.load(path), **kwargs)

    @property
    def step(self) -> int:
        return self.slider.value

    def show_step(self, step: int) -> None:
        """Redraw for step *index* `step` (what moving the slider does)."""
        start = time.perf_counter()
        self.figure.draw(step)
        self.image.value = self.figure.png()
        lines = describe_step(self.trace, step)
        self.caption.value = "<br>".join(html.escape(line) for line in lines)
        if self.slider.value != step:
            self.slider.value = step
        self.last_render_seconds = time.perf_counter() - start

    def show_static(self, step: int | None = None):
        """A new matplotlib Figure of step *index* `step` (default: the current one).

        It displays like any figure (`%matplotlib inline`) and survives export to
        HTML and nbval, where the live widget cannot redraw.
        """
        return plot_step(self.trace, self.step if step is None else step, preset=self.preset, scale=self.scale)

    def show(self) -> None:
        from IPython.display import display
        display(self)

    def _repr_mimebundle_(self, **kwargs) -> dict:
        """The live widget, plus a PNG of the current step for frontends without a kernel."""
        bundle = dict(self.widget._repr_mimebundle_(**kwargs) or {})
        bundle["text/plain"] = f"StepExplorer over {len(self.trace)} steps (needs a live kernel to move)"
        bundle["image/png"] = base64.b64encode(self.image.value).decode("ascii")
        return bundle
