"""Small helpers shared by the entry points and the engine core (vLLM: ``vllm/utils/``)."""
