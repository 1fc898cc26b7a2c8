"""llama.cpp's perplexity on the windows `kvserve eval` scores, to set kvserve's quantized weights
against the engine they came from.

The same token ids (kvserve's tokenizer, `kvserve eval`'s windows: `--context-len` tokens of context,
then `--score-len` scored predictions, from the start of the text) go through llama-cpp-python with
every position's logits kept; perplexity is exp of the mean negative log-likelihood of the scored
tokens, as `kvserve eval` computes it. Prints one line of JSON.

    python benchmarks/llama_cpp_perplexity.py --threads 2
"""
from __future__ import annotations

import argparse
import json
import math

import numpy as np
import torch

from kvserve.eval.perplexity import ScoringConfig, make_windows
from kvserve.eval.runner import DEFAULT_TEXT, read_text
from kvserve.model.loader import load_model, resolve_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--text", default=str(DEFAULT_TEXT))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    d = ScoringConfig()
    parser.add_argument("--num-tokens", type=int, default=d.num_tokens)
    parser.add_argument("--context-len", type=int, default=d.context_len)
    parser.add_argument("--score-len", type=int, default=d.score_len)
    args = parser.parse_args()
    import llama_cpp

    config = ScoringConfig(args.num_tokens, args.context_len, args.score_len)
    tokenizer = load_model(args.model).tokenizer
    windows = make_windows(tokenizer.encode(read_text(args.text), add_special_tokens=False), config)
    length = args.context_len + args.score_len
    llama = llama_cpp.Llama(model_path=str(resolve_model_path(args.model)), n_ctx=length, n_batch=length,
                            n_ubatch=length, logits_all=True, n_threads=args.threads, verbose=False)
    nll, count = 0.0, 0
    for window in windows:
        llama.reset()
        llama.eval(window)
        logits = np.asarray(llama.scores[args.context_len - 1:len(window) - 1], dtype=np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        logprobs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        targets = np.asarray(window[args.context_len:])
        nll -= float(logprobs[np.arange(len(targets)), targets].sum())
        count += len(targets)
    print(json.dumps({"engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})",
                      "perplexity": math.exp(nll / count), "scored_tokens": count}))


if __name__ == "__main__":
    main()
