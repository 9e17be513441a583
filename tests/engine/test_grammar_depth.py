"""Grammars whose check recurses deep: a chain of ``$ref`` definitions or of Lark rules.  llguidance
recurses once per link when it checks a grammar; a few thousand links (a 40 KB request) overflowed
a compile thread's usual 8 MB stack -- a segfault that took the gateway down with every request in
flight.  Compile threads now have deep stacks, and a Lark grammar may define at most
``MAX_GRAMMAR_RULES`` rules.

The deep chains compile in a process of their own (a regression would segfault it, not pytest),
through ``GrammarCompiler`` with the real llguidance backend over a real tokenizer."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common.engine.structured.backend import GrammarError
from common.engine.structured.compiler import GrammarCompiler, make_backend
from common.engine.structured.llguidance_backend import MAX_GRAMMAR_RULES
from common.engine.structured.spec import StructuredOutput
from tests.support.checkpoints import VOCAB, write_tokenizer
from tests.support.grammar_chains import rule_chain

pytest.importorskip("llguidance")
ROOT = Path(__file__).resolve().parents[2]


COMPILE_IN_ITS_OWN_PROCESS = """
import sys
from transformers import AutoTokenizer
from common.engine.structured.compiler import GrammarCompiler, make_backend
from common.engine.structured.spec import StructuredOutput
from tests.support.checkpoints import VOCAB
from tests.support.grammar_chains import ref_chain, rule_chain
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
compiler = GrammarCompiler(lambda: make_backend("llguidance", tokenizer, VOCAB), timeout_s=120)
compiler.compile(StructuredOutput("json_schema", ref_chain(1500)))
compiler.compile(StructuredOutput("grammar", rule_chain(4000), "structured_outputs"))
print("compiled")
"""


def test_chains_of_thousands_of_definitions_compile_without_overflowing_the_stack(tmp_path):
    write_tokenizer(tmp_path)
    done = subprocess.run([sys.executable, "-c", COMPILE_IN_ITS_OWN_PROCESS, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "compiled", (done.returncode, done.stderr[-2000:])


def test_a_grammar_of_more_rules_than_served_is_refused_naming_its_field(tmp_path):
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    compiler = GrammarCompiler(lambda: make_backend("llguidance", tokenizer, VOCAB), timeout_s=120)
    compiler.compile(StructuredOutput("grammar", rule_chain(MAX_GRAMMAR_RULES - 2), "structured_outputs"))
    with pytest.raises(GrammarError, match=f"^structured_outputs: the grammar defines {MAX_GRAMMAR_RULES + 1} rules"):
        compiler.compile(StructuredOutput("grammar", rule_chain(MAX_GRAMMAR_RULES - 1), "structured_outputs"))
