"""The OpenAI-compatible server: ``protocol.py`` (request bodies), ``serving.py``
(completions and chat over ``AsyncLLM``), ``api_server.py`` (the FastAPI app and
``run_server``)."""
