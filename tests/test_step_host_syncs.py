"""A step's forward pass and sampling make no host round trip (issue 42): on the CUDA configuration
(Triton attention, the fused ops, decode steps through the graphs' persistent buffers, eager
steps beside them), launching a step and sampling it call no op whose result the host must wait
for (`.item()`, a tensor's truth value, `nonzero`, `masked_select`, indexing by a boolean mask,
...), read no tensor back with `.tolist()` or `.numpy()`, and (on CUDA) copy nothing to the host
blocking and call no synchronize. The step's one wait is `ModelRunner.wait`, which copies the
sampled ids (and logprobs) to the host. Greedy, seeded top-k/top-p/min-p, penalties, logit bias,
min_tokens, logprobs and a grammar run in the same steps. Under Triton's interpreter on CPU; on a
machine with CUDA the same test runs on the GPU."""
from __future__ import annotations

import os
import traceback

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' module is imported

pytest.importorskip("triton", reason="the triton package is not installed (pip install -e '.[test]')")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.engine.decode_graphs import DecodeGraphs  # noqa: E402
from kvserve.model import fused_ops  # noqa: E402
from kvserve.sampling_params import StructuredOutputsParams  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# ops whose output the host needs before it can go on (a value, or a shape that depends on values)
HOST_WAITS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::nonzero_static", "aten::masked_select",
              "aten::unique", "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim",
              "aten::repeat_interleave", "aten::equal", "aten::is_nonzero", "aten::bincount"}
# Indexing by a boolean mask runs a nonzero inside the op, which the mode does not see.
INDEXING = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}
# Branches taken only where the logits are on the CPU, which read host memory by design: the grammar
# masks' numpy path (GrammarMasks.banned/apply; on another device they are torch ops on the device).
CPU_ONLY_READS = {("structured_output.py", "banned"), ("structured_output.py", "apply")}


def _callers(depth: int) -> set[tuple[str, str]]:
    """(file name, function) of the innermost `depth` frames of the stack, this one included."""
    return {(os.path.basename(f.filename), f.name) for f in traceback.extract_stack(limit=depth + 1)}


class HostWaits(TorchDispatchMode):
    """Records each host-waiting op dispatched while active, and each `.tolist()`/`.numpy()`
    (`read_back`, patched over torch.Tensor's while active)."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in HOST_WAITS:
            self._record(name)
        elif name in INDEXING and any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            self._record(f"{name} by a boolean mask")
        elif name in ("aten::_to_copy", "aten::copy_") and self._blocking_read_back(name, args, kwargs or {}):
            self._record(f"{name} to the host, blocking")
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _blocking_read_back(name: str, args, kwargs) -> bool:
        """A copy from the GPU into host memory that the host waits for (CUDA only)."""
        if name == "aten::_to_copy":
            source, target, non_blocking = args[0], kwargs.get("device"), kwargs.get("non_blocking", False)
            target_is_host = target is not None and torch.device(target).type == "cpu"
        else:
            target, source = args[0], args[1]
            non_blocking = (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            target_is_host = target.device.type == "cpu"
        return source.device.type == "cuda" and target_is_host and not non_blocking

    def waits(self, what: str, method):
        """`method` (a synchronize) recorded as a wait, except the decode graphs' wait for their
        previous input copy to have left the pinned buffer (DecodeGraphs._fill: a copy queued a
        step ago, not the step's compute)."""
        def recorded(*args, **kwargs):
            if ("decode_graphs.py", "_fill") not in _callers(3):
                self._record(what)
            return method(*args, **kwargs)
        return recorded

    def read_back(self, name: str):
        method = getattr(torch.Tensor, name)

        def recorded(tensor, *args, **kwargs):
            if not (DEVICE.type == "cpu" and _callers(4) & CPU_ONLY_READS):
                self._record(f"Tensor.{name}")
            return method(tensor, *args, **kwargs)
        return recorded

    def _record(self, what: str) -> None:
        self.found.append(f"{what}\n{''.join(traceback.format_stack(limit=7)[:-2])}")


@pytest.mark.parametrize("async_scheduling, kv_cache_dtype",
                         [(False, "auto"), (True, "auto"), (False, "int8"), (False, "fp8_e5m2")])
def test_launching_and_sampling_a_step_waits_for_nothing_on_the_device(tiny_llama_d32, monkeypatch,
                                                                        async_scheduling, kv_cache_dtype):
    """Under async scheduling a decode's input token is taken from the step before, on the device.
    int8 and fp8_e5m2 quantize on the device as they store (fp8_e5m2 with its Hadamard rotation);
    int4 and fp8_e4m3 passed too, but take 2-4 minutes under the interpreter, so CI leaves them out."""
    llm = LLM(str(tiny_llama_d32), dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=32,
              attention_backend="triton", device=str(DEVICE), max_cudagraph_capture_size=4,
              async_scheduling=async_scheduling, kv_cache_dtype=kv_cache_dtype)
    runner = llm.engine.runner
    if DEVICE.type == "cpu":  # what CudaPlatform installs on CUDA: the fused ops, the graphs' buffers
        llm.engine.model.use_fused_ops(fused_ops)
        runner.graphs = DecodeGraphs(llm.engine.model, llm.engine.kv_cache, runner.backend, 4,
                                     llm.engine.max_model_len)
    waits = HostWaits()
    paths = {"graph": 0, "eager": 0}
    launch, sample, graph_run, run = runner.launch, runner.sample, runner.graphs.run, runner.run
    depth = [0]

    def watched(function, path=None):
        def call(*args, **kwargs):
            if path is not None:
                paths[path] += 1
            if depth[0]:  # inside launch already
                return function(*args, **kwargs)
            depth[0] += 1
            try:
                with monkeypatch.context() as patch, waits:
                    for name in ("tolist", "numpy"):
                        patch.setattr(torch.Tensor, name, waits.read_back(name))
                    for owner in (torch.cuda, torch.cuda.Event, torch.cuda.Stream):
                        patch.setattr(owner, "synchronize", waits.waits(f"{owner.__name__}.synchronize",
                                                                        owner.synchronize))
                    return function(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    runner.launch, runner.sample = watched(launch), watched(sample)
    runner.graphs.run, runner.run = watched(graph_run, "graph"), watched(run, "eager")
    vocab = llm.engine.model_config.vocab_size
    params = [
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=7, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=1.0, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3,
                       logit_bias={vocab - 1: 5.0}, min_tokens=4, max_tokens=7, ignore_eos=True, seed=3),
        SamplingParams(temperature=0, max_tokens=7, structured_outputs=StructuredOutputsParams(
            choice=["yes", "no", "maybe"])),
        SamplingParams(temperature=0.5, max_tokens=7, ignore_eos=True, seed=11, logprobs=0),
    ]
    prompts = ["It is a truth universally acknowledged, that a single man", "Hello", "The",
               "Answer yes or no:", "Mr. Bennet was so odd a mixture"]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.outputs[0].token_ids for o in outputs)
    assert outputs[3].outputs[0].text in ("yes", "no", "maybe")
    assert paths["graph"] > 0 and paths["eager"] > 0, paths  # both kinds of step were watched
    assert not waits.found, "a step waited on the device:\n" + "\n".join(waits.found[:3])
