"""The incremental detokenizer (kvserve/engine/detokenizer.py): with a fast tokenizer it reads
tokens through the tokenizers library's DecodeStream; its text must be the Python window's, token
for token, whatever the ids (special tokens, bytes that never complete a character, a prompt that
ends inside one), for byte-level BPE (GPT-2's, SmolLM2's) and SentencePiece-style byte fallback
(Llama-2's), and the Python window must take over where the stream raises."""
from __future__ import annotations

import random

import pytest

from kvserve.engine.detokenizer import IncrementalDetokenizer


def _random_ids(rng: random.Random, tokenizer, count: int) -> list[int]:
    specials = list(tokenizer.all_special_ids)
    return [rng.choice(specials) if rng.random() < 0.05 else rng.randrange(len(tokenizer)) for _ in range(count)]


def _texts(tokenizer, prompt: list[int], generated: list[int], skip: bool, stop: list[str]) -> tuple[list[str], list[str]]:
    """The text after each token, through the stream and through the Python window."""
    streamed = IncrementalDetokenizer(tokenizer, prompt, stop, False, skip)
    windowed = IncrementalDetokenizer(tokenizer, prompt, stop, False, skip)
    windowed._stream = None
    texts: tuple[list[str], list[str]] = ([], [])
    for token in generated:
        for detokenizer, seen in zip((streamed, windowed), texts):
            if detokenizer.stop_string is None:
                detokenizer.add_token(token)
            seen.append(detokenizer.visible_text(False))
    assert streamed.stop_string == windowed.stop_string
    return texts


@pytest.fixture(scope="module")
def default_tokenizer():
    from kvserve.model.loader import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    from tiny_models import build_sentencepiece_tokenizer

    return build_sentencepiece_tokenizer()


@pytest.mark.parametrize("which", ["tiny_tokenizer", "default_tokenizer", "sentencepiece_tokenizer"])
def test_the_stream_gives_the_python_windows_text_token_for_token(which, request):
    """(With byte fallback the library can refuse a prompt's own tokens while the stream is primed
    with them: the Python window then serves that request.)"""
    tokenizer = request.getfixturevalue(which)
    assert IncrementalDetokenizer(tokenizer, [], [], False, True)._stream is not None  # the fast path is taken
    rng = random.Random(0)
    used_stream = 0
    for _ in range(400):
        ids = _random_ids(rng, tokenizer, rng.randrange(2, 40))
        cut = rng.randrange(0, 8)
        stop = [tokenizer.decode(ids[cut + 3:cut + 5])] if rng.random() < 0.3 else []
        for skip in (True, False):
            streamed, windowed = _texts(tokenizer, ids[:cut], ids[cut:], skip, stop)
            assert streamed == windowed
            used_stream += IncrementalDetokenizer(tokenizer, ids[:cut], [], False, skip)._stream is not None
    assert used_stream > 400  # most prompts do not end inside a character


def test_a_readable_text_streams_whole(tiny_tokenizer):
    prompt = tiny_tokenizer.encode("It is a truth universally")
    generated = tiny_tokenizer.encode(" acknowledged, that a single man in possession of a good fortune")
    detokenizer = IncrementalDetokenizer(tiny_tokenizer, prompt, [], False, True)
    for token in generated:
        detokenizer.add_token(token)
    assert detokenizer.text == " acknowledged, that a single man in possession of a good fortune"


class _FailingStream:
    """Raises from its `fail_at`-th step on, as DecodeStream does on a decode that rewrites text it gave."""

    def __init__(self, stream, fail_at: int):
        self.stream, self.fail_at, self.calls = stream, fail_at, 0

    def step(self, tokenizer, token_id):
        self.calls += 1
        if self.calls >= self.fail_at:
            raise Exception("Invalid prefix encountered")
        return self.stream.step(tokenizer, token_id)


def test_the_python_window_takes_over_where_the_stream_raises(tiny_tokenizer):
    rng = random.Random(1)
    for trial in range(200):
        ids = _random_ids(rng, tiny_tokenizer, rng.randrange(4, 30))
        prompt, generated = ids[:3], ids[3:]
        reference = IncrementalDetokenizer(tiny_tokenizer, prompt, [], False, True)
        reference._stream = None
        failing = IncrementalDetokenizer(tiny_tokenizer, prompt, [], False, True)
        if failing._stream is None:
            continue
        failing._stream = _FailingStream(failing._stream, fail_at=rng.randrange(1, len(generated) + 1))
        for token in generated:
            reference.add_token(token)
            failing.add_token(token)
        assert failing._stream is None  # it stopped using the stream
        assert failing.text == reference.text
