"""``python -m microvllm ...``: the same command line as ``microvllm`` (see ``cli/main.py``)."""

import sys

from microvllm.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
