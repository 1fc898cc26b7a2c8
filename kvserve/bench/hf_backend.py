"""The Hugging Face transformers baseline: the same checkpoint, dtype and device as kvserve, run
with `model.generate` on static batches (how one serves without a paged KV cache)."""
from __future__ import annotations

import time
from typing import Any

import torch


def load_hf_model(model: str | None, dtype: torch.dtype, device: torch.device) -> Any:
    """`AutoModelForCausalLM` for what kvserve would load for `model` (GGUF weights dequantized
    by transformers itself)."""
    from transformers import AutoModelForCausalLM

    from kvserve.model.loader import resolve_model_path

    path = resolve_model_path(model)
    if path.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return hf.to(device).eval()


def pad_token_id(tokenizer: Any) -> int:
    """The id to left-pad with: the tokenizer's pad token, else its end-of-sequence token."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pad if pad is not None else 0)


def sync(device: torch.device) -> None:
    """Wait for queued device work so that wall-clock timings are complete (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HFGenerator:
    """Greedy `generate` on left-padded batches with end-of-sequence suppressed
    (`min_new_tokens`), so every request runs to the length it asked for."""

    def __init__(self, model: Any, pad_token_id: int):
        self.model = model
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int) -> torch.Tensor:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt):] = 1
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                      do_sample=False, pad_token_id=self.pad_token_id)
        sync(self.device)
        return out[:, width:]

    def run(self, prompts: list[list[int]], output_lens: list[int], batch_size: int) -> float:
        """Seconds to serve all requests in arrival order, `batch_size` at a time; each batch
        generates to its longest requested output (the shorter requests' extra tokens are waste
        a static batch cannot avoid, and are not counted as output)."""
        start = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            self.generate_batch(prompts[i:i + batch_size], max(output_lens[i:i + batch_size]))
        return time.perf_counter() - start
