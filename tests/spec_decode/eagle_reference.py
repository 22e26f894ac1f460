"""A reference EAGLE proposer in plain torch: no KV cache, no batching, no engine.

It reads a head's checkpoint (the published layouts) and the target's Hugging Face model, and
proposes drafts for one sequence the slow, obvious way: the head runs over every position
from 0 each time, with transformers' features for the positions the target computed and its
own output rows for the drafts. Written from the EAGLE papers' and vLLM's descriptions, sharing
no code with tokenwise, so the engine's proposals (paged K/V, catch-up, rollback, scratch
blocks, batching) can be compared with it token for token.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import LlamaConfig


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotate-half RoPE over [T, heads, head_dim]."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    angles = positions[:, None].float() * inv[None, :]
    cos = torch.cat([angles.cos()] * 2, -1)[:, None, :]
    sin = torch.cat([angles.sin()] * 2, -1)[:, None, :]
    half = hd // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class ReferenceHead:
    def __init__(self, head_dir: str, method: str, target_model: torch.nn.Module) -> None:
        self.w = load_file(os.path.join(head_dir, "model.safetensors"))
        self.cfg = LlamaConfig.from_pretrained(head_dir)
        self.method = method
        self.embed = target_model.model.embed_tokens.weight.detach()
        self.lm_head = target_model.lm_head.weight.detach()
        rope = getattr(self.cfg, "rope_parameters", None) or {}
        self.theta = float(rope.get("rope_theta", getattr(self.cfg, "rope_theta", 10000.0)))

    def _layer(self, p: str, attn_in: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        w, cfg = self.w, self.cfg
        nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        hd = cfg.hidden_size // nh
        t = attn_in.shape[0]
        pos = torch.arange(t)
        q = _rope((attn_in @ w[f"{p}.self_attn.q_proj.weight"].T).view(t, nh, hd), pos, self.theta)
        k = _rope((attn_in @ w[f"{p}.self_attn.k_proj.weight"].T).view(t, nkv, hd), pos, self.theta)
        v = (attn_in @ w[f"{p}.self_attn.v_proj.weight"].T).view(t, nkv, hd)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
        scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
        out = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, nh * hd)
        h = out @ w[f"{p}.self_attn.o_proj.weight"].T + residual
        m = _rms(h, w[f"{p}.post_attention_layernorm.weight"], cfg.rms_norm_eps)
        gate, up = m @ w[f"{p}.mlp.gate_proj.weight"].T, m @ w[f"{p}.mlp.up_proj.weight"].T
        return (F.silu(gate) * up) @ w[f"{p}.mlp.down_proj.weight"].T + h

    def _run(self, tokens: torch.Tensor, feats: torch.Tensor) -> tuple[int, torch.Tensor]:
        """The head over positions 0..T-1 (`tokens[p]`: the token at p + 1, `feats[p]`: the
        feature at p); the greedy target token and the fed-back row after the last one."""
        w, eps = self.w, self.cfg.rms_norm_eps
        emb = self.embed[tokens]
        if self.method == "eagle":
            x = torch.cat([emb, feats], -1) @ w["fc.weight"].T
            if "fc.bias" in w:
                x = x + w["fc.bias"]
            out = self._layer("layers.0", x, x)  # no input norm on EAGLE's layer 0
            return int((out[-1] @ self.lm_head.T).argmax()), out[-1]
        attn_in = torch.cat(
            [
                _rms(emb, w["midlayer.input_layernorm.weight"], eps),
                _rms(feats, w["midlayer.hidden_norm.weight"], eps),
            ],
            -1,
        )
        prenorm = self._layer("midlayer", attn_in, feats)
        draft = int((_rms(prenorm[-1], w["norm.weight"], eps) @ w["lm_head.weight"].T).argmax())
        return draft + int(w["d2t"][draft]), prenorm[-1]

    def target_rows(self, features: torch.Tensor) -> torch.Tensor:
        """Transformers' features as the head reads them (EAGLE-3: fused by fc)."""
        return features @ self.w["fc.weight"].T if self.method == "eagle3" else features

    @torch.no_grad()
    def propose(self, tokens: list[int], rows: torch.Tensor, num_drafts: int) -> list[int]:
        """Drafts after `tokens` (n of them; `rows`: at least n - 1 head feature rows)."""
        n = len(tokens)
        ids = torch.tensor(tokens[1:], dtype=torch.int64)
        feats = rows[: n - 1]
        drafts: list[int] = []
        for _ in range(num_drafts):
            token, row = self._run(ids, feats)
            drafts.append(token)
            ids = torch.cat([ids, torch.tensor([token])])
            feats = torch.cat([feats, row[None]])
        return drafts
