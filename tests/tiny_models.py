"""Tiny random Hugging Face checkpoints written locally with transformers (no hub), for tests that
need a real architecture but not real weights."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

BOOK = Path(__file__).resolve().parent.parent / "kvserve" / "data" / "pride-and-prejudice.txt"
# `persona`, when the caller passes one (chat_template_kwargs), renders as a system turn first.
CHAT_TEMPLATE = (
    "{% if persona is defined %}{{ '<|im_start|>system\n' + persona + '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer(vocab_size: int = 512):
    """A byte-level BPE trained in a second on the bundled novel, with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([BOOK.read_text()[:200_000]], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)


def build_sentencepiece_tokenizer(vocab_size: int = 600):
    """Llama-2's tokenizer layout, trained in a second on the bundled novel: spaces as "▁" with one
    prepended, BPE with byte fallback (<0x..> tokens), and the decoder chain that turns "▁" back
    into spaces, fuses the bytes and strips the one leading space."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator([BOOK.read_text()[:100_000]], trainers.BpeTrainer(vocab_size=vocab_size,
                                                                              special_tokens=specials))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def build_tiny_model(path: Path, arch: str = "llama", tokenizer=None, seed: int = 0, **overrides) -> Path:
    """Write a random `arch` (llama, mistral, qwen2, qwen3) checkpoint with its tokenizer to `path`.
    The qwen3 one has heads wider than hidden_size / heads (as Qwen3-0.6B's 16 x 128 over 1,024) and
    random q/k norm weights, so that a norm applied to the wrong heads, or not at all, shows."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    tokenizer = tokenizer or build_tokenizer()
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                  pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    if arch == "qwen3":
        common["head_dim"] = 32
    common.update(overrides)
    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common)).eval()
    # Random init gives near-uniform logits; a larger scale makes greedy choices well separated
    # so that tiny numeric differences cannot flip an argmax.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


# A ChatML template whose generation prompt opens the thinking, as DeepSeek-R1's templates do;
# an assistant turn's `reasoning_content` is written back inside <think> ... </think>.
THINKING_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message.reasoning_content %}{{ '<think>' + message.reasoning_content + '</think>' }}{% endif %}"
    "{{ (message['content'] or '') + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}{% endif %}"
)


# Qwen3's shape of template: the generation prompt does not open <think> (the model does), and an
# earlier assistant turn's thinking is written back (Qwen3 does so for the turns of a tool loop);
# enable_thinking false closes an empty thinking in the generation prompt, as Qwen3's does.
OPENING_TEMPLATE = THINKING_TEMPLATE.replace(
    "assistant\n<think>\n' }}", "assistant\n' }}{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}")


def build_scripted_reasoning_model(path: Path, reasoning: str, answer: str, opens: bool = False) -> Path:
    """A tiny llama that, greedy, always writes `reasoning` + "</think>" + `answer` + EOS after a
    prompt ending in "\\n" (THINKING_TEMPLATE's generation prompt): a reasoning model whose output a
    test knows. `opens`: it writes "<think>" first, under OPENING_TEMPLATE (a Qwen3 hybrid model's way). Its attention and MLP write nothing (o_proj and down_proj are zero), so the final
    hidden state is the current token's embedding; each script token's embedding is its own unit
    vector, and the LM head maps it to the next script token (anything else to EOS)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])  # plain added tokens, as in DeepSeek-R1's tokenizer
    tokenizer.chat_template = OPENING_TEMPLATE if opens else THINKING_TEMPLATE
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    [newline], [start], [end] = encode("\n"), encode("<think>"), encode("</think>")
    script = [newline, *([start] if opens else []), *encode(reasoning), end, *encode(answer), tokenizer.eos_token_id]
    assert len(set(script)) == len(script), "each script token may appear once (it decides its successor)"
    hidden = 64
    assert len(script) < hidden
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
        other = hidden - 1  # every token off the script: this slot, followed by EOS
        model.model.embed_tokens.weight[:, other] = 1.0
        model.lm_head.weight[tokenizer.eos_token_id, other] = 1.0
        for slot, (token, successor) in enumerate(zip(script, script[1:])):
            model.model.embed_tokens.weight[token] = 0.0
            model.model.embed_tokens.weight[token, slot] = 1.0
            model.lm_head.weight[successor, slot] = 1.0
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def write_gguf(hf_dir: Path, out_path: Path, arch: str, linears: str = "F32") -> None:
    """The HF checkpoint at `hf_dir` as llama.cpp's converter writes a GGUF (F32 tensors under
    llama.cpp's names, the head size as the attention key length; for `llama` the q/k rows permuted
    for its RoPE kernel and Llama 3.1's RoPE scaling as a rope_freqs tensor of per-frequency
    divisors), without tokenizer metadata: a test passes the HF directory as the tokenizer. `linears`: the type of the
    layers' matrices (Q4_0: quantized by gguf, and the embedding Q8_0, as llama.cpp's Q4_0 files;
    "K": random k-quant blocks in a Q4_K_M file's types, q/k/gate/up Q4_K, v/o/down and the output
    Q6_K: not the checkpoint's values, which gguf cannot quantize so, but a file of that layout)."""
    import gguf
    import transformers
    from safetensors.torch import load_file

    config = transformers.AutoConfig.from_pretrained(hf_dir)
    weights = load_file(str(hf_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(out_path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    rope = config.rope_parameters
    if arch == "llama" and rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_divisors(rope, config.head_dim))
    for name, tensor in weights.items():
        stem, kind = name.rsplit(".", 1)
        if arch == "llama" and stem.endswith(("q_proj", "k_proj")):  # each head's rotary halves interleaved
            heads = config.num_attention_heads if stem.endswith("q_proj") else config.num_key_value_heads
            rows = tensor.shape[0]
            tensor = tensor.reshape(heads, 2, rows // heads // 2, *tensor.shape[1:]).transpose(1, 2).reshape(
                tensor.shape)
        if stem.startswith("model.layers."):
            _, _, layer, part = stem.split(".", 3)
            gguf_name = f"blk.{layer}.{parts[part]}.{kind}"
        else:
            gguf_name = f"{names[stem]}.{kind}"
        if linears == "K" and tensor.dim() == 2 and stem != "model.embed_tokens":
            k_type = "Q4_K" if gguf_name.split(".")[-2] in ("attn_q", "attn_k", "ffn_gate", "ffn_up") else "Q6_K"
            qtype = gguf.GGMLQuantizationType[k_type]
            writer.add_tensor(gguf_name, random_k_quant_blocks(qtype, *tensor.shape), raw_dtype=qtype)
            continue
        qtype = gguf.GGMLQuantizationType[linears] if tensor.dim() == 2 and linears != "K" else gguf.GGMLQuantizationType.F32
        if stem == "model.embed_tokens" and linears not in ("F32", "K"):
            qtype = gguf.GGMLQuantizationType.Q8_0
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, tensor.float().numpy())
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(tensor.float().numpy(), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _llama3_rope_divisors(rope: dict, head_dim: int) -> np.ndarray:
    """Llama 3.1's RoPE scaling as llama.cpp's converter stores it: a divisor per default frequency
    (1 for short wavelengths, `factor` for long ones, interpolated between)."""
    import math

    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    divisors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelength < old_context / high:
            divisors.append(1.0)
        elif wavelength > old_context / low:
            divisors.append(factor)
        else:
            smooth = (old_context / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def random_k_quant_blocks(qtype, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """[rows, bytes per row] of random blocks of a quantized ggml type (Q4_K, Q5_K, Q6_K, Q2_K,
    Q3_K, Q5_0, IQ4_NL, IQ4_XS): random codes, scales and minimums, float16 block scales (d, and
    dmin where the type has one) of a small weight's size where the type keeps them."""
    import gguf

    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(seed + int(qtype))
    values_per_block, bytes_per_block = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // values_per_block, bytes_per_block), dtype=np.uint8)
    # (first byte of the float16 scales, how many): d, dmin first or last, as llama.cpp lays them out
    where = {T.Q6_K: (-2, 1), T.Q3_K: (-2, 1), T.Q2_K: (-4, 2), T.Q4_K: (0, 2), T.Q5_K: (0, 2)}.get(qtype, (0, 1))
    low, high = (2e-5, 1e-4) if qtype == T.Q6_K else (1e-4, 3e-4)  # Q6_K: d * (int8 scale) * (q - 32)
    start, count = where
    supers = rng.uniform(low, high, size=(blocks.shape[0], 2)).astype(np.float16).view(np.uint8)
    blocks[:, start:start + 2 * count or None] = supers[:, :2 * count]
    return blocks.reshape(rows, -1)
