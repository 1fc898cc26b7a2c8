"""`kvserve plan`: the formula, kvserve's own layout against the engine's real pool, capacity,
presets, config loading, bad input, the plot, and the fragmentation measurement."""
from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoConfig

from kvserve.cache.formats import KV_CACHE_DTYPES, make_kv_format
from kvserve.cli import main
from kvserve.engine.args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from kvserve.model.loader import load_model_config
from kvserve.plan.fragmentation import measure_waste, sharegpt_like
from kvserve.plan.presets import PRESETS
from kvserve.plan.source import load_arch


def plan_json(capsys, *argv: str) -> dict:
    rc = main(["plan", *argv, "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(captured.out)


def plan_error(capsys, *argv: str) -> str:
    rc = main(["plan", *argv])
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvserve plan: error: "), err
    return lines[0]


def formula_total(formula: str) -> int:
    """Evaluate the substituted middle of `symbols = numbers = result bytes`."""
    numbers = formula.split(" = ")[1]
    total = 0.0
    for term in numbers.split(" + "):
        product = 1.0
        for factor in term.split(" × "):
            product *= float(factor.replace(",", ""))
        total += product
    return round(total)


# --------------------------------------------------------------------------- the published example
def test_llama2_70b_published_example(capsys):
    plan = plan_json(capsys, "llama-2-70b", "--max-model-len", "32768", "--batch-size", "1",
                     "--kv-cache-dtype", "float16,fp8")
    fp16, fp8 = plan["kv_cache"]
    assert fp16["value_bytes"] == 10_737_418_240
    assert fp16["formula"].endswith("= 2 × 1 × 32,768 × 80 × 8 × 128 × 2 = 10,737,418,240 bytes")
    assert fp16["mha_value_bytes"] == 85_899_345_920
    assert fp8["value_bytes"] == 5_368_709_120 == fp16["value_bytes"] // 2
    # kvserve's fp8 layout: the same values plus its scales, listed on their own.
    layout = fp8["layout"]
    assert layout["value_bytes"] == 5_368_709_120
    assert layout["scale_bytes"] > 0
    assert layout["bytes"] == layout["value_bytes"] + layout["scale_bytes"]
    assert fp16["layout"]["scale_bytes"] == 0


def test_table_shows_formula_comparison_and_both_units(capsys):
    assert main(["plan", "llama-2-70b", "--max-model-len", "32768", "--kv-cache-dtype", "float16"]) == 0
    out = capsys.readouterr().out
    assert "2 × batch × seq_len × layers × kv_heads × head_dim × bytes = 2 × 1 × 32,768 × 80 × 8 × 128 × 2" in out
    assert "10.74 GB" in out and "10.00 GiB" in out
    assert "with MHA (64 KV heads) it would be 85,899,345,920 bytes" in out


# --------------------------------------------------------------------------- architectures
def test_sliding_window_layers_cache_at_most_the_window(capsys):
    # Gemma-2-9b: 21 local layers (window 4,096) alternate with 21 global ones.
    plan = plan_json(capsys, "gemma-2-9b", "--max-model-len", "8192", "--batch-size", "2",
                     "--kv-cache-dtype", "bfloat16")
    fp = plan["kv_cache"][0]
    assert fp["value_bytes"] == 2 * 2 * (21 * 4096 + 21 * 8192) * 8 * 256 * 2
    assert formula_total(fp["formula"]) == fp["value_bytes"]
    # kvserve's pool keeps every token in every layer: the windowed layers cost the full length.
    assert fp["layout"]["value_bytes"] == 2 * 2 * 42 * 8192 * 8 * 256 * 2
    groups = plan["model"]["layer_groups"]
    assert sorted(g["sliding_window"] or 0 for g in groups) == [0, 4096]


def test_a_window_in_every_layer_holds_the_window_and_a_step(capsys):
    """Mistral v0.1 (every layer windowed, 4,096): in kvserve's pool a sequence of 32,768 holds its
    window and a step (the engine's preflight.SequenceHold), so a budget holds more of them and any
    max-model-len once it holds one; the step is --max-num-batched-tokens, else the CPU's 2,048."""
    def capacity(*extra):
        plan = plan_json(capsys, "mistral-7b", "--kv-cache-memory", "4GiB", "--kv-cache-dtype", "bfloat16",
                         "--dtype", "bfloat16", "--device", "cpu", *extra)
        return plan["kv_cache"][0]["capacity"], plan["notes"]

    cap, notes = capacity()
    assert cap["blocks_per_sequence"] == (4096 + 2048) // 16 + 2
    assert cap["max_concurrent_sequences"] == cap["num_blocks"] // cap["blocks_per_sequence"] > 1
    assert cap["largest_max_model_len"] == 32768
    assert any("a sequence holds its window and a step of 2,048 tokens" in n for n in notes)
    cap, _ = capacity("--max-num-batched-tokens", "8192")
    assert cap["blocks_per_sequence"] == (4096 + 8192) // 16 + 2
    cap, notes = capacity("--max-model-len", "4096")  # the window and a step hold the whole sequence
    assert cap["blocks_per_sequence"] == 4096 // 16
    assert any("no fewer than its 4,096 tokens" in n for n in notes)


def test_window_longer_than_context_changes_nothing(capsys):
    plan = plan_json(capsys, "mistral-7b", "--max-model-len", "2048", "--kv-cache-dtype", "bfloat16")
    assert plan["kv_cache"][0]["value_bytes"] == 2 * 2048 * 32 * 8 * 128 * 2


def test_mla_caches_the_latent_not_k_and_v(capsys):
    plan = plan_json(capsys, "deepseek-v3", "--max-model-len", "4096", "--kv-cache-dtype", "bfloat16",
                     "--kv-cache-memory", "8GiB")
    fp = plan["kv_cache"][0]
    assert plan["model"]["attention"] == "mla"
    assert fp["value_bytes"] == 4096 * 61 * (512 + 64) * 2
    assert fp["mha_value_bytes"] == 4096 * 61 * 128 * (128 + 64 + 128) * 2
    assert formula_total(fp["formula"]) == fp["value_bytes"]
    assert fp["layout"] is None and "MLA" in fp["layout_unavailable"]
    cap = fp["capacity"]
    assert cap["layout"] == "formula"
    assert cap["bytes_per_block"] == 16 * 61 * 576 * 2
    assert cap["num_blocks"] == (8 << 30) // cap["bytes_per_block"]


def test_gqa_tensor_parallel_splits_and_replicates_kv_heads(capsys):
    one = plan_json(capsys, "llama-2-70b", "--max-model-len", "4096", "--kv-cache-dtype", "bfloat16",
                    "--kv-cache-memory", "4GiB")["kv_cache"][0]
    two = plan_json(capsys, "llama-2-70b", "--max-model-len", "4096", "--kv-cache-dtype", "bfloat16",
                    "--kv-cache-memory", "4GiB", "--tensor-parallel-size", "2")["kv_cache"][0]
    sixteen = plan_json(capsys, "llama-2-70b", "--max-model-len", "4096", "--kv-cache-dtype", "bfloat16",
                        "--kv-cache-memory", "4GiB", "--tensor-parallel-size", "16")["kv_cache"][0]
    assert two["layout"]["bytes_per_block"] * 2 == one["layout"]["bytes_per_block"]
    assert two["layout"]["bytes"] == one["layout"]["bytes"]
    # Half the bytes per block: twice the blocks (each pool pays for its null block).
    assert two["capacity"]["num_blocks"] + 1 == 2 * (one["capacity"]["num_blocks"] + 1)
    # 16 devices, 8 KV heads: each device holds one (replicated) head.
    assert sixteen["layout"]["bytes"] == 2 * one["layout"]["bytes"]


def test_weights_and_gpu_budget(capsys):
    plan = plan_json(capsys, "llama-3-8b", "--gpu-memory", "80GiB", "--gpu-memory-utilization", "0.9",
                     "--max-model-len", "8192", "--kv-cache-dtype", "auto")
    weights = plan["weights"]
    assert weights["dtype"] == "bfloat16"  # auto for a GPU
    assert weights["bytes"] == 8_030_261_248 * 2
    assert plan["kv_budget"]["bytes"] == int(80 * 2**30 * 0.9) - weights["bytes"]
    cap = plan["kv_cache"][0]["capacity"]
    per_block = 32 * 2 * 8 * 16 * 128 * 2
    assert cap["num_blocks"] == plan["kv_budget"]["bytes"] // per_block - 1  # the null block
    assert cap["max_concurrent_sequences"] == cap["num_blocks"] // (8192 // 16)
    assert cap["largest_max_model_len"] == cap["num_blocks"] * 16
    explicit = plan_json(capsys, "llama-3-8b", "--max-model-len", "8192", "--dtype", "float32",
                         "--kv-cache-memory", "4GiB")
    assert explicit["weights"]["bytes"] == 8_030_261_248 * 4
    assert explicit["kv_cache"][0]["kv_cache_dtype"] == "float32"


def test_a_format_registered_once_reaches_the_planner(capsys, monkeypatch):
    """One registry entry is all a new format needs: the planner takes its value bits and its
    real block bytes from the format itself."""
    from kvserve.cache import formats
    from kvserve.cache.formats.int4 import Int4Format

    class Int4Plain(Int4Format):  # a new name for the planner to find; its own value bits
        name = "int4_plain"

    monkeypatch.setitem(formats.FORMATS, "int4_plain", Int4Plain)
    plan = plan_json(capsys, "llama-2-70b", "--max-model-len", "32768", "--kv-cache-dtype", "int4_plain",
                     "--kv-cache-memory", "8GiB")
    fp = plan["kv_cache"][0]
    assert fp["value_bytes"] == 10_737_418_240 // 4
    assert fp["layout"]["format_name"] == "int4_plain"
    assert fp["capacity"]["layout"] == "kvserve"


def test_gpu_without_budget_gives_sizes_but_no_capacity(capsys):
    plan = plan_json(capsys, "qwen2.5-7b", "--device", "cuda", "--max-model-len", "32768")
    assert plan["kv_budget"] is None and plan["kv_cache"][0]["capacity"] is None
    assert plan["kv_cache"][0]["value_bytes"] == 2 * 32768 * 28 * 4 * 128 * 2
    assert any("--gpu-memory" in note for note in plan["notes"])


def test_every_kv_dtype_has_value_bits():
    bits = {name: make_kv_format(name, torch.bfloat16).value_bits for name in KV_CACHE_DTYPES}
    assert bits["auto"] == bits["bfloat16"] == 16 and bits["float32"] == 32
    assert bits["fp8"] == bits["int8"] == 8 and bits["int4"] == bits["int4_kivi"] == 4


# --------------------------------------------------------------------------- presets
def test_presets_cover_the_published_architectures():
    required = {"llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b", "llama-3-70b", "llama-3.1-405b",
                "mistral-7b", "mixtral-8x7b", "qwen2.5-7b", "qwen2.5-72b", "gemma-2-9b", "deepseek-v3",
                "smollm2-135m"}
    assert required <= set(PRESETS)
    for name in PRESETS:
        arch = load_arch(name)
        assert arch.num_params == PRESETS[name].num_params
        assert arch.num_layers == PRESETS[name].config["num_hidden_layers"]


@pytest.mark.parametrize("name", [n for n, p in PRESETS.items() if p.config["model_type"] in SUPPORTED_ARCHITECTURES])
def test_dense_preset_parameter_counts_match_their_shapes(name):
    preset = PRESETS[name]
    cfg = AutoConfig.for_model(**preset.config)
    assert ModelConfig.from_hf(cfg).num_params == preset.num_params


def test_preset_matches_the_bundled_model_config():
    config, _ = load_model_config(None)
    arch = load_arch("smollm2-135m")
    assert (arch.num_layers, arch.uniform_kv_heads, arch.layers[0].head_dim) == \
        (config.num_layers, config.num_kv_heads, config.head_dim)
    assert arch.num_params == config.num_params


# --------------------------------------------------------------------------- kvserve's layout == the engine's pool
@pytest.mark.parametrize("kv_dtype", [d for d in KV_CACHE_DTYPES])
def test_prediction_equals_engine_allocation_tiny(capsys, tiny_llama, kv_dtype):
    engine = LLMEngine(EngineArgs(model=str(tiny_llama), dtype="float32", kv_cache_dtype=kv_dtype,
                                  kv_cache_memory="1MiB", max_model_len=256))
    plan = plan_json(capsys, str(tiny_llama), "--dtype", "float32", "--kv-cache-dtype", kv_dtype,
                     "--kv-cache-memory", "1MiB", "--max-model-len", "256")
    fp = plan["kv_cache"][0]
    assert fp["capacity"]["layout"] == "kvserve"
    assert fp["capacity"]["num_blocks"] == engine.kv_cache.num_blocks
    # The pool holds one block more than it hands out: the null block, paid from the budget.
    assert (fp["capacity"]["num_blocks"] + 1) * fp["layout"]["bytes_per_block"] == engine.kv_cache.nbytes
    assert fp["layout"]["format_name"] == engine.kv_format.name


@pytest.mark.slow
def test_prediction_equals_engine_allocation_default_model(capsys):
    from kvserve import LLM

    llm = LLM(kv_cache_memory="100MiB", max_model_len=2048)
    plan = plan_json(capsys, "--kv-cache-memory", "100MiB", "--max-model-len", "2048")
    fp = plan["kv_cache"][0]
    assert plan["model"]["source"] == "gguf" and plan["model"]["file_bytes"] > 0
    assert plan["weights"]["dtype"] == str(llm.engine.dtype).removeprefix("torch.")
    assert fp["capacity"]["num_blocks"] == llm.engine.kv_cache.num_blocks
    assert (fp["capacity"]["num_blocks"] + 1) * fp["layout"]["bytes_per_block"] == llm.engine.kv_cache.nbytes
    assert fp["capacity"]["kv_tokens"] == llm.engine.kv_cache.num_blocks * 16


# --------------------------------------------------------------------------- offload tiers
def test_offload_tiers_hold_the_pools_blocks(capsys, tiny_llama):
    """A tier holds whole blocks of the engine's own layout (codes and scales): its tokens are its
    size over the pool's bytes per block, and whole sequences of max-model-len follow."""
    engine = LLMEngine(EngineArgs(model=str(tiny_llama), dtype="float32", kv_cache_dtype="int8",
                                  kv_cache_memory="1MiB", max_model_len=256))
    pool_block = engine.kv_cache.nbytes // (engine.kv_cache.num_blocks + 1)  # the null block included
    plan = plan_json(capsys, str(tiny_llama), "--dtype", "float32", "--kv-cache-dtype", "int8,float32",
                     "--kv-cache-memory", "1MiB", "--max-model-len", "256", "--kv-offloading-size", "0.5",
                     "--kv-offloading-disk-size", "3MiB")
    assert (plan["inputs"]["kv_offloading_size"], plan["inputs"]["kv_offloading_disk_size"]) == (1 << 29, 3 << 20)
    int8, fp32 = plan["kv_cache"]
    host, disk = int8["offload_tiers"]
    assert (host["tier"], disk["tier"]) == ("host", "disk")
    assert host["bytes_per_block"] == disk["bytes_per_block"] == pool_block == int8["layout"]["bytes_per_block"]
    assert host["num_blocks"] == (1 << 29) // pool_block and disk["num_blocks"] == (3 << 20) // pool_block
    assert host["kv_tokens"] == 16 * host["num_blocks"]
    assert disk["max_concurrent_sequences"] == disk["num_blocks"] // 16  # 256 tokens = 16 blocks of 16
    # float32 blocks are bigger than int8's (values plus scales): fewer tokens in the same bytes
    assert fp32["offload_tiers"][0]["kv_tokens"] < host["kv_tokens"]
    assert fp32["offload_tiers"][0]["num_blocks"] == (1 << 29) // fp32["layout"]["bytes_per_block"]
    # no tier flags: no tiers
    assert plan_json(capsys, str(tiny_llama), "--max-model-len", "256")["kv_cache"][0]["offload_tiers"] == []


def test_offload_tiers_text_and_tensor_parallel(capsys):
    """Tier sizes are totals over the devices (vLLM's rule); each device holds its heads' share of the
    same tokens, so the token count does not change with the device count."""
    args = ["llama-3-8b", "--max-model-len", "8192", "--kv-cache-dtype", "bfloat16", "--kv-cache-memory", "4GiB",
            "--kv-offloading-size", "16", "--kv-offloading-disk-size", "1TiB"]
    one = plan_json(capsys, *args)["kv_cache"][0]["offload_tiers"]
    two = plan_json(capsys, *args, "--tensor-parallel-size", "2")["kv_cache"][0]["offload_tiers"]
    per_token = 32 * 2 * 8 * 128 * 2  # layers × K and V × KV heads × head_dim × bf16 bytes
    assert one[0]["kv_tokens"] == (16 << 30) // (16 * per_token) * 16
    assert two[0]["bytes_per_device"] == 8 << 30 and two[0]["bytes_per_block"] * 2 == one[0]["bytes_per_block"]
    assert [t["kv_tokens"] for t in two] == [t["kv_tokens"] for t in one]
    assert one[1]["max_concurrent_sequences"] == one[1]["num_blocks"] // 512
    assert main(["plan", *args, "--tensor-parallel-size", "2"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert (f"host memory tier of 17,179,869,184 B (17.18 GB, 16.00 GiB) (8,589,934,592 B (8.59 GB, 8.00 GiB) "
            f"on each of 2 devices): {two[0]['num_blocks']:,} blocks of {two[0]['bytes_per_block']:,} bytes = "
            f"{two[0]['kv_tokens']:,} tokens of bfloat16, {two[0]['max_concurrent_sequences']:,} sequences of "
            f"8,192") in text
    assert "disk tier of 1,099,511,627,776 B" in text and "KV tokens it holds" in text


@pytest.mark.parametrize("flags, message", [
    (["--kv-offloading-size", "0"], "--kv-offloading-size must be a positive number of GiB, got '0'"),
    (["--kv-offloading-size", "-2"], "--kv-offloading-size must be a positive number of GiB"),
    (["--kv-offloading-size", "nan"], "--kv-offloading-size must be a positive number of GiB"),
    (["--kv-offloading-disk-size", "lots"], "--kv-offloading-disk-size: cannot parse size 'lots'"),
])
def test_offload_tier_sizes_bad_input(capsys, flags, message):
    assert message in plan_error(capsys, "llama-3-8b", *flags)


# --------------------------------------------------------------------------- config files
def test_hf_directory_and_config_file(capsys, tiny_llama):
    config, file_bytes = load_model_config(tiny_llama)
    for target in (str(tiny_llama), str(tiny_llama / "config.json")):
        plan = plan_json(capsys, target, "--max-model-len", "100", "--kv-cache-dtype", "float32")
        assert plan["model"]["num_params"] == config.num_params  # counted from the safetensors headers
        assert plan["model"]["file_bytes"] == file_bytes
        assert plan["kv_cache"][0]["value_bytes"] == 2 * 100 * config.num_layers * config.num_kv_heads * \
            config.head_dim * 4


def test_per_layer_kv_heads(tmp_path, capsys):
    cfg = {"model_type": "custom", "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": [8, 2, 1],
           "hidden_size": 512, "max_position_embeddings": 1024}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    plan = plan_json(capsys, str(tmp_path), "--max-model-len", "1000", "--kv-cache-dtype", "float16",
                     "--device", "cpu")
    fp = plan["kv_cache"][0]
    assert fp["value_bytes"] == 2 * 1000 * (8 + 2 + 1) * 64 * 2
    assert fp["mha_value_bytes"] == 2 * 1000 * 3 * 8 * 64 * 2
    assert fp["layout"] is None and fp["capacity"] is not None  # the engine default budget on CPU
    assert plan["model"]["num_params"] is None


# --------------------------------------------------------------------------- bad input
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert "unknown model 'llama-9-1t'" in plan_error(capsys, "llama-9-1t")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    assert "malformed config" in plan_error(capsys, str(tmp_path / "bad"))
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 0}))
    assert "num_hidden_layers" in plan_error(capsys, str(tmp_path / "partial"))
    assert "--max-model-len must be positive" in plan_error(capsys, "llama-3-8b", "--max-model-len", "0")
    assert "--max-model-len must be positive" in plan_error(capsys, "llama-3-8b", "--max-model-len", "-5")
    assert "--batch-size must be positive" in plan_error(capsys, "llama-3-8b", "--batch-size", "0")
    assert "cannot parse size" in plan_error(capsys, "llama-3-8b", "--kv-cache-memory", "lots")
    assert "size must be positive" in plan_error(capsys, "llama-3-8b", "--gpu-memory", "0GiB")
    assert "unknown kv cache dtype 'fp6'" in plan_error(capsys, "llama-3-8b", "--kv-cache-dtype", "fp6")
    assert "cannot split 8 KV heads" in plan_error(capsys, "llama-3-8b", "--tensor-parallel-size", "3")
    assert "--device" in plan_error(capsys, "llama-3-8b", "--device", "tpu9")
    assert "(0, 1]" in plan_error(capsys, "llama-3-8b", "--gpu-memory", "80GiB", "--gpu-memory-utilization", "1.5")


def test_budget_too_small(capsys):
    # The KV dtype is explicit: `auto` would follow this CPU (bfloat16 or float32).
    err = plan_error(capsys, "llama-2-7b", "--max-model-len", "4096", "--kv-cache-memory", "1GiB",
                     "--kv-cache-dtype", "bfloat16")
    assert "use --max-model-len 2032 or less" in err  # 127 blocks of 16 beside the null block
    assert "smaller than one block" in plan_error(capsys, "llama-2-7b", "--kv-cache-memory", "1MiB")
    assert "do not fit" in plan_error(capsys, "llama-3-70b", "--gpu-memory", "80GiB")
    assert "exceed" in plan_error(capsys, "llama-3-8b", "--gpu-memory", "24GiB", "--kv-cache-memory", "10GiB")


# --------------------------------------------------------------------------- plot
def test_plot(tmp_path, capsys):
    out = tmp_path / "kv.png"
    assert main(["plan", "mistral-7b", "--kv-cache-dtype", "bfloat16,fp8", "--gpu-memory", "24GiB",
                 "--max-model-len", "16384", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    (tmp_path / "a-file").write_text("")
    assert "cannot write the plot" in plan_error(capsys, "mistral-7b", "--plot", str(tmp_path / "a-file" / "kv.png"))


# --------------------------------------------------------------------------- json schema
def test_json_keys_are_the_documented_ones(capsys):
    from kvserve.plan import report

    plan = plan_json(capsys, "llama-3-8b", "--kv-cache-memory", "4GiB", "--max-model-len", "4096")
    doc = report.__doc__
    for section in ("model", "inputs", "weights", "kv_budget", "kv_cache", "notes"):
        assert section in plan and section in doc
    entry = plan["kv_cache"][0]
    plan = plan_json(capsys, "llama-3-8b", "--kv-cache-memory", "4GiB", "--max-model-len", "4096",
                     "--kv-offloading-size", "1")
    entry = plan["kv_cache"][0]
    for key in [*entry, *entry["layout"], *entry["capacity"], *entry["offload_tiers"][0], *plan["model"],
                *plan["inputs"], *plan["weights"]]:
        assert re.search(rf"\b{key}\b", doc), key


# --------------------------------------------------------------------------- fragmentation
def test_sharegpt_like_lengths():
    workload = sharegpt_like(20000, max_model_len=1 << 20)  # no clipping to speak of
    assert workload.mean_prompt == pytest.approx(161, rel=0.05)
    assert workload.mean_output == pytest.approx(338, rel=0.05)
    clipped = sharegpt_like(2000, max_model_len=2048)
    assert all(p + o <= 2048 for p, o in zip(clipped.prompt_lens, clipped.output_lens))


def test_paged_waste_is_small_and_contiguous_waste_large():
    workload = sharegpt_like(150, max_model_len=2048, seed=1)
    exact = measure_waste(workload, 1, 16384)
    assert exact.waste_fraction == 0.0
    paged = [measure_waste(workload, b, 16384) for b in (8, 16, 32)]
    contiguous = measure_waste(workload, 2048, 16384)
    wastes = [r.waste_fraction for r in paged]
    assert wastes == sorted(wastes) and wastes[-1] < 0.1
    assert contiguous.waste_fraction > 0.5
    assert contiguous.max_running == 16384 // 2048
    assert paged[1].mean_running > 3 * contiguous.mean_running


@pytest.mark.parametrize("flag", [["--kv-eviction", "h2o"], ["--max-num-seqs", "8"], ["--attention-backend", "torch"],
                                  ["--kv-offloading-disk-path", "/tmp/kv"]])
def test_engine_options_the_plan_does_not_read_are_refused(capsys, flag):
    """plan takes the engine options that change KV sizes or the budget; any other is unknown to it
    rather than accepted and ignored."""
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *flag])
    assert exit_info.value.code == 2 and f"unrecognized arguments: {flag[0]}" in capsys.readouterr().err
