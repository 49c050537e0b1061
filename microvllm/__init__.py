"""microvllm: a vLLM-V1-style LLM inference engine, small enough to read, built to teach.

    from microvllm import LLM, SamplingParams
    llm = LLM()
    llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=16))

The names a vLLM offline script imports are here too, from where each lives::

    LLM                           llm.py                  the offline API
    SamplingParams                sampling_params.py
    RequestOutput, CompletionOutput, Logprob   engine/outputs.py
    EngineArgs                    engine/arg_utils.py     settings, also as CLI flags
    LLMEngine                     engine/engine.py        the step loop (add_request / step)
    TokensPrompt, TextPrompt      inputs.py
    FlexibleArgumentParser        cli/parser.py
    cleanup_dist_env_and_memory   distributed/            (destroys a process group, collects garbage)
"""

import logging

from microvllm.cli.parser import FlexibleArgumentParser
from microvllm.distributed import cleanup_dist_env_and_memory
from microvllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from microvllm.engine.engine import LLMEngine
from microvllm.engine.outputs import CompletionOutput, Logprob, RequestOutput
from microvllm.inputs import TextPrompt, TokensPrompt
from microvllm.llm import LLM
from microvllm.sampling_params import RequestOutputKind, SamplingParams

# A library adds no handlers: the application (or `microvllm` the command) decides
# where log lines go. This only silences "no handler" warnings on old Pythons.
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "EngineArgs",
           "LLMEngine", "TokensPrompt", "TextPrompt", "FlexibleArgumentParser",
           "cleanup_dist_env_and_memory", "AsyncEngineArgs", "RequestOutputKind"]
__version__ = "0.1.0"
