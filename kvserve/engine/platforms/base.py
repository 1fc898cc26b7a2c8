"""The platform interface: the start-up decisions that depend on the device type."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvserve.engine.args import EngineArgs
    from kvserve.engine.model_runner import ModelRunner
    from kvserve.model.attention import AttentionBackend
    from kvserve.model.llama import LlamaForCausalLM


@dataclass(frozen=True)
class BatchLimits:
    """A platform's default step limits, and why (for the start-up log)."""
    max_num_seqs: int
    max_num_batched_tokens: int
    why: str


class Platform:
    name: str = "abstract"

    def auto_dtype(self, device: torch.device) -> tuple[torch.dtype, str]:
        """The model dtype `--dtype auto` means here, and why (for the start-up log)."""
        raise NotImplementedError

    def batch_limits(self, device: torch.device, serving: bool) -> BatchLimits:
        """--max-num-seqs and --max-num-batched-tokens where they are not given; `serving`: for
        `kvserve serve` rather than offline use."""
        raise NotImplementedError

    def kv_budget_before_load(self, args: EngineArgs, budget: int | None, device: torch.device) -> int | None:
        """The KV budget in bytes known before the weights load: `budget` (--kv-cache-memory,
        parsed) checked against the device, or the platform's default; None when only a
        measurement after loading can tell (CUDA: pool_sizing.profile_cuda_budget)."""
        raise NotImplementedError

    def prepare_model(self, model: LlamaForCausalLM, backend: AttentionBackend, tensor_parallel: bool) -> None:
        """Ready a loaded model for this platform's step (fused kernels, specialised decode paths)."""

    def capture_decode_graphs(self, runner: ModelRunner, args: EngineArgs, max_model_len: int) -> None:
        """Give `runner` the decode steps this platform replays instead of launching (CUDA graphs);
        none by default."""
