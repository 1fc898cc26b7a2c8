"""vLLM's `allowed_token_ids` and `bad_words`: tokens a request may not sample next.

`allowed_token_ids` keeps only the listed tokens. `bad_words` bans each word as the tokenizer
writes it, both alone and after a space (a word mid-sentence is usually its spaced form): a
one-token word is never sampled, and the last token of a longer one is banned whenever the
tokens generated so far end with the rest of it. vLLM adds the spaced form only when it has as
many tokens as the bare one; kvserve bans both forms whenever they differ. Like vLLM, the match
looks at generated tokens only, not at the prompt.
"""
from __future__ import annotations

from typing import Protocol, Sequence


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def bad_word_sequences(tokenizer: _Encoder, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token sequences (bare and after a space), duplicates dropped."""
    sequences: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                sequences[ids] = None
    return tuple(sequences)


def banned_next(sequences: Sequence[tuple[int, ...]], output_token_ids: Sequence[int]) -> list[int]:
    """The tokens that would complete a bad word after `output_token_ids`."""
    banned = []
    for seq in sequences:
        before = len(seq) - 1
        if before == 0 or (len(output_token_ids) >= before
                           and tuple(output_token_ids[len(output_token_ids) - before:]) == seq[:-1]):
            banned.append(seq[-1])
    return banned
