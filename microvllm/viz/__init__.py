"""Pictures of the engine at work, drawn from a recorded `microvllm.trace.Trace`.

    plot_block_pool(trace, step)     the pool as a grid: owner, ref count, cached-free, null block
    plot_block_tables(trace, step)   each running request's logical -> physical block table (and the
                                     still-held slots of rejected drafts)
    plot_batch(trace, step)          the step's tokens per request against the token budget (runner order);
                                     speculative drafts hatched: accepted ///, rejected xxx
    plot_queues(trace, step)         the step's requests by queue: running, waiting (in order), finished,
                                     preempted; one chip per request in its colour (the legend)
    plot_timeline(trace, step=None)  the whole run: tokens per step, budget, free blocks, preemptions
    plot_step(trace, step)           all of the above in one figure
    plot_decoder_layer(model)        one decoder layer's data flow with the model's shapes (no trace)
    plot_expert_load(trace, layer=None, step=None)
                                     a mixture-of-experts layer: pairs routed to each expert per step
                                     (heat map), each expert's share of the run against 1/E
    expert_parallel_imbalance(trace, layer, num_ranks)
                                     per step, the busiest expert-parallel rank's pairs / the mean rank's
    plot_routing(report_or_comparison, block_size=None)
                                     a router's run (microvllm/router/): one row per request, coloured by
                                     the replica it went to, its prompt blocks hit in that replica's
                                     prefix cache or computed; a PolicyComparison: one panel per policy
    OverlapRecorder(llm), plot_overlap(runs)
                                     a real run's calls on a time axis, one lane per thread: the
                                     core's plans and updates, the forwards (async scheduling's
                                     overlap; no trace needed)
    StepExplorer(llm_or_trace)       Play button + slider over the steps (ipywidgets);
                                     preset="projector" and scale=1.5 for a big screen
    demo_trace(kind)                 small traces from the real scheduler, no model needed

`step` is always an index into `trace.steps`. Every plot returns a
`matplotlib.figure.Figure` made without pyplot (headless, nothing leaked).
"""

from microvllm.viz.batch import plot_batch
from microvllm.viz.block_pool import plot_block_pool
from microvllm.viz.block_table import plot_block_tables
from microvllm.viz.colors import request_colors
from microvllm.viz.decoder_layer import plot_decoder_layer
from microvllm.viz.demo import demo_trace, large_demo_trace
from microvllm.viz.expert_load import expert_parallel_imbalance, plot_expert_load
from microvllm.viz.explorer import StepExplorer
from microvllm.viz.overlap import OverlapRecorder, plot_overlap
from microvllm.viz.queues import plot_queues
from microvllm.viz.routing import plot_routing
from microvllm.viz.step_figure import plot_step
from microvllm.viz.summary import describe_step
from microvllm.viz.timeline import plot_timeline

__all__ = ["OverlapRecorder", "StepExplorer", "demo_trace", "describe_step", "expert_parallel_imbalance",
           "large_demo_trace",
           "plot_batch", "plot_block_pool", "plot_block_tables", "plot_decoder_layer", "plot_expert_load",
           "plot_overlap", "plot_queues", "plot_routing", "plot_step", "plot_timeline", "request_colors"]
