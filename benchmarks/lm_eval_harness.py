"""lm-evaluation-harness against `kvserve serve`, checked item by item against HF transformers.

lm-eval's `local-completions` model drives a kvserve server (started here, `--dtype float32`) on
two local tasks under benchmarks/lm_eval_tasks/ (no download: the data are files written for
this benchmark): `kvserve_mc`, two-choice log-likelihood (the server's prompt logprobs, asked for
as completions with echo + logprobs), and `kvserve_gen`, greedy generate_until. HF transformers
then scores the very token sequences lm-eval sent (its own `_encode_pair` / `tok_encode`) with the
same weights at float32: per item, both pick the same choice, except where HF's two
log-likelihoods differ by less than 1e-3 (a tie at this precision), and the greedy answers match.

Needs the optional extra: `pip install -e '.[lm-eval]'`. Runs offline (HF_HUB_OFFLINE=1; lm-eval
reads the tokenizer from a directory saved here from the default model). Results go to
benchmarks/results/lm_eval_harness.json and are recorded in BENCHMARKS.md.

    flock /tmp/kvserve-heavy.lock python benchmarks/lm_eval_harness.py
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

from kvserve.bench.launcher import kvserve_serve_command, running_server  # noqa: E402
from kvserve.model.loader import resolve_model_path  # noqa: E402

TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
RESULTS = Path(__file__).resolve().parent / "results" / "lm_eval_harness.json"
TIE = 1e-3  # choices whose HF log-likelihoods differ by less than this are ties
SERVED_NAME = "smollm2"


def save_tokenizer(model_path: Path, directory: Path) -> None:
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name).save_pretrained(directory)


def run_lm_eval(base_url: str, tokenizer_dir: Path, max_length: int):
    """simple_evaluate with local-completions; returns (the LM object, lm-eval's results)."""
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    lm = get_model("local-completions")(
        base_url=f"{base_url}/v1/completions", model=SERVED_NAME, tokenizer=str(tokenizer_dir),
        tokenizer_backend="huggingface", tokenized_requests=True, max_length=max_length, num_concurrent=1,
        max_retries=1)
    cwd = os.getcwd()
    os.chdir(TASKS_DIR)  # the task files name their data relative to their folder
    try:
        results = lm_eval.simple_evaluate(model=lm, tasks=["kvserve_mc", "kvserve_gen"],
                                          task_manager=TaskManager(include_path=str(TASKS_DIR)),
                                          log_samples=True, random_seed=0, numpy_random_seed=0,
                                          torch_random_seed=0, fewshot_random_seed=0)
    finally:
        os.chdir(cwd)
    return lm, results


def hf_loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logprobs = model(ids).logits[0].float().log_softmax(-1)
    rows = logprobs[len(context) - 1:-1]
    return float(rows.gather(1, torch.tensor(continuation)[:, None]).sum())


def hf_greedy(model, tokenizer, prompt: list[int], until: list[str], max_new_tokens: int) -> str:
    """Greedy decoding with a full forward pass per token, ending at EOS or cut at the first stop
    string (as the server does, which also leaves special tokens out of the text)."""
    ids = list(prompt)
    text = ""
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            if token == tokenizer.eos_token_id:
                break
            ids.append(token)
            text = tokenizer.decode(ids[len(prompt):], skip_special_tokens=True)
            if any(stop in text for stop in until):
                break
    for stop in until:
        text = text.split(stop)[0]
    return text


def compare_multiple_choice(lm, samples: list[dict], hf) -> dict:
    items, ties, agree, kvserve_correct, hf_correct, max_diff = [], 0, 0, 0, 0, 0.0
    for sample in sorted(samples, key=lambda s: s["doc_id"]):
        pairs = [(a["arg_0"], a["arg_1"]) if isinstance(a, dict) else tuple(a) for a in sample["arguments"]]
        ours = [float(r[0][0]) for r in sample["resps"]]
        ref = [hf_loglikelihood(hf, *lm._encode_pair(context, continuation)) for context, continuation in pairs]
        max_diff = max(max_diff, *(abs(a - b) for a, b in zip(ours, ref)))
        tie = abs(ref[0] - ref[1]) < TIE
        same = int(max(range(2), key=ours.__getitem__)) == int(max(range(2), key=ref.__getitem__))
        target = int(sample["target"])
        ties += tie
        agree += same or tie
        kvserve_correct += max(range(2), key=ours.__getitem__) == target
        hf_correct += max(range(2), key=ref.__getitem__) == target
        items.append({"doc_id": sample["doc_id"], "kvserve": ours, "hf": ref, "tie": tie, "same_choice": same})
    n = len(items)
    return {"items": n, "kvserve_acc": kvserve_correct / n, "hf_acc": hf_correct / n,
            "agree": agree, "ties": ties, "disagree": n - agree, "max_abs_loglikelihood_diff": max_diff,
            "per_item": items}


def compare_generation(lm, samples: list[dict], hf, tokenizer) -> dict:
    items, same, hf_correct = [], 0, 0
    for sample in sorted(samples, key=lambda s: s["doc_id"]):
        argument = sample["arguments"][0]
        context, gen_kwargs = ((argument["arg_0"], argument["arg_1"]) if isinstance(argument, dict)
                               else tuple(argument))
        ours = sample["resps"][0][0]
        ref = hf_greedy(hf, tokenizer, lm.tok_encode(context), gen_kwargs["until"], gen_kwargs["max_gen_toks"])
        same += ours == ref
        answer = ref.strip().lower().strip(".!,")
        hf_correct += answer == sample["target"].strip().lower()
        items.append({"doc_id": sample["doc_id"], "kvserve": ours, "hf": ref})
    return {"items": len(items), "same_text": same, "hf_exact_match": hf_correct / len(items), "per_item": items}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_path = resolve_model_path(None)
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = Path(tmp) / "tokenizer"
        save_tokenizer(model_path, tokenizer_dir)
        serve_args = [str(model_path), "--dtype", "float32", "--max-model-len", str(args.max_model_len),
                      "--served-model-name", SERVED_NAME]
        with running_server(kvserve_serve_command, serve_args, Path(tmp) / "server.log", timeout=300) as base_url:
            lm, results = run_lm_eval(base_url, tokenizer_dir, args.max_model_len)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    lm_eval_seconds = time.time() - started
    hf = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name,
                                              dtype=torch.float32).eval()
    mc = compare_multiple_choice(lm, results["samples"]["kvserve_mc"], hf)
    gen = compare_generation(lm, results["samples"]["kvserve_gen"], hf, tokenizer)
    import lm_eval

    summary = {
        "command": "flock /tmp/kvserve-heavy.lock python benchmarks/lm_eval_harness.py",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "lm_eval": getattr(lm_eval, "__version__", "?"), "date": time.strftime("%Y-%m-%d"),
        "server": "kvserve serve " + " ".join(serve_args[1:]),
        "lm_eval_results": {task: {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
                            for task, metrics in results["results"].items()},
        "lm_eval_seconds": round(lm_eval_seconds, 1),
        "multiple_choice": mc, "generate_until": gen,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("multiple_choice", "generate_until")}, indent=1))
    print(f"kvserve_mc: {mc['items']} items, acc kvserve {mc['kvserve_acc']:.3f} / HF {mc['hf_acc']:.3f}; "
          f"same choice on {mc['agree']} (ties < {TIE}: {mc['ties']}), disagree {mc['disagree']}; "
          f"max |Δ log-likelihood| {mc['max_abs_loglikelihood_diff']:.2e}")
    print(f"kvserve_gen: {gen['items']} items, same greedy text on {gen['same_text']}; "
          f"HF exact match {gen['hf_exact_match']:.3f}")
    return 0 if mc["disagree"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
