"""Serving metrics in Prometheus' text format, with vLLM's names (vLLM:
``v1/metrics/loggers.py``, ``PrometheusStatLogger``): ``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_hits``, ..., so that routers and
dashboards written for vLLM (vLLM Router's load reading, Grafana boards) read ours. A metric
vLLM does not have keeps the ``microvllm:`` prefix (``microvllm:moe_expert_tokens``).

    request arrives ─── queue ─── first token ── token ── token ── ... ── finished
    |<──── time_to_first_token ────>|<─ inter_token ─>|
    |<────────────────────── e2e_request_latency ─────────────────────────>|

The engine-core thread writes (``on_arrival``, ``on_output``, ``set_gauges``); the
server's ``/metrics`` reads (``render``); one lock keeps each read consistent.
The text format is simple enough to write by hand: ``# HELP``, ``# TYPE``, then
``name{labels} value`` lines; a histogram is cumulative ``_bucket{le=...}`` counts
plus ``_sum`` and ``_count``.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
from dataclasses import dataclass, field

from microvllm.core.spec_decode_stats import SpecDecodingStats

PREFIX = "vllm:"             # a metric vLLM has, with vLLM's name and meaning
OWN_PREFIX = "microvllm:"    # one it does not
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)   # per bucket, not cumulative; last = +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self):
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip([*map(repr, self.buckets), "+Inf"], self.counts):
            running += count
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        return [*out, f"{name}_sum {self.total!r}", f"{name}_count {self.count}"]


@dataclass
class _Timing:
    arrival: float
    last_token: float | None = None
    num_prompt_tokens_counted: bool = False


class ServingMetrics:
    """Counters, gauges and histograms of one engine, rendered by ``render()``.
    ``engine_index``: one of N data-parallel cores, its samples labelled ``engine="i"``
    (vLLM's label; ``PerEngineMetrics``)."""

    def __init__(self, engine_index: int | None = None) -> None:
        self.engine_index = engine_index
        self._lock = threading.Lock()
        self._timings: dict[str, _Timing] = {}
        self.num_requests_running = 0
        self.num_requests_waiting = 0
        self.kv_cache_usage_perc = 0.0
        self.prefix_cache_queries = 0   # prompt tokens looked up in the prefix cache (at admission)
        self.prefix_cache_hits = 0      # of those, tokens found cached
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.request_success_total: dict[str, int] = {}
        self.time_to_first_token = Histogram(TTFT_BUCKETS)
        self.inter_token_latency = Histogram(ITL_BUCKETS)
        self.e2e_request_latency = Histogram(E2E_BUCKETS)
        self.spec_decoding: SpecDecodingStats | None = None   # None: speculative decoding is off

    # ------------------------------------------------ the engine thread
    def on_arrival(self, request_id: str, now: float, engine_index: int = 0) -> None:
        """``engine_index``: the core that runs it (``PerEngineMetrics``; one core here)."""
        with self._lock:
            self._timings[request_id] = _Timing(now)

    def on_abort(self, request_id: str) -> None:
        with self._lock:
            self._timings.pop(request_id, None)
            self.request_success_total["abort"] = self.request_success_total.get("abort", 0) + 1

    def on_output(self, out, now: float) -> None:
        """One step's ``RequestOutput`` of a request."""
        with self._lock:
            timing = self._timings.get(out.request_id)
            if timing is None:
                return
            if not timing.num_prompt_tokens_counted:
                self.prompt_tokens_total += len(out.prompt_token_ids)
                timing.num_prompt_tokens_counted = True
            new_tokens = sum(len(c.delta_token_ids) for c in out.outputs)
            if new_tokens:
                self.generation_tokens_total += new_tokens
                if timing.last_token is None:
                    self.time_to_first_token.observe(now - timing.arrival)
                else:
                    self.inter_token_latency.observe(now - timing.last_token)
                timing.last_token = now
            if out.finished:
                self._timings.pop(out.request_id, None)
                self.e2e_request_latency.observe(now - timing.arrival)
                reason = out.outputs[0].finish_reason or "stop"
                self.request_success_total[reason] = self.request_success_total.get(reason, 0) + 1

    def set_spec_decoding(self, stats: SpecDecodingStats) -> None:
        """The scheduler's running counts of drafts and accepted drafts (copied)."""
        with self._lock:
            self.spec_decoding = dataclasses.replace(
                stats, num_accepted_tokens_per_pos=list(stats.num_accepted_tokens_per_pos))

    def set_gauges(self, running: int, waiting: int, kv_cache_usage: float,
                   prefix_cache_queries: int = 0, prefix_cache_hits: int = 0) -> None:
        """The engine's gauges, and its running prefix-cache counters (copied)."""
        with self._lock:
            self.num_requests_running, self.num_requests_waiting = running, waiting
            self.kv_cache_usage_perc = kv_cache_usage
            self.prefix_cache_queries, self.prefix_cache_hits = prefix_cache_queries, prefix_cache_hits

    # ---------------------------------------------------------- /metrics
    def render(self, model_name: str) -> str:
        """The Prometheus text exposition (version 0.0.4)."""
        label = f'model_name="{model_name}"'
        if self.engine_index is not None:
            label = f'engine="{self.engine_index}",{label}'
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, values: list[str]) -> None:
            lines.extend([f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}"])
            lines.extend(f"{PREFIX}{v}" for v in values)

        with self._lock:
            metric("num_requests_running", "gauge", "Requests in the running queue (scheduled each step).",
                   [f"num_requests_running{{{label}}} {self.num_requests_running}"])
            metric("num_requests_waiting", "gauge", "Requests waiting to be scheduled.",
                   [f"num_requests_waiting{{{label}}} {self.num_requests_waiting}"])
            metric("kv_cache_usage_perc", "gauge", "KV cache usage: 1 means every block is in use.",
                   [f"kv_cache_usage_perc{{{label}}} {self.kv_cache_usage_perc!r}"])
            metric("prefix_cache_queries_total", "counter",
                   "Prompt tokens looked up in the prefix cache when requests were admitted.",
                   [f"prefix_cache_queries_total{{{label}}} {self.prefix_cache_queries}"])
            metric("prefix_cache_hits_total", "counter", "Of the prefix cache queries, tokens found cached.",
                   [f"prefix_cache_hits_total{{{label}}} {self.prefix_cache_hits}"])
            metric("prompt_tokens_total", "counter", "Prompt tokens processed.",
                   [f"prompt_tokens_total{{{label}}} {self.prompt_tokens_total}"])
            metric("generation_tokens_total", "counter", "Tokens generated.",
                   [f"generation_tokens_total{{{label}}} {self.generation_tokens_total}"])
            metric("request_success_total", "counter", "Finished requests, by finish reason.",
                   [f'request_success_total{{{label},finished_reason="{reason}"}} {count}'
                    for reason, count in sorted(self.request_success_total.items())])
            for name, hist, text in (
                    ("time_to_first_token_seconds", self.time_to_first_token,
                     "Time from arrival to the first generated token."),
                    ("inter_token_latency_seconds", self.inter_token_latency,
                     "Time between two outputs of one request."),
                    ("e2e_request_latency_seconds", self.e2e_request_latency,
                     "Time from arrival to the last token.")):
                metric(name, "histogram", text,
                       [_labelled(line, label) for line in hist.lines(name)])
            if self.spec_decoding is not None:
                lines.extend(spec_decoding_lines(self.spec_decoding, label))
        return "\n".join(lines) + "\n"


class PerEngineMetrics:
    """The metrics of N data-parallel cores behind one front end: one ``ServingMetrics``
    per core, each request counted on the core that runs it, rendered as one exposition
    (each metric's HELP and TYPE once, then every core's samples, ``engine="i"``)."""

    def __init__(self, num_engines: int) -> None:
        self.engines = [ServingMetrics(index) for index in range(num_engines)]
        self._engine_of: dict[str, ServingMetrics] = {}   # request id -> its core's metrics

    def on_arrival(self, request_id: str, now: float, engine_index: int = 0) -> None:
        metrics = self._engine_of[request_id] = self.engines[engine_index]
        metrics.on_arrival(request_id, now)

    def on_abort(self, request_id: str) -> None:
        metrics = self._engine_of.pop(request_id, None)
        if metrics is not None:
            metrics.on_abort(request_id)

    def on_output(self, out, now: float) -> None:
        metrics = self._engine_of.get(out.request_id)
        if metrics is not None:
            metrics.on_output(out, now)
            if out.finished:
                del self._engine_of[out.request_id]

    def render(self, model_name: str) -> str:
        families: dict[str, list[str]] = {}   # metric -> its HELP, TYPE, then every core's samples
        for index, metrics in enumerate(self.engines):
            name = ""
            for line in metrics.render(model_name).splitlines():
                if line.startswith("# HELP ") or line.startswith("# TYPE "):
                    name = line.split()[2]
                    if index == 0:
                        families.setdefault(name, []).append(line)
                elif line:
                    families.setdefault(name, []).append(line)
        return "".join(line + "\n" for lines in families.values() for line in lines)


def spec_decoding_lines(stats: SpecDecodingStats, label: str) -> list[str]:
    """Speculative decoding's counters, vLLM's ``vllm:spec_decode_*`` names."""
    lines = []
    for name, help_text, values in (
            ("spec_decode_num_drafts", "Steps in which a request had drafts checked.",
             [f"{{{label}}} {stats.num_drafts}"]),
            ("spec_decode_num_draft_tokens", "Draft tokens checked by the target.",
             [f"{{{label}}} {stats.num_draft_tokens}"]),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
             [f"{{{label}}} {stats.num_accepted_tokens}"]),
            ("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the draft.",
             [f'{{{label},position="{i}"}} {n}' for i, n in enumerate(stats.num_accepted_tokens_per_pos)])):
        lines += [f"# HELP {PREFIX}{name}_total {help_text}", f"# TYPE {PREFIX}{name}_total counter"]
        lines += [f"{PREFIX}{name}_total{value}" for value in values]
    return lines


# ``LLM.get_metrics()`` returns these (vLLM: ``vllm/v1/metrics/reader.py``, same names).
@dataclass(frozen=True)
class Metric:
    name: str
    labels: dict[str, str]


@dataclass(frozen=True)
class Counter(Metric):
    value: int


@dataclass(frozen=True)
class Gauge(Metric):
    value: float


@dataclass(frozen=True)
class Vector(Metric):
    values: list[int]


def engine_metrics(engine) -> list[Metric]:
    """A snapshot of an engine's gauges, prefix-cache and speculative decoding counters and,
    for a mixture of experts, the tokens routed to each expert of each layer (``LLM.get_metrics``).
    Read from the core's stats (``core/stats.py``), never from its scheduler."""
    stats = engine.get_stats()
    metrics: list[Metric] = [
        Gauge(f"{PREFIX}num_requests_running", {}, stats.num_running_reqs),
        Gauge(f"{PREFIX}num_requests_waiting", {}, stats.num_waiting_reqs),
        Gauge(f"{PREFIX}kv_cache_usage_perc", {}, stats.kv_cache_usage),
        Counter(f"{PREFIX}prefix_cache_queries", {}, engine.prefix_cache_queries),
        Counter(f"{PREFIX}prefix_cache_hits", {}, engine.prefix_cache_hits)]
    if stats.spec_decoding is not None:
        drafts = stats.spec_decoding
        metrics += [Counter(f"{PREFIX}spec_decode_num_drafts", {}, drafts.num_drafts),
                    Counter(f"{PREFIX}spec_decode_num_draft_tokens", {}, drafts.num_draft_tokens),
                    Counter(f"{PREFIX}spec_decode_num_accepted_tokens", {}, drafts.num_accepted_tokens),
                    Vector(f"{PREFIX}spec_decode_num_accepted_tokens_per_pos", {},
                           list(drafts.num_accepted_tokens_per_pos))]
    # Mixtures of experts: (token, expert) pairs routed to each expert, one vector per layer.
    metrics += [Vector(f"{OWN_PREFIX}moe_expert_tokens", {"layer": layer}, list(counts))
                for layer, counts in engine.expert_load.items()]
    return metrics


def _labelled(line: str, label: str) -> str:
    """Put ``label`` into a sample line: ``x_bucket{le="1"} 3`` -> ``x_bucket{label,le="1"} 3``."""
    name, _, value = line.partition(" ")
    if "{" in name:
        return name.replace("{", "{" + label + ",", 1) + " " + value
    return f"{name}{{{label}}} {value}"
