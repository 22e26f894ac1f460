"""Tiny, deterministic Hugging Face checkpoints (model + tokenizer) for tests of any layer.

`build_tiny_checkpoint(tmp_path, arch, **config_overrides)` writes an ordinary checkpoint
directory (config.json, model.safetensors, tokenizer files, generation_config.json) that both
transformers and tokenwise can load, and returns its path.

Why the weights are not HF's defaults: HF initialises matrices with std 0.02, norms to one and
biases to zero. Attention over such weights is nearly uniform and a bias or norm weight that is
never loaded changes nothing, so a comparison against HF would pass even with those bugs. Here
matrices use std 0.2 (peaked attention, decisive greedy choices) and every norm weight and bias
gets noise, so each parameter affects the logits.

Builds are cached per process and copied into `tmp_path`, so tests may modify their copy.
"""

from __future__ import annotations

import atexit
import copy
import hashlib
import json
import os
import shutil
import tempfile
from functools import lru_cache
from typing import Any

import torch

EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|begin_of_text|>"
TOKENIZER_VOCAB_SIZE = 300
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello tokenwise, a small inference engine.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "import os\nimport sys\nprint(os.path.join('a', 'b'))",
    "Once upon a time there was a tiny model that predicted the next token.",
    "The cat sat on the mat. The dog sat on the log. The bird sat on the tree.",
    "Paged attention stores keys and values in fixed-size blocks of memory.",
    "Continuous batching adds new requests to the running batch at every step.",
] * 4

_MODEL_TYPES = {
    "BertModel": "bert",
    "BertForMaskedLM": "bert",
    "XLMRobertaModel": "xlm-roberta",
    "BertForSequenceClassification": "bert",
    "XLMRobertaForSequenceClassification": "xlm-roberta",
    "Qwen3ForSequenceClassification": "qwen3",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma4ForCausalLM": "gemma4_text",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "GptOssForCausalLM": "gpt_oss",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    "BartForConditionalGeneration": "bart",
    "WhisperForConditionalGeneration": "whisper",
}
# DeepSeek (MLA): 4 heads with their own K/V (no GQA), a 32-wide KV latent, 3 layers of which
# the first is dense, 8 routed experts (top-2) plus 2 shared; q_lora_rank None (q_proj).
_DEEPSEEK = {
    "num_hidden_layers": 3,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "first_k_dense_replace": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 2,
    "moe_intermediate_size": 32,
    "routed_scaling_factor": 1.5,
}
# Gated DeltaNet hybrids: 4 layers, the last full attention (gated, a quarter of each 32-wide
# head rotated); 2 key and 4 value heads of 16 for linear attention, conv kernel 4.
_GDN = {
    "num_hidden_layers": 4,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}
_GDN_MOE = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "Qwen3NextForCausalLM": {**_GDN, **_GDN_MOE, "norm_topk_prob": True},
    "Qwen3_5ForCausalLM": dict(_GDN),
    "Qwen3_5MoeForCausalLM": {**_GDN, **_GDN_MOE},
    "MistralForCausalLM": {"sliding_window": None},
    # head_dim != hidden_size // num_heads, to exercise the explicit head_dim path.
    "Qwen3ForCausalLM": {"head_dim": 32},
    "Qwen3ForSequenceClassification": {"head_dim": 32},
    # MoE: 4-8 small experts, top-2. The router and experts get std 0.2 like every matrix, so
    # routing is decisive and varies from token to token (every expert sees some tokens).
    "MixtralForCausalLM": {
        "sliding_window": None,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
    },
    "Qwen2MoeForCausalLM": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 96,
        "norm_topk_prob": False,
    },
    "Qwen3MoeForCausalLM": {
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    },
    # Gemma: caps small enough to bend these scores and logits (HF's defaults, 50 and 30, would
    # leave a tiny model's values untouched and a missing cap unnoticed); a query scale that is
    # not head_dim; 4 layers so sliding and global layers alternate twice.
    "Gemma2ForCausalLM": {
        "head_dim": 16,
        "num_hidden_layers": 4,
        "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 4.0,
        "final_logit_softcapping": 8.0,
        "sliding_window": 8,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
    },
    "Gemma3ForCausalLM": {
        "head_dim": 16,
        "num_hidden_layers": 4,
        "query_pre_attn_scalar": 24,
        "sliding_window": 8,
        "layer_types": [
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0},
        },
        "tie_word_embeddings": True,
    },
    # Gemma 4 shaped like its 31B model: global layers with their own (wider) heads, one KV
    # head that is also the value (`attention_k_eq_v`) and proportional RoPE (a quarter of the
    # pairs rotate); 5 layers so that sliding ones come before and between the global ones.
    # GEMMA4_E (tests/models/test_gemma4_vs_hf.py) adds the E2B/E4B features.
    "Gemma4ForCausalLM": {
        "head_dim": 16,
        "global_head_dim": 32,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "num_hidden_layers": 5,
        "sliding_window": 8,
        "layer_types": [
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
        ],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
            },
        },
        "final_logit_softcapping": 8.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size_per_layer_input": 0,
        "tie_word_embeddings": True,
    },
    # gpt-oss: 4 experts (top-2) of width 64 (two MXFP4 groups, one per rank under TP=2), a
    # window of 8 on alternate layers, YaRN stretching 128 positions to 512 (its slow pairs
    # interpolate at every position), and a SwiGLU clamp of 2 (the released 7 would never bind
    # at this size).
    "GptOssForCausalLM": {
        "head_dim": 24,  # not hidden / heads (16), as in the released models
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
        "sliding_window": 8,
        "swiglu_limit": 2.0,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 128,
        },
    },
    "DeepseekV2ForCausalLM": dict(_DEEPSEEK),
    "DeepseekV3ForCausalLM": {**_DEEPSEEK, "n_group": 4, "topk_group": 2, "norm_topk_prob": True},
}
# Encoder-only embedding models: a WordPiece tokenizer that adds [CLS] ... [SEP] (as BERT's
# does), post-LayerNorm, GELU. XLM-RoBERTa has one token type and positions after padding_idx.
# The *ForSequenceClassification heads (cross-encoders, a Qwen3 classifier) take `num_labels`.
_ENCODER_ARCHS = {
    "BertModel",
    "BertForMaskedLM",
    "XLMRobertaModel",
    "BertForSequenceClassification",
    "XLMRobertaForSequenceClassification",
}
_XLMR = {"type_vocab_size": 1, "max_position_embeddings": 514}
_ENCODER_DEFAULTS: dict[str, dict[str, Any]] = {
    "XLMRobertaModel": _XLMR,
    "XLMRobertaForSequenceClassification": _XLMR,
}
ENCODER_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# Encoder-decoder models: the byte-level BPE tokenizer; BART's decoder starts from EOS as
# BART's does; no forced BOS/EOS logits processors (vLLM has none either), scaled embeddings
# so that the scale is exercised. Whisper: 16 mel bins and a 1 s window (100 frames, 50 encoder
# tokens) so that tests are fast, and its special tokens added to the tokenizer.
_SEQ2SEQ_ARCHS = {"BartForConditionalGeneration", "WhisperForConditionalGeneration"}
WHISPER_SPECIAL_TOKENS = ["<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"]
WHISPER_WINDOW_SECONDS = 1
WHISPER_NUM_MEL_BINS = 16
_CACHE_DIR: str | None = None


@lru_cache(maxsize=1)
def tiny_tokenizer() -> Any:
    """A byte-level BPE (every string encodes; no <unk>) with BOS/EOS special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[EOS_TOKEN, BOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TEXT, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        model_max_length=512,
        chat_template=CHAT_TEMPLATE,
    )


@lru_cache(maxsize=1)
def tiny_wordpiece_tokenizer() -> Any:
    """A lower-casing WordPiece tokenizer with BERT's special tokens; encoding adds [CLS] and
    [SEP] around the text (a `TemplateProcessing` post-processor), as BERT's tokenizer does."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE, special_tokens=ENCODER_SPECIAL_TOKENS, show_progress=False
    )
    tok.train_from_iterator(_TEXT, trainer=trainer)
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=512,
    )


def _tiny_encoder_config(arch: str, overrides: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    tokenizer = tiny_wordpiece_tokenizer()
    kwargs: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 512,
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "initializer_range": 0.2,
        "architectures": [arch],
        **_ENCODER_DEFAULTS.get(arch, {}),
        **overrides,
    }
    config = AutoConfig.for_model(_MODEL_TYPES[arch], **kwargs)
    config.dtype = torch.float32
    return config


@lru_cache(maxsize=1)
def tiny_whisper_tokenizer() -> Any:
    """The byte-level BPE plus Whisper's task tokens (as special tokens, never split)."""
    tok = copy.deepcopy(tiny_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": WHISPER_SPECIAL_TOKENS})
    return tok


def _tiny_seq2seq_config(arch: str, overrides: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    common: dict[str, Any] = {
        "d_model": 64,
        "encoder_layers": 2,
        "decoder_layers": 2,
        "encoder_attention_heads": 4,
        "decoder_attention_heads": 4,
        "encoder_ffn_dim": 128,
        "decoder_ffn_dim": 128,
        "init_std": 0.2,
        "architectures": [arch],
    }
    if arch == "WhisperForConditionalGeneration":
        tok = tiny_whisper_tokenizer()
        eos = tok.eos_token_id
        common |= {
            "vocab_size": len(tok),
            "num_mel_bins": WHISPER_NUM_MEL_BINS,
            "max_source_positions": 50 * WHISPER_WINDOW_SECONDS,
            "max_target_positions": 64,
            "bos_token_id": eos,
            "eos_token_id": eos,
            "pad_token_id": eos,
            "decoder_start_token_id": tok.convert_tokens_to_ids("<|startoftranscript|>"),
            "suppress_tokens": [],
            "begin_suppress_tokens": None,
        }
    else:
        tok = tiny_tokenizer()
        common |= {
            "vocab_size": len(tok),
            "max_position_embeddings": 128,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": 2,
            "decoder_start_token_id": tok.eos_token_id,
            "forced_eos_token_id": None,
            "scale_embedding": True,
        }
    config = AutoConfig.for_model(_MODEL_TYPES[arch], **{**common, **overrides})
    config.dtype = torch.float32
    return config


def tiny_config(arch: str = "LlamaForCausalLM", **overrides: Any) -> Any:
    """The HF config of a tiny model: hidden 64, 2 layers, 4 heads (2 KV), fp32."""
    from transformers import AutoConfig

    if arch not in _MODEL_TYPES:
        raise ValueError(f"no tiny checkpoint recipe for {arch!r}; known: {sorted(_MODEL_TYPES)}")
    if arch in _ENCODER_ARCHS:
        return _tiny_encoder_config(arch, overrides)
    if arch in _SEQ2SEQ_ARCHS:
        return _tiny_seq2seq_config(arch, overrides)
    tokenizer = tiny_tokenizer()
    kwargs: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "tie_word_embeddings": False,
        "initializer_range": 0.2,
        "rms_norm_eps": 1e-6,
        "architectures": [arch],
        **_ARCH_DEFAULTS.get(arch, {}),
        **overrides,
    }
    config = AutoConfig.for_model(_MODEL_TYPES[arch], **kwargs)
    config.dtype = torch.float32
    return config


@torch.no_grad()
def _perturb(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed + 1)
    for name, param in model.named_parameters():
        # gpt-oss's stacked expert biases are 2-D (`gate_up_proj_bias [E, 2I]`).
        if param.dim() == 1 or name.endswith("_bias"):
            noise = torch.randn(param.shape, generator=generator) * 0.1
            param.copy_(noise + (0.0 if name.endswith("bias") else 1.0))
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # DeepSeek-V3: a saved buffer, zero in HF
            buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)
        if name.endswith("layer_scalar"):  # Gemma 4: a saved buffer, one in HF
            buffer.copy_(1.0 + torch.randn(buffer.shape, generator=generator) * 0.3)


def _build(out_dir: str, arch: str, seed: int, overrides: dict[str, Any]) -> None:
    import transformers

    config = tiny_config(arch, **copy.deepcopy(overrides))  # HF edits rope dicts in place
    torch.manual_seed(seed)
    if arch in _ENCODER_ARCHS:
        model = getattr(transformers, arch)(config)
        tokenizer = tiny_wordpiece_tokenizer()
    elif arch == "WhisperForConditionalGeneration":
        model = transformers.WhisperForConditionalGeneration(config)
        tokenizer = tiny_whisper_tokenizer()
        transformers.WhisperFeatureExtractor(
            feature_size=config.num_mel_bins, chunk_length=WHISPER_WINDOW_SECONDS
        ).save_pretrained(out_dir)
    elif arch in _SEQ2SEQ_ARCHS:
        model = getattr(transformers, arch)(config)
        tokenizer = tiny_tokenizer()
    elif arch.endswith("ForSequenceClassification"):
        model = getattr(transformers, arch)(config)
        tokenizer = tiny_tokenizer()
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tokenizer = tiny_tokenizer()
    _perturb(model, seed)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _cache_dir() -> str:
    global _CACHE_DIR
    if _CACHE_DIR is None:
        _CACHE_DIR = tempfile.mkdtemp(prefix="tokenwise-tiny-")
        atexit.register(shutil.rmtree, _CACHE_DIR, True)
    return _CACHE_DIR


def build_tiny_checkpoint(
    tmp_path: str | os.PathLike[str],
    arch: str = "LlamaForCausalLM",
    *,
    seed: int = 0,
    **config_overrides: Any,
) -> str:
    """Write a tiny random `arch` checkpoint with a tokenizer under `tmp_path`; return its dir.

    `config_overrides` go to the HF config (e.g. `tie_word_embeddings=True`,
    `sliding_window=8`, `rope_scaling={...}`, `num_hidden_layers=1`). Same arguments, same
    bytes: the weights depend only on `seed` and the config.
    """
    key = json.dumps([arch, seed, config_overrides], sort_keys=True, default=str)
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    cached = os.path.join(_cache_dir(), digest)
    if not os.path.isdir(cached):
        staging = tempfile.mkdtemp(dir=_cache_dir())
        _build(staging, arch, seed, config_overrides)
        os.replace(staging, cached)
    out = os.path.join(os.fspath(tmp_path), f"{arch}-{digest}")
    shutil.copytree(cached, out, dirs_exist_ok=True)
    return out
