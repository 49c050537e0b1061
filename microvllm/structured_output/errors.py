"""Compiler errors as a client should read them."""

from __future__ import annotations

import re


def clean_compiler_message(text: str) -> str:
    """A grammar compiler's error as a client should read it: xgrammar's C++ log prefix
    (a timestamp and the source file and line) and any stack trace dropped, the message kept.

        "[16:11:12] /project/cpp/grammar_parser.cc:820: EBNF parser error at line 1, column 2008: ..."
        -> "EBNF parser error at line 1, column 2008: ..."
    """
    lines = []
    for line in str(text).splitlines():
        if re.match(r"\s*(Stack trace|\[bt\])", line):
            break
        line = re.sub(r"^\s*\[\d{1,2}:\d{2}:\d{2}(?:\.\d+)?\]\s*", "", line)
        line = re.sub(r"(?:[A-Za-z]:)?(?:[\w.\-]*[/\\])*[\w.\-]+\.(?:cc|cpp|cxx|c|h|hpp|cu|cuh)(?::\d+)+:?\s*",
                      "", line)
        if line.strip():
            lines.append(line.strip())
    return "\n".join(lines)
