"""Exercise 15: the token mask of a DFA state (structured outputs)."""

from microvllm.course.exercise import Exercise, Part
from microvllm.structured_output.backend_regex import TokenTrie

EXERCISE = Exercise(
    number="15", slug="token_mask", title="Structured outputs: the token mask of a DFA state",
    lecture="15 · structured outputs",
    intro="""You write the heart of the course's structured-output backend: given the DFA state the
text is in, which vocabulary tokens may come next (`TokenTrie.allowed_from`). A token spans several
bytes (the DFA reads UTF-8: an ASCII character is one byte, 😀 is four, and a token may hold only
part of a character), so several DFA states; it is allowed only if reading *all* of its bytes never
reaches the dead state. The vocabulary is a trie, so that tokens sharing a prefix share its walk and
a dead prefix prunes every token below it.""",
    setup="""
import microvllm.structured_output.backend_regex
from microvllm.structured_output.regex_dfa import RegexDFA
from microvllm.checks import check_token_trie, run_engine_with
""",
    parts=(Part(TokenTrie, methods=("allowed_from",), intro="""Your class is the engine's `TokenTrie`
with your `allowed_from`. Its constructor (given) built the trie from `{token_id: text}`:
`self.children[node]` maps a byte of the text's UTF-8 (an int) to the child node, `self.ends[node]`
lists the ids whose text ends exactly there, and node 0 is the empty prefix. The DFA gives
`dfa.step(state, ch)` (the next state, or `dfa.DEAD`) for a byte `ch`."""),),
    todos={
        "TokenTrie.allowed_from": "walk the trie from node 0 with the DFA at `state`; enter a child only if "
                                  "dfa.step(at, ch) != dfa.DEAD; return the ids in self.ends of every node reached",
    },
    contract="""
`allowed_from(dfa, state) -> list[int]`: every token id whose whole text can be read from the DFA
state `state` without reaching `dfa.DEAD`:

- a token is allowed iff every byte of its text, stepped one by one from `state`, keeps the
  DFA alive — then some text still completes the pattern; a forbidden token is one after which
  nothing can;
- an id may end at a node that has children (`"1."` under `"1"`): add the ids of *every* node you
  reach, not only of leaves; node 0 (the empty prefix) holds only the ids of empty tokens (the
  engine's vocabulary has none; hint 3's token 8 is one): never add them, since a token that adds
  nothing would let the model stall in place;
- allowed means "can still become a match", not "is a match": under `[0-9]+(\\.[0-9]+)?`,
  `"1."` is allowed after `"3"` although `"31."` matches nothing yet (only EOS needs an
  accepting state: the engine adds it);
- the engine builds one trie and asks it about every state of every pattern, in any order: an
  answer is for this `(dfa, state)` only (state 1 of one DFA is not state 1 of another), so a memo
  keyed by the state alone, or kept for all states, returns another question's mask;
- prune: never step below a dead prefix (`dfa.step` is never called on `dfa.DEAD`), so that a
  49,152-token vocabulary is walked only where the pattern can go;
- the order of the ids does not matter; the engine sets those entries of the mask to True.

The engine calls it once per DFA state a request reaches (the mask is remembered), then adds the
EOS ids where the state accepts (`RegexGrammar.allowed_ids`, given).
""",
    hints=(
        """Draw the trie of `{0: "1", 1: "1.", 2: "12", 3: "a"}` and walk it by hand from the start
state of `[0-9]+\\.[0-9]`:
```
node 0 ──"1"──> n1 [ids 0] ──"."──> n2 [ids 1]
   │                └─────"2"──> n3 [ids 2]
   └───"a"──> n4 [ids 3]
```
At each edge, which DFA state are you in, and which edge first reaches `dfa.DEAD`? What must you
carry along with a node so that the walk can go on from it? A tree has one path to each node: do
you need a "seen" set?""",
        """Which ids does the walk collect: those at the node where the DFA died, those at a node
it entered alive, or only those where the DFA accepts? Is `"1."` (n2) allowed although `"1."`
matches nothing yet? If you stop at `"a"`, how many `dfa.step` calls did the nodes below it cost
you — and how many would they cost under a dead prefix in a 49,152-token vocabulary?""",
        """Before you run this, predict which of the nine tokens may start a match of
`[0-9]+\\.[0-9]`, and which may follow a first `"7"`. Why is `"1.5x"` never allowed although it
starts like `"1.5"`? Which node holds the empty token 8?
```python
# Test case: paste it into a new cell and run it (it uses your TokenTrie above)
dfa = RegexDFA(r"[0-9]+\\.[0-9]")
trie = TokenTrie({0: "1", 1: "1.", 2: "12", 3: "a", 4: ".5", 5: "1.5x", 6: "1.5", 7: "..", 8: ""})
assert sorted(trie.allowed_from(dfa, dfa.start)) == [0, 1, 2, 6], sorted(trie.allowed_from(dfa, dfa.start))
after_digit = dfa.walk(dfa.start, "7")
assert sorted(trie.allowed_from(dfa, after_digit)) == [0, 1, 2, 4, 6], sorted(trie.allowed_from(dfa, after_digit))
```""",
    ),
    checks=("check_token_trie(TokenTrie)",),
    engine_intro="""`components={"token_trie": TokenTrie}` makes the course backend
(`structured_outputs_backend="course"`) build its vocabulary trie with your class, so every token
mask of the run comes from your `allowed_from`. A tiny random model has nothing but the mask to keep
it on track: five prompts each under a regex (a phone number, a small JSON object, a choice, a
sentence, a price), greedy and seeded. The tokens must equal the reference engine's, and every text
must match its regex (or, when `max_tokens` cut it, still be able to).""",
    engine='run_engine_with({"token_trie": TokenTrie})',
)
