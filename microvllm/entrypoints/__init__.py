"""Ways into the engine from outside the process (vLLM: ``vllm/entrypoints``): ``openai/``
is the OpenAI-compatible HTTP server that ``microvllm serve`` runs."""
