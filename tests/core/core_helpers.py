"""The core tests' fakes (sampling params, a shadow KV cache that checks every read,
a fake runner and the step loop) are the same ones the exercise checkers use: one
copy, in ``microvllm.checks.fakes``."""

from microvllm.checks.fakes import (  # noqa: F401
    FakeRunner,
    FakeSamplingParams,
    ShadowKVCache,
    StepRecord,
    feeder_token,
    first_needed_position,
    make_request,
    make_scheduler,
    outputs_by_request,
    run_steps,
)
