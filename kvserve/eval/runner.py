"""`evaluate`: what each KV-cache configuration costs in quality and gains in capacity.

One engine per configuration, built one after the other from a single checkpoint load; the
first configuration is the reference the others are compared with (by default "auto", the
model's own dtype, i.e. a full-precision cache).
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvserve.cache.sizing import bytes_per_block
from kvserve.units import GiB
from kvserve.engine.args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.preflight import preflight
from kvserve.eval.passkey import PasskeyConfig, PasskeyResult, make_prompts, run_passkey
from kvserve.eval.perplexity import FidelityResult, ScoringConfig, make_windows, measure_fidelity
from kvserve.model.loader import load_model
from kvserve.model.quant_linear import resident_weight_bytes

logger = logging.getLogger("kvserve.eval")

DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "data" / "pride-and-prejudice.txt"
DEFAULT_KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "int4_kivi")


@dataclass(frozen=True)
class ConfigResult:
    kv_cache_dtype: str
    quantization: str  # the --quantization of the weights
    weight_bytes: int  # weights resident in this configuration
    format: str  # the storage format's name (auto resolves to the model dtype)
    bytes_per_token: float  # all layers, K + V + scales
    tokens_per_gib: int
    capacity_ratio: float  # tokens per GiB relative to the reference
    fidelity: FidelityResult
    perplexity_increase: float  # relative to the reference, e.g. 0.004 = +0.4%
    passkey: PasskeyResult | None
    seconds: float


@dataclass
class EvalReport:
    model: str
    dtype: str
    text: str
    scoring: ScoringConfig
    passkey: PasskeyConfig | None
    results: list[ConfigResult] = field(default_factory=list)

    @property
    def reference(self) -> ConfigResult:
        return self.results[0]


def read_text(path: Path | str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the evaluation text {path}: {exc}") from None


def evaluate(model: str | None = None, kv_cache_dtypes: tuple[str, ...] = DEFAULT_KV_CACHE_DTYPES,
             text: Path | str = DEFAULT_TEXT, scoring: ScoringConfig = ScoringConfig(),
             passkey: PasskeyConfig | None = PasskeyConfig(), quantizations: tuple[str, ...] | None = None,
             **engine_options: Any) -> EvalReport:
    """Evaluate each weight quantization (`quantizations`, default: engine_options' one) with each
    KV-cache dtype in turn; the first configuration is the reference. `engine_options` are
    `EngineArgs` fields (kv_cache_memory, block_size, dtype, ...)."""
    if not kv_cache_dtypes:
        raise ValueError("give at least one KV cache dtype")
    base = EngineArgs(model=model, **engine_options)
    configs = [replace(base, quantization=q, kv_cache_dtype=kv)
               for q in (quantizations or (base.quantization,)) for kv in kv_cache_dtypes]
    for config in configs:  # every configuration's options, before the one load
        preflight(config)
    raw_text = read_text(text)
    loaded = load_model(model, tokenizer=base.tokenizer, trust_remote_code=base.trust_remote_code,
                        load_format=base.load_format)
    windows = make_windows(loaded.tokenizer.encode(raw_text, add_special_tokens=False), scoring)
    prompts = make_prompts(loaded.tokenizer, passkey) if passkey is not None else []
    report = None
    reference_logprobs = None
    for config in configs:
        kv_cache_dtype = config.kv_cache_dtype
        start = time.monotonic()
        engine = LLMEngine(config, loaded_model=loaded)
        if report is None:
            _check_lengths(engine, windows, prompts, passkey)
            report = EvalReport(str(engine.model_path), str(engine.dtype).removeprefix("torch."), str(text),
                                scoring, passkey)
        fidelity, kept = measure_fidelity(engine, windows, scoring, reference_logprobs)
        if reference_logprobs is None:
            reference_logprobs = kept
        passkey_result = run_passkey(engine, prompts, passkey.max_tokens) if passkey is not None else None
        per_token = bytes_per_block(engine.kv_spec, engine.kv_format) / engine.kv_spec.block_size
        ref = report.results[0] if report.results else None
        result = ConfigResult(
            kv_cache_dtype=kv_cache_dtype,
            quantization=config.quantization,
            weight_bytes=resident_weight_bytes(engine.model),
            format=engine.kv_format.name,
            bytes_per_token=per_token,
            tokens_per_gib=int(GiB // per_token),
            capacity_ratio=(ref.bytes_per_token / per_token) if ref else 1.0,
            fidelity=fidelity,
            perplexity_increase=(fidelity.perplexity / ref.fidelity.perplexity - 1.0) if ref else 0.0,
            passkey=passkey_result,
            seconds=time.monotonic() - start,
        )
        report.results.append(result)
        logger.info("weights %s, KV %s: perplexity %.4f, KL %.5f, top-1 %.2f%%%s (%.0f s)", config.quantization,
                    kv_cache_dtype, fidelity.perplexity,
                    fidelity.mean_kl, 100 * fidelity.top1_agreement,
                    f", passkey {passkey_result.correct}/{passkey_result.total}" if passkey_result else "",
                    result.seconds)
        engine.close()  # tensor parallel: its workers stop before the next configuration's start
        del engine
        gc.collect()  # free this configuration's KV pool before the next one is allocated
    return report


def _check_lengths(engine: LLMEngine, windows: list[list[int]], prompts: list, passkey: PasskeyConfig | None) -> None:
    """Fail before any work if a window or a passkey prompt does not fit --max-model-len."""
    longest = len(windows[0])
    if longest > engine.max_model_len:
        raise ValueError(f"a scoring window of {longest} tokens exceeds max-model-len {engine.max_model_len}: "
                         f"lower --context-len / --score-len")
    if prompts:
        need = max(len(p.token_ids) for p in prompts) + passkey.max_tokens
        if need > engine.max_model_len:
            raise ValueError(f"the longest passkey prompt needs {need} tokens, more than max-model-len "
                             f"{engine.max_model_len}: lower --passkey-lengths")
