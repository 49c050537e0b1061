"""Incremental detokenization: stream text while tokens arrive, one step at a time.

Decoding each new token on its own is wrong twice over:

1. One token can be *part of a character*. Byte-level BPE splits "ö" (UTF-8
   ``C3 B6``) or "🙂" (``F0 9F 99 82``) into byte tokens; decoding ``C3`` alone
   gives the replacement character "�". Those bytes must wait for the rest.
2. A token's text can depend on its left neighbour. SentencePiece writes a word
   start as "▁world"; decoded alone that is "world", after "Hello" it is " world".

So we re-decode a short window that starts a little before the new tokens and keep
only the part that is new (vLLM's ``detokenize_incrementally``)::

    output tokens:   Hel   lo   ␣w   C3   B6   r   ld
                                 ^          ^
                         prefix_offset   read_offset

    prefix_text = decode(tokens[prefix_offset:read_offset])  # already emitted, re-decoded as context
    new_text    = decode(tokens[prefix_offset:])             # the same, plus the unread tokens
    delta       = new_text[len(prefix_text):]                # emitted unless it ends in "�"

Fed one token at a time, "Hello wörld":

    token  prefix_text | new_text   delta   prefix_offset read_offset (after)
    Hel    ""   | "Hel"             "Hel"        0  1
    lo     "Hel"| "Hello"           "lo"         1  2
    ␣w     "lo" | "lo w"            " w"         2  3
    C3     " w" | " w�"             held         2  3     <- half a character: wait
    B6     " w" | " wö"             "ö"          3  5
    r      "ö"  | "ör"              "r"          5  6

Each step decodes only the window, so the cost is O(new tokens), not O(all
tokens). The window always starts on a character boundary, so the deltas add up
exactly to ``tokenizer.decode(output_token_ids)``.

vLLM also starts the window a few tokens *inside the prompt*, so that a first
SentencePiece token gets its leading space. We start at the first output token, so
that the text is what a Hugging Face ``generate`` user gets from
``tokenizer.decode(output_ids)``.

Stop strings are searched in the decoded text; see ``IncrementalDetokenizer``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from microvllm.sampling_params import SamplingParams
    from microvllm.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"  # what UTF-8 decoding gives for an incomplete byte sequence


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas, and finds its stop strings.

    Call ``update(new_token_ids)`` once per engine step; it returns the text that is
    safe to show now ("" if none). Text is held back for two reasons:

    - an incomplete UTF-8 character (see the module docstring);
    - the last ``len(longest stop string) - 1`` characters, which might be the start
      of a stop string whose end has not been generated yet::

        stop = ["Paris"]            stop_buffer_length = 4
        output_text = "The capital is Par"
                       |<-- emitted -->|Par    <- "Par" may become "Paris": hold it

    When a stop string appears (also across token boundaries: "Pa" + "ris"), the
    text is cut just before it (or just after it, with
    ``include_stop_str_in_output``), ``finished`` becomes True and ``stop_reason``
    is that string. Nothing after a stop string is ever emitted. Pass
    ``finished=True`` on the step the engine ends the request (eos, max_tokens, a
    stop token id) to flush whatever was still held back.
    """

    def __init__(self, tokenizer: "Tokenizer", prompt_token_ids: list[int], *,
                 skip_special_tokens: bool = True, stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False, min_tokens: int = 0):
        self.tokenizer = tokenizer
        # Kept for the reader: vLLM uses the prompt's tail as decoding context (see
        # the module docstring for why we don't).
        self.prompt_token_ids = list(prompt_token_ids)
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens  # stop strings only count after this many tokens

        self.output_token_ids: list[int] = []
        self.output_text = ""       # all text decoded so far (cut at a stop string)
        self.prefix_offset = 0      # window start: first token of the last emitted chunk
        self.read_offset = 0        # first token whose text has not been emitted yet
        # Characters of output_text that may still be the start of a stop string.
        # With include_stop_str_in_output the prefix is shown either way: no need to wait.
        self.stop_buffer_length = (max(len(s) for s in self.stop) - 1
                                   if self.stop and not include_stop_str_in_output else 0)
        self._num_emitted_chars = 0  # output_text[:_num_emitted_chars] has been returned

        self.finished = False
        self.stop_reason: str | None = None

    @classmethod
    def from_sampling_params(cls, tokenizer: "Tokenizer", prompt_token_ids: list[int],
                             params: "SamplingParams") -> "IncrementalDetokenizer":
        """The detokenizer for a request with these sampling parameters."""
        return cls(tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                   stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
                   min_tokens=params.min_tokens)

    def update(self, new_token_ids: list[int], *, finished: bool = False,
               stop_terminated: bool = False) -> str:
        """Append this step's tokens; return the newly safe text ("" if none yet).

        ``finished``: the engine ends the request after these tokens; flush every
        held-back character. ``stop_terminated``: the last token is an eos or a stop
        token id; like vLLM, its text is left out (unless
        ``include_stop_str_in_output``). It implies ``finished``.
        """
        if self.finished:
            raise RuntimeError(
                f"update() called after the request finished (stop_reason={self.stop_reason!r}): "
                "the engine must stop feeding tokens to a finished request")
        new_token_ids = list(new_token_ids)
        skipped_stop_token = None
        if stop_terminated and new_token_ids and not self.include_stop_str_in_output:
            skipped_stop_token = new_token_ids.pop()

        # 1) Decode the new tokens one by one, as if they had arrived separately.
        search_start = len(self.output_text)
        for token_id in new_token_ids:
            self.output_token_ids.append(token_id)
            self.output_text += self._decode_next()
            if len(self.output_token_ids) <= self.min_tokens:
                search_start = len(self.output_text)  # too early for stop strings
        if finished or stop_terminated:
            self.output_text += self._flush()
        if skipped_stop_token is not None:
            self.output_token_ids.append(skipped_stop_token)

        # 2) Look for a stop string in the new text (and the few characters before it).
        match = find_stop_string(self.output_text, len(self.output_text) - search_start, self.stop)
        if match is not None:
            self.stop_reason, stop_index = match
            end = stop_index + len(self.stop_reason) if self.include_stop_str_in_output else stop_index
            self.output_text = self.output_text[:end]
            self.finished = True
        if finished or stop_terminated:
            self.finished = True

        # 3) Emit what can no longer change.
        return self._next_delta()

    def _decode_next(self) -> str:
        """Text added by the tokens at read_offset.. ("" while a character is incomplete)."""
        ### BEGIN SOLUTION
        tokens = self.output_token_ids
        prefix_text = self._decode(tokens[self.prefix_offset:self.read_offset])
        new_text = self._decode(tokens[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            # Nothing yet (a skipped special token), or half a character: keep the
            # offsets and decode these tokens again together with the next ones.
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(tokens)
        return new_text[len(prefix_text):]
        ### END SOLUTION

    def _flush(self) -> str:
        """The held-back text, final at the end even if it ends in "�" (bytes that are not UTF-8)."""
        ### BEGIN SOLUTION
        tokens = self.output_token_ids
        prefix_text = self._decode(tokens[self.prefix_offset:self.read_offset])
        new_text = self._decode(tokens[self.prefix_offset:])
        self.prefix_offset, self.read_offset = self.read_offset, len(tokens)
        return new_text[len(prefix_text):]
        ### END SOLUTION

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _next_delta(self) -> str:
        """output_text minus what was already returned, minus the stop-string buffer."""
        end = len(self.output_text) - (0 if self.finished else self.stop_buffer_length)
        if end <= self._num_emitted_chars:
            return ""
        delta = self.output_text[self._num_emitted_chars:end]
        self._num_emitted_chars = end
        return delta


def find_stop_string(output_text: str, new_char_count: int,
                     stop: list[str]) -> tuple[str, int] | None:
    """The earliest stop string that ends in the last ``new_char_count`` characters.

    Returns ``(stop_string, index where it starts)`` or None. Older text was searched
    on earlier steps, so the search starts ``len(stop_string) - 1`` characters before
    the new text: a stop string may straddle old and new ("Pa" + "ris").
    """
    ### BEGIN SOLUTION
    if new_char_count <= 0 or not stop:
        return None
    best: tuple[str, int] | None = None
    for stop_string in stop:
        start = max(0, len(output_text) - new_char_count - len(stop_string) + 1)
        index = output_text.find(stop_string, start)
        if index != -1 and (best is None or index < best[1]):
            best = (stop_string, index)
    return best
    ### END SOLUTION
