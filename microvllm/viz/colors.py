"""One colour per request id, the same in every plot of a trace; and the pool's state colours."""

from __future__ import annotations

from matplotlib import colormaps
from matplotlib.colors import to_hex

from microvllm.trace import Trace

# tab10 then tab20's light shades, without greys (grey means "free") and reds (red marks
# the token budget and preemptions).
_TAB10 = [to_hex(c) for i, c in enumerate(colormaps["tab10"].colors) if i not in (3, 7)]
_LIGHT = [to_hex(c) for i, c in enumerate(colormaps["tab20"].colors) if i % 2 == 1 and i not in (7, 15)]
PALETTE = _TAB10 + _LIGHT

FREE_COLOR = "#e8e8e8"        # free and empty
CACHED_COLOR = "#ffffff"      # free but still cached: drawn hatched
CACHED_HATCH = "////"
NULL_COLOR = "#303030"        # the null block 0
UNKNOWN_COLOR = "#8c8c8c"     # held (ref count > 0) but by no block table in the trace
BUDGET_COLOR = "#d62728"
PREEMPT_COLOR = "#d62728"
ALLOCATED_COLOR = "#000000"    # edge of a block allocated in this step (no request is black)
FREED_COLOR = "#d62728"        # inner edge of a block freed in this step
REJECTED_COLOR = "#d62728"     # hatch of rejected draft tokens and of their KV slots
DRAFT_HATCH, REJECTED_HATCH = "///", "xxx"
PREFIX_HIT_COLOR = "#f5b800"  # the star beside a bar whose request found cached blocks; a hit block's edge
STATE_COLOR = "#4b0082"       # the corner mark of a page holding a linear-attention state
LOADING_COLOR = "#1f3a93"     # the corner mark of a block a KV connector is loading (or loaded, held)
SENDING_COLOR = "#8b4513"     # the corner mark of a block held until its KV is saved or sent
DECODE_ALPHA = 0.45           # decode tokens are drawn fainter than prefill tokens


def request_colors(trace: Trace) -> dict[str, str]:
    """request id -> colour, by order of first appearance (stable for a given trace)."""
    return {rid: PALETTE[i % len(PALETTE)] for i, rid in enumerate(trace.request_ids())}


def text_color_on(color: str) -> str:
    """Black or white, whichever reads better on `color`."""
    r, g, b = (int(to_hex(color)[i:i + 2], 16) for i in (1, 3, 5))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "white"
