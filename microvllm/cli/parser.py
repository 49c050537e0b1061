"""``FlexibleArgumentParser``: argparse that also takes vLLM's spellings of flags.

vLLM scripts build their parser with it (``vllm.utils.argparse_utils``); what it adds
to ``argparse.ArgumentParser`` is that ``--max_num_seqs 8`` means ``--max-num-seqs 8``::

    argv   --max_num_seqs=8  --enable_prefix_caching  my_prompt_file
    seen   --max-num-seqs=8  --enable-prefix-caching  my_prompt_file   (values untouched)
"""

from __future__ import annotations

import argparse
import sys


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` where a flag's underscores may be written as dashes."""

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args([_dashed(a) for a in args], namespace)


def _dashed(arg: str) -> str:
    """``--max_num_seqs=8`` -> ``--max-num-seqs=8``; anything that is not a long flag stays."""
    if not arg.startswith("--"):
        return arg
    flag, sep, value = arg.partition("=")
    return flag.replace("_", "-") + sep + value
