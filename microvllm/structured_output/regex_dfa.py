"""A regular expression as a DFA over UTF-8 bytes: the course's own grammar engine.

Three classic steps (Thompson 1968; the subset construction), small enough to read:

    "ab?c|d"  --parse-->  syntax tree  --Thompson-->  NFA  --subsets, lazily-->  DFA

    NFA (ε: free moves)                          DFA (a state = a set of NFA states)
         ┌─a─> 1 ─ε─> 2 ─c─> (5)                  {0} ─a─> {1,2,3} ─c─> {5}✓
    0 ──ε┤         └─b─> 3 ─ε┘ ...                 │        └─b─> {3} ─c─> {5}✓
         └─d──────────────────> (5)                └─d─> {5}✓

The DFA is built lazily: a state's move on a byte is computed the first time it is
asked for, then remembered. Two facts make it a constrained-decoding engine:

- ``is_accepting(state)``: the text so far matches the whole pattern (EOS may come);
- live (not ``DEAD``): *some* continuation can still match. A state with no way to an
  accepting NFA state is dead: a token that leads there must be masked out.

Why bytes, not characters: a byte-level BPE tokenizer splits a character it has no
token for over several tokens, so a token may hold only some bytes of a character::

    "😀 smile"  =  F0 9F 98 80 20 73 6D 69 6C 65         (😀 is U+1F600: 4 bytes)
    SmolLM2:       [F0 9F] [98] [80] [20 73 6D 69 6C 65]  4 tokens; the first 3 are not text

So the parser reads characters (a ``CharSet`` is a set of code points), and each set
becomes, in the NFA, the UTF-8 encodings of its characters as chains of byte ranges::

    [é😀]          ┌─C3─> 1 ─A9──────────────────> (exit)     é  = C3 A9
          entry ──┤
                   └─F0─> 2 ─9F─> 3 ─98─> 4 ─80──> (exit)     😀 = F0 9F 98 80

A whole range is a few such chains (``utf8_sequences``): U+0080..U+07FF, every 2-byte
character, is the one chain [C2-DF][80-BF]. Nothing else changes: the DFA is built the
same way, a state in the middle of a character is live exactly when some bytes can
still complete a character the pattern allows, and any text a live state accepts is
valid UTF-8. ASCII characters are one byte each, so an ASCII pattern's NFA and DFA are
what a character DFA would build.

Supported: literals, ``.``, ``[...]`` / ``[^...]`` with ranges, ``\\d \\w \\s \\D \\W \\S``
and escaped punctuation, groups ``(...)`` / ``(?:...)``, ``|``, ``* + ?`` and ``{m}``,
``{m,}``, ``{m,n}``; ``^`` / ``$`` at the ends (the whole output must match anyway).
Anything else (backreferences, lookaround) is refused with what to use instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_REPEAT = 1000   # {m,n} is unrolled into copies: bound the NFA's size
MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)   # code points that are not characters: UTF-8 cannot encode them


@dataclass(frozen=True)
class CharSet:
    """A set of characters as sorted inclusive ranges of code points, maybe negated (``[^...]``)."""

    ranges: tuple[tuple[int, int], ...]
    negated: bool = False

    def code_point_ranges(self) -> list[tuple[int, int]]:
        """The characters in the set: sorted, disjoint ranges, negation applied, surrogates left out."""
        merged: list[tuple[int, int]] = []
        for lo, hi in sorted(self.ranges):
            if merged and lo <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
            else:
                merged.append((lo, hi))
        if self.negated:   # the gaps between the ranges, up to the last code point
            gaps, after = [], 0
            for lo, hi in merged:
                if lo > after:
                    gaps.append((after, lo - 1))
                after = hi + 1
            merged = gaps + ([(after, MAX_CODE_POINT)] if after <= MAX_CODE_POINT else [])
        first, last = SURROGATES
        return [(a, b) for lo, hi in merged
                for a, b in ((lo, min(hi, first - 1)), (max(lo, last + 1), hi)) if a <= b]

    def utf8_sequences(self) -> list[tuple[tuple[int, int], ...]]:
        """Every character of the set as byte-range chains (see ``utf8_sequences``)."""
        return [sequence for lo, hi in self.code_point_ranges() for sequence in utf8_sequences(lo, hi)]


UTF8_LENGTH_ENDS = (0x7F, 0x7FF, 0xFFFF)   # the last code point of 1-, 2- and 3-byte encodings


def utf8_sequences(lo: int, hi: int) -> list[tuple[tuple[int, int], ...]]:
    """The UTF-8 encodings of the code points ``lo..hi`` as chains of byte ranges (the
    algorithm of RE2 and of Rust's ``utf8-ranges``; surrogates must not be in the range)::

        U+0061..U+007A  a-z       [61-7A]                      1 byte
        U+00E9..U+00FF  é-ÿ       [C3][A9-BF]                  2 bytes
        U+0800..U+FFFF            [E0][A0-BF][80-BF]           3 bytes: split where the
                                  [E1-EF][80-BF][80-BF]         first byte's range changes

    A chain is right when ``lo`` and ``hi`` encode to as many bytes, and each byte after
    the first either stays fixed or runs over all of 80-BF: then the chain is simply
    (first byte of lo .. of hi), (second .. second), ... So split the range until it is."""
    for end in UTF8_LENGTH_ENDS:   # both ends must encode to the same number of bytes
        if lo <= end < hi:
            return utf8_sequences(lo, end) + utf8_sequences(end + 1, hi)
    if hi <= 0x7F:
        return [((lo, hi),)]
    for i in (1, 2, 3):   # the last i continuation bytes hold the low 6 * i bits
        low_bits = (1 << 6 * i) - 1
        if lo & ~low_bits != hi & ~low_bits:   # the bytes before them differ:
            if lo & low_bits != 0:                  # the low bytes of lo must start at 80..80
                return utf8_sequences(lo, lo | low_bits) + utf8_sequences((lo | low_bits) + 1, hi)
            if hi & low_bits != low_bits:           # and those of hi end at BF..BF
                return utf8_sequences(lo, (hi & ~low_bits) - 1) + utf8_sequences(hi & ~low_bits, hi)
    return [tuple(zip(chr(lo).encode(), chr(hi).encode()))]


def _chars(text: str) -> tuple[tuple[int, int], ...]:
    return tuple((ord(c), ord(c)) for c in text)


DIGIT = ((ord("0"), ord("9")),)
WORD = ((ord("0"), ord("9")), (ord("A"), ord("Z")), (ord("a"), ord("z")), (ord("_"), ord("_")))
SPACE = _chars(" \t\n\r\f\v")
CLASS_ESCAPES = {"d": CharSet(DIGIT), "w": CharSet(WORD), "s": CharSet(SPACE),
                 "D": CharSet(DIGIT, True), "W": CharSet(WORD, True), "S": CharSet(SPACE, True)}
CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0"}
ANY_BUT_NEWLINE = CharSet(((10, 10),), negated=True)


class RegexError(ValueError):
    pass


# ------------------------------------------------------------------ parser
class _Parser:
    """Recursive descent: alternation > concatenation > repetition > atom."""

    def __init__(self, pattern: str):
        self.pattern, self.pos = pattern, 0

    def error(self, what: str) -> RegexError:
        return RegexError(f"regex {self.pattern!r}, position {self.pos}: {what}")

    def peek(self) -> str | None:
        return self.pattern[self.pos] if self.pos < len(self.pattern) else None

    def take(self) -> str:
        ch = self.pattern[self.pos]
        self.pos += 1
        return ch

    def parse(self):
        if self.pattern.startswith("^"):
            self.pos = 1
        tree = self.alternation()
        if self.peek() == "$" and self.pos == len(self.pattern) - 1:
            self.pos += 1
        if self.pos != len(self.pattern):
            raise self.error(f"unexpected {self.peek()!r}")
        return tree

    def alternation(self):
        options = [self.concatenation()]
        while self.peek() == "|":
            self.take()
            options.append(self.concatenation())
        return ("alt", options) if len(options) > 1 else options[0]

    def concatenation(self):
        items = []
        while self.peek() not in (None, "|", ")") and not (self.peek() == "$" and self.pos == len(self.pattern) - 1):
            items.append(self.repetition())
        return ("cat", items)

    def repetition(self):
        atom = self.atom()
        while self.peek() in ("*", "+", "?", "{"):
            ch = self.take()
            if ch == "{":
                low, high = self.braces()
            else:
                low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[ch]
            if self.peek() == "?":   # lazy: the same language
                self.take()
            atom = ("repeat", atom, low, high)
        return atom

    def braces(self) -> tuple[int, int | None]:
        end = self.pattern.find("}", self.pos)
        if end < 0:
            raise self.error("'{' without '}'")
        body, self.pos = self.pattern[self.pos:end], end + 1
        low_text, comma, high_text = body.partition(",")
        try:
            low = int(low_text)
            high = low if not comma else (int(high_text) if high_text.strip() else None)
        except ValueError:
            raise self.error(f"{{{body}}} is not a repeat count") from None
        if (high is not None and high < low) or max(low, high or 0) > MAX_REPEAT:
            raise self.error(f"{{{body}}}: counts must be 0 <= m <= n <= {MAX_REPEAT}")
        return low, high

    def atom(self):
        ch = self.take()
        if ch == "(":
            if self.pattern.startswith("?:", self.pos):
                self.pos += 2
            elif self.peek() == "?":
                raise self.error("lookaround and named groups are not supported: use backend 'xgrammar'")
            inner = self.alternation()
            if self.peek() != ")":
                raise self.error("'(' without ')'")
            self.take()
            return inner
        if ch == "[":
            return ("set", self.char_class())
        if ch == ".":
            return ("set", ANY_BUT_NEWLINE)
        if ch == "\\":
            return ("set", self.escape())
        if ch in "*+?{":
            raise self.error(f"{ch!r} repeats nothing")
        if ch in ")":
            raise self.error("')' without '('")
        return ("set", CharSet(_chars(ch)))

    def escape(self) -> CharSet:
        if self.peek() is None:
            raise self.error("a pattern cannot end with '\\'")
        ch = self.take()
        if ch in CLASS_ESCAPES:
            return CLASS_ESCAPES[ch]
        if ch in CHAR_ESCAPES:
            return CharSet(_chars(CHAR_ESCAPES[ch]))
        if ch.isalnum():
            raise self.error(f"\\{ch} is not supported (backreferences, \\b, \\u...): use backend 'xgrammar'")
        return CharSet(_chars(ch))

    def char_class(self) -> CharSet:
        negated = self.peek() == "^"
        if negated:
            self.take()
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            if self.peek() is None:
                raise self.error("'[' without ']'")
            ch = self.take()
            if ch == "]" and not first:
                break
            first = False
            if ch == "\\":
                escaped = self.escape()
                if escaped.negated:
                    raise self.error("\\D, \\W, \\S inside [...] are not supported")
                if len(escaped.ranges) != 1 or escaped.ranges[0][0] != escaped.ranges[0][1]:
                    ranges.extend(escaped.ranges)
                    continue
                ch = chr(escaped.ranges[0][0])
            if self.peek() == "-" and self.pattern[self.pos + 1:self.pos + 2] not in ("]", ""):
                self.take()
                end = self.take()
                if end == "\\":
                    end = chr(self.escape().ranges[0][0])
                if ord(end) < ord(ch):
                    raise self.error(f"range {ch}-{end} is backwards")
                ranges.append((ord(ch), ord(end)))
            else:
                ranges.append((ord(ch), ord(ch)))
        return CharSet(tuple(sorted(ranges)), negated)


# --------------------------------------------------------------------- NFA
@dataclass
class NFA:
    """Thompson's NFA over bytes: ``edges[s]`` = [((lo, hi), t)]: any byte lo..hi leads
    to t; ``eps[s]`` = [t]; one accept state."""

    edges: list[list[tuple[tuple[int, int], int]]] = field(default_factory=list)
    eps: list[list[int]] = field(default_factory=list)
    start: int = 0
    accept: int = 0

    def new_state(self) -> int:
        self.edges.append([])
        self.eps.append([])
        return len(self.edges) - 1

    def build(self, tree) -> tuple[int, int]:
        """A fragment (entry, exit) for ``tree``."""
        kind = tree[0]
        if kind == "set":   # one chain of byte ranges per UTF-8 sequence, entry to exit
            entry, exit_ = self.new_state(), self.new_state()
            for sequence in tree[1].utf8_sequences():
                at = entry
                for byte_range in sequence[:-1]:
                    inner = self.new_state()
                    self.edges[at].append((byte_range, inner))
                    at = inner
                self.edges[at].append((sequence[-1], exit_))
            return entry, exit_
        if kind == "cat":
            entry = exit_ = self.new_state()
            for item in tree[1]:
                inner_entry, inner_exit = self.build(item)
                self.eps[exit_].append(inner_entry)
                exit_ = inner_exit
            return entry, exit_
        if kind == "alt":
            entry, exit_ = self.new_state(), self.new_state()
            for option in tree[1]:
                inner_entry, inner_exit = self.build(option)
                self.eps[entry].append(inner_entry)
                self.eps[inner_exit].append(exit_)
            return entry, exit_
        _, item, low, high = tree   # repeat: low copies, then (high - low) optional ones or a loop
        entry = exit_ = self.new_state()
        for _ in range(low):
            inner_entry, inner_exit = self.build(item)
            self.eps[exit_].append(inner_entry)
            exit_ = inner_exit
        if high is None:
            inner_entry, inner_exit = self.build(item)
            self.eps[exit_].append(inner_entry)
            self.eps[inner_exit].append(exit_)   # loop back
            return entry, exit_
        end = self.new_state()
        self.eps[exit_].append(end)
        for _ in range(high - low):
            inner_entry, inner_exit = self.build(item)
            self.eps[exit_].append(inner_entry)
            self.eps[inner_exit].append(end)
            exit_ = inner_exit
        return entry, end


# --------------------------------------------------------------------- DFA
class RegexDFA:
    """The lazily built DFA of ``pattern``. States are small ints; ``DEAD`` is -1."""

    DEAD = -1

    def __init__(self, pattern: str):
        if not isinstance(pattern, str):
            raise RegexError(f"regex must be a string, got {type(pattern).__name__}")
        self.pattern = pattern
        self.nfa = NFA()
        self.nfa.start, self.nfa.accept = self.nfa.build(_Parser(pattern).parse())
        self._live_nfa = self._coreachable()
        self._ids: dict[frozenset[int], int] = {}
        self._sets: list[frozenset[int]] = []
        self._moves: dict[tuple[int, int | str], int] = {}
        self.start = self._state(self._closure({self.nfa.start}))

    def _closure(self, states) -> frozenset[int]:
        stack, seen = list(states), set(states)
        while stack:
            for t in self.nfa.eps[stack.pop()]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return frozenset(seen)

    def _coreachable(self) -> set[int]:
        """NFA states from which the accept state can be reached (every byte range is
        non-empty, so any edge can be taken by some byte)."""
        reverse: list[list[int]] = [[] for _ in self.nfa.edges]
        for s, edges in enumerate(self.nfa.edges):
            for _, t in edges:
                reverse[t].append(s)
            for t in self.nfa.eps[s]:
                reverse[t].append(s)
        seen, stack = {self.nfa.accept}, [self.nfa.accept]
        while stack:
            for s in reverse[stack.pop()]:
                if s not in seen:
                    seen.add(s)
                    stack.append(s)
        return seen

    def _state(self, nfa_states: frozenset[int]) -> int:
        if not (nfa_states & self._live_nfa):
            return self.DEAD
        if nfa_states not in self._ids:
            self._ids[nfa_states] = len(self._sets)
            self._sets.append(nfa_states)
        return self._ids[nfa_states]

    def step(self, state: int, symbol: int | str) -> int:
        """The state after reading ``symbol`` (``DEAD`` if no match can follow): one byte
        (an int 0-255, as the token trie walks), or one character, read as its UTF-8
        bytes (``step(s, "é")`` is ``step(step(s, 0xC3), 0xA9)``)."""
        if state == self.DEAD:
            return self.DEAD
        key = (state, symbol)
        if key not in self._moves:
            self._moves[key] = self.walk(state, symbol) if isinstance(symbol, str) else self._move(state, symbol)
        return self._moves[key]

    def _move(self, state: int, byte: int) -> int:
        moved = {t for s in self._sets[state] for (lo, hi), t in self.nfa.edges[s] if lo <= byte <= hi}
        return self._state(self._closure(moved)) if moved else self.DEAD

    def walk(self, state: int, text: str | bytes) -> int:
        """The state after ``text``'s bytes (a ``str`` is read as UTF-8)."""
        for byte in text.encode() if isinstance(text, str) else text:
            state = self.step(state, byte)
            if state == self.DEAD:
                break
        return state

    def is_accepting(self, state: int) -> bool:
        return state != self.DEAD and self.nfa.accept in self._sets[state]

    def fullmatch(self, text: str) -> bool:
        return self.is_accepting(self.walk(self.start, text))

    @property
    def num_states(self) -> int:
        """States built so far (the DFA grows as it is used)."""
        return len(self._sets)
