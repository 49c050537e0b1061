"""microvllm: a vLLM-V1-style LLM inference engine, small enough to read, built to teach.

    from microvllm import LLM, SamplingParams
    llm = LLM()
    llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=16))
"""

from microvllm.engine.outputs import CompletionOutput, RequestOutput
from microvllm.llm import LLM
from microvllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
