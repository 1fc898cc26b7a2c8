"""Incremental detokenization with stop strings.

Decoding only a sliding window of recent tokens keeps the cost per token constant; a window
that ends in U+FFFD is an incomplete multi-byte character and waits for the next token. Text that
could be the start of a stop string is held back until it is known not to be one, so a stream
never shows text that the final answer drops.

With a fast tokenizer the window is kept by the tokenizers library's own `DecodeStream` (the same
rule, one call into Rust per token instead of two decodes, as vLLM's fast detokenizer does); the
Python window remains for other tokenizers, for a prompt that ends inside a character, and as the
fallback if the stream ever raises.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens decoded as left context: SentencePiece-style tokenizers render a leading space
# differently at the start of a string than after other tokens.
_CONTEXT_TOKENS = 6


def rust_tokenizer(tokenizer: Any) -> Tokenizer | None:
    """A fast tokenizer's Rust `Tokenizer`, when decoding with it directly gives `tokenizer.decode`'s
    text (HF's wrapper adds nothing without clean-up of spaces); else None."""
    backend = getattr(tokenizer, "_tokenizer", None)  # a PreTrainedTokenizerFast's own
    if isinstance(backend, Tokenizer) and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return backend
    return None


def ids_decoder(tokenizer: Any) -> Callable[[list[int], bool], str]:
    """`tokenizer.decode(ids, skip_special_tokens=...)`, calling a fast tokenizer's Rust decoder
    directly when HF's wrapper would add nothing: the wrapper's argument conversion costs several
    times the decode itself."""
    backend = rust_tokenizer(tokenizer)
    if backend is not None:
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


class IncrementalDetokenizer:
    """`min_tokens`: stop strings are looked for once more than that many tokens are generated
    (vLLM's rule: the text of those tokens cannot end the sequence, a stop string completed by a
    later token can, even one that began inside it)."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: list[str],
                 include_stop_str_in_output: bool, skip_special_tokens: bool, min_tokens: int = 0):
        self.tokenizer = tokenizer
        self._decode_ids = ids_decoder(tokenizer)
        self.tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.skip_special = skip_special_tokens
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # the output text so far (after any stop-string truncation)
        self.stop_string: str | None = None
        self.min_tokens = min_tokens
        self.generated = 0
        self._rust = rust_tokenizer(tokenizer)
        self._stream: DecodeStream | None = None
        # The stream reads the same window, unless the prompt ends inside a character: its window
        # would then give that character's bytes to the output, where the Python one drops them.
        if self._rust is not None and not self._decode(self.tokens).endswith("\ufffd"):
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            try:
                for token_id in self.tokens:
                    self._stream.step(self._rust, token_id)
            except Exception:  # the prompt's own text is rewritten as it goes (see _stream_text)
                self._stream = None

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, self.skip_special)

    def add_token(self, token_id: int) -> None:
        """Append one generated token; sets `stop_string` if a stop string completed."""
        self.tokens.append(token_id)
        self.generated += 1
        new_text = self._stream_text(token_id) if self._stream is not None else self._window_text()
        if new_text is None:
            return
        start = max(0, len(self.text) - self.hold_back)
        self.text += new_text
        if self.generated <= self.min_tokens:
            return
        for stop in self.stop:
            index = self.text.find(stop, start)
            if index != -1:
                self.stop_string = stop
                self.text = self.text[: index + len(stop) if self.include_stop else index]
                return

    def _window_text(self) -> str | None:
        """The text the last token completed, decoding the window in Python; None while it ends
        inside a character (or adds nothing)."""
        before = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        after = self._decode(self.tokens[self.prefix_offset:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return None
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return after[len(before):]

    def _stream_text(self, token_id: int) -> str | None:
        """`_window_text` from the Rust stream, which keeps the same window: the offsets move with
        each text it gives, so the Python window can take over where the stream raises (the
        library refuses a decode that rewrites text it already gave)."""
        try:
            text = self._stream.step(self._rust, token_id)
        except Exception:
            self._stream = None
            return self._window_text()
        if text:
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return text or None

    def visible_text(self, finished: bool) -> str:
        """The output text safe to show: while unfinished, a tail that may begin a stop string is
        withheld. Grows monotonically, so a stream can send the difference."""
        if finished or not self.stop:
            return self.text
        return self.text[: max(0, len(self.text) - self.hold_back)]
