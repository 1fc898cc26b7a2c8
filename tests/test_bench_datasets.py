"""`kvserve bench` workloads: lengths within the asked range, seeded reproducibility, shared
prefixes that really are shared, ShareGPT parsing and the synthetic ShareGPT length law."""
import argparse
import json

import numpy as np
import pytest

from kvserve.bench.datasets import (BOOK_PATH, SHAREGPT_MAX_PROMPT_LEN, SHAREGPT_MAX_TOTAL_LEN, SHAREGPT_MEAN_INPUT,
                                    SHAREGPT_MEAN_OUTPUT, SHAREGPT_MIN_LEN, LengthRange, add_dataset_args,
                                    book_dataset, build_dataset, prefix_repetition_dataset, random_dataset,
                                    sharegpt_file_dataset, sharegpt_lengths, synthetic_sharegpt_dataset)


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_length_range_parsing():
    assert LengthRange.parse("100", 0.5) == LengthRange(50, 150)
    assert LengthRange.parse("128") == LengthRange(128, 128)
    assert LengthRange.parse("32:512", 0.9) == LengthRange(32, 512)  # an explicit range ignores the ratio
    for bad in ("abc", "10:5", "-3", "1:x"):
        with pytest.raises(ValueError):
            LengthRange.parse(bad)
    with pytest.raises(ValueError, match="range-ratio"):
        LengthRange.parse("100", 1.0)


def test_random_lengths_in_range_and_token_counts_true(tiny_tokenizer):
    reqs = random_dataset(tiny_tokenizer, 60, LengthRange(20, 80), LengthRange(5, 9), prefix_len=16, seed=3)
    assert len(reqs) == 60
    for r in reqs:
        assert 16 + 20 <= r.prompt_len <= 16 + 80
        assert r.prompt_len == len(encode(tiny_tokenizer, r.prompt))
        assert 5 <= r.expected_output_len <= 9
    prefix = reqs[0].prompt[:20]
    assert all(r.prompt.startswith(prefix) for r in reqs)  # the shared prefix is byte-identical
    assert len({r.prompt_len for r in reqs}) > 10  # lengths really vary


def test_random_is_reproducible_per_seed(tiny_tokenizer):
    a = random_dataset(tiny_tokenizer, 10, LengthRange(10, 30), LengthRange(4, 8), seed=7)
    b = random_dataset(tiny_tokenizer, 10, LengthRange(10, 30), LengthRange(4, 8), seed=7)
    c = random_dataset(tiny_tokenizer, 10, LengthRange(10, 30), LengthRange(4, 8), seed=8)
    assert a == b
    assert [r.prompt for r in a] != [r.prompt for r in c]


def test_random_never_emits_special_tokens(tiny_tokenizer):
    reqs = random_dataset(tiny_tokenizer, 20, LengthRange(50, 50), LengthRange(1, 1), seed=1)
    specials = set(tiny_tokenizer.all_special_ids)
    assert all(not specials & set(encode(tiny_tokenizer, r.prompt)) for r in reqs)


def test_prefix_repetition_shares_exactly_num_prefixes(tiny_tokenizer):
    reqs = prefix_repetition_dataset(tiny_tokenizer, 24, prefix_len=40, suffix_len=12, num_prefixes=3,
                                     output_len=7, seed=5)
    assert len(reqs) == 24
    heads = {tuple(encode(tiny_tokenizer, r.prompt)[:38]) for r in reqs}
    assert len(heads) == 3
    assert all(r.prompt_len == 52 and r.expected_output_len == 7 for r in reqs)
    # shuffled: the first three requests do not simply cycle through the prefixes in order
    order = [tuple(encode(tiny_tokenizer, r.prompt)[:38]) for r in reqs]
    assert order != [order[i % 3] for i in range(24)]
    assert reqs == prefix_repetition_dataset(tiny_tokenizer, 24, 40, 12, 3, 7, seed=5)
    with pytest.raises(ValueError, match="num-prefixes"):
        prefix_repetition_dataset(tiny_tokenizer, 4, 8, 8, 0, 4)


def test_book_spans_are_text_of_the_book(tiny_tokenizer, tmp_path):
    book = BOOK_PATH.read_text(encoding="utf-8")
    reqs = book_dataset(tiny_tokenizer, 12, LengthRange(30, 90), LengthRange(16, 16), seed=2)
    for r in reqs:
        assert r.prompt in book
        assert 30 <= r.prompt_len <= 90 and r.expected_output_len == 16
    own = tmp_path / "notes.txt"
    own.write_text("alpha beta gamma delta " * 200)
    reqs = book_dataset(tiny_tokenizer, 3, LengthRange(10, 10), LengthRange(4, 4), path=own, seed=0)
    assert all(r.prompt in own.read_text() and r.prompt_len == 10 for r in reqs)
    with pytest.raises(FileNotFoundError):
        book_dataset(tiny_tokenizer, 1, LengthRange(5, 5), LengthRange(4, 4), path=tmp_path / "missing.txt")


def test_sharegpt_file_first_turn_and_filters(tiny_tokenizer, tmp_path):
    long_prompt = "word " * 1500
    data = [
        {"conversations": [{"from": "human", "value": "Tell me about the weather in Paris today."},
                           {"from": "gpt", "value": "It is sunny and warm, with a light breeze from the west."}]},
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there, how are you?"}]},
        {"conversations": [{"from": "human", "value": "only one turn here"}]},
        {"conversations": [{"from": "human", "value": long_prompt}, {"from": "gpt", "value": "ok ok ok ok ok"}]},
        {"conversations": [{"from": "human", "value": "Name three rivers in England, please."},
                           {"from": "gpt", "value": "The Thames, the Severn and the Trent."}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = sharegpt_file_dataset(tiny_tokenizer, path, num_prompts=10, seed=0)
    prompts = {r.prompt for r in reqs}
    assert prompts == {data[0]["conversations"][0]["value"], data[4]["conversations"][0]["value"]}
    for r in reqs:
        reply = next(d["conversations"][1]["value"] for d in data if d["conversations"][0]["value"] == r.prompt)
        assert r.expected_output_len == len(encode(tiny_tokenizer, reply))
    fixed = sharegpt_file_dataset(tiny_tokenizer, path, num_prompts=1, output_len=50, seed=0)
    assert len(fixed) == 1 and fixed[0].expected_output_len == 50
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a ShareGPT"):
        sharegpt_file_dataset(tiny_tokenizer, tmp_path / "bad.json", 1)
    with pytest.raises(FileNotFoundError):
        sharegpt_file_dataset(tiny_tokenizer, tmp_path / "none.json", 1)


def test_synthetic_sharegpt_follows_published_means():
    lengths = sharegpt_lengths(np.random.default_rng(0), 20_000)
    prompts = np.array([p for p, _ in lengths])
    outputs = np.array([o for _, o in lengths])
    assert prompts.min() >= SHAREGPT_MIN_LEN and prompts.max() <= SHAREGPT_MAX_PROMPT_LEN
    assert outputs.min() >= SHAREGPT_MIN_LEN and (prompts + outputs).max() <= SHAREGPT_MAX_TOTAL_LEN
    # the clipping of the tails moves the means a little; the published means are the target
    assert abs(prompts.mean() / SHAREGPT_MEAN_INPUT - 1) < 0.1
    assert abs(outputs.mean() / SHAREGPT_MEAN_OUTPUT - 1) < 0.1
    assert np.median(prompts) < prompts.mean()  # a long right tail, like the real histograms


def test_synthetic_sharegpt_requests(tiny_tokenizer):
    reqs = synthetic_sharegpt_dataset(tiny_tokenizer, 20, seed=4)
    assert len(reqs) == 20
    assert all(SHAREGPT_MIN_LEN <= r.prompt_len <= SHAREGPT_MAX_PROMPT_LEN for r in reqs)
    assert reqs == synthetic_sharegpt_dataset(tiny_tokenizer, 20, seed=4)


@pytest.mark.parametrize("name", ["random", "prefix-repetition", "sharegpt", "book"])
def test_build_dataset_from_cli_flags(tiny_tokenizer, name):
    parser = argparse.ArgumentParser()
    add_dataset_args(parser)
    own = {"random": ["--random-input-len", "24", "--random-output-len", "6"],
           "prefix-repetition": ["--prefix-repetition-prefix-len", "16", "--prefix-repetition-suffix-len", "8",
                                 "--prefix-repetition-num-prefixes", "2"],
           "sharegpt": [], "book": ["--book-input-len", "20:40"]}[name]
    args = parser.parse_args(["--dataset-name", name, "--num-prompts", "5", *own])
    reqs = build_dataset(args, tiny_tokenizer)
    assert len(reqs) == 5 and all(r.prompt and r.prompt_len > 0 and r.expected_output_len > 0 for r in reqs)


def test_build_dataset_rejects_bad_counts(tiny_tokenizer):
    parser = argparse.ArgumentParser()
    add_dataset_args(parser)
    with pytest.raises(ValueError, match="num-prompts"):
        build_dataset(parser.parse_args(["--num-prompts", "0"]), tiny_tokenizer)
