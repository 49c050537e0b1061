"""xgrammar's errors reach clients without its C++ log prefix (issue 38, item 8)."""

import json

import pytest

from microvllm.structured_output import clean_compiler_message

LOGGED = [
    ("[16:11:12] /project/cpp/grammar_parser.cc:820: EBNF parser error at line 1, column 2008: "
     "Nest layer exceeded the maximum limit\n",
     "EBNF parser error at line 1, column 2008: Nest layer exceeded the maximum limit"),
    ("[16:18:11] /project/cpp/regex_converter.cc:94: Regex parsing error at position 4: "
     "The parenthesis is not closed.\n",
     "Regex parsing error at position 4: The parenthesis is not closed."),
    ("[16:18:11] /project/cpp/json_schema_converter.cc:5088: Cannot find field 'nope' in #/nope\n",
     "Cannot find field 'nope' in #/nope"),
    ("[09:00:01.123] C:\\build\\cpp\\grammar.h:12: Check failed: x\nStack trace:\n  [bt] (0) libxgrammar.so",
     "Check failed: x"),
    ("properties must be an object", "properties must be an object"),   # nothing to drop
    ('Rule "a.cc" is not defined', 'Rule "a.cc" is not defined'),          # a name, not a source line
]


@pytest.mark.parametrize("logged, clean", LOGGED)
def test_the_log_prefix_goes_and_the_message_stays(logged, clean):
    assert clean_compiler_message(logged) == clean


def test_real_xgrammar_errors_come_out_clean():
    xgr = pytest.importorskip("xgrammar")
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(["a", "b", "<eos>"]))
    for compile_, spec in [(compiler.compile_grammar, 'root ::= "a" | foo'), (compiler.compile_regex, "a(b"),
                           (compiler.compile_json_schema, json.dumps({"type": "object", "properties": 5}))]:
        with pytest.raises(RuntimeError) as raised:
            compile_(spec)
        assert ".cc:" in str(raised.value)                     # what xgrammar says
        message = clean_compiler_message(str(raised.value))
        assert ".cc" not in message and not message.startswith("[") and len(message) > 10, message
