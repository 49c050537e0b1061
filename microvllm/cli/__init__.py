"""The ``microvllm`` command: ``main.py`` dispatches the subcommands, ``parser.py`` holds
``FlexibleArgumentParser`` (vLLM's spelling-tolerant argparse)."""
