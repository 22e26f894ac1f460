"""The gated delta rule of Gated DeltaNet in PyTorch: the chunked form and the per-token form.

Per value head the state `S` is a `[dk, dv]` matrix (an associative memory from keys to values).
Each token `t` first decays it, `S *= exp(g_t)` (`g_t <= 0`), then writes its value under its
key with the delta rule, `S += k_t (beta_t (v_t - S^T k_t))^T` (replace what the memory held
for `k_t` by a `beta_t` blend of `v_t`), and reads `o_t = S^T q_t`. Keys and queries arrive
L2-normalised and the queries already scaled by `dk ** -0.5`.

The per-token form (`delta_rule_step`) is the definition: decode uses it (the C kernel of
`tokenwise.native.gdn_decode` computes the same step on CPU), and so do verification steps that
must keep the state after every token. Prefill uses the chunked form: within a chunk of 64
tokens the writes are a lower-triangular system solved at once (the WY representation of the
product of the chunk's rank-one updates), so a prompt costs a few batched matmuls per chunk
instead of a Python step per token. Both compute in float32 whatever the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(sum(x^2) + eps)` over the last dim (the epsilon inside the root, as FLA)."""
    return x * torch.rsqrt(x.pow(2).sum(dim=-1, keepdim=True) + eps)


def delta_rule_step(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for a batch of heads: `state` `[..., dk, dv]`, `q`/`k` `[..., dk]`, `v`
    `[..., dv]`, `g`/`beta` `[...]`. Returns `(o [..., dv], new state)`."""
    state = state * g.exp()[..., None, None]
    recalled = torch.einsum("...k,...kv->...v", k, state)
    delta = (v - recalled) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return torch.einsum("...k,...kv->...v", q, state), state


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    kept: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token over one sequence: `q`/`k` `[T, H, dk]`, `v` `[T, H, dv]`, `g`/`beta`
    `[T, H]`, `state` `[H, dk, dv]`. Returns `(o [T, H, dv], final state)`; where `kept`
    (`[T, H * dk * dv]`) is given, row t receives the state after token t."""
    s = state.float()
    out = v.new_empty(v.shape, dtype=torch.float32)
    for t in range(q.shape[0]):
        out[t], s = delta_rule_step(s, q[t].float(), k[t].float(), v[t].float(), g[t], beta[t])
        if kept is not None:
            kept[t] = s.flatten()
    return out, s


def _chunks(x: torch.Tensor, pad: int, chunk: int) -> torch.Tensor:
    """`[T, H, ...]` -> `[H, T / chunk, chunk, ...]`, zero-padded at the end (float32)."""
    x = x.float().transpose(0, 1)
    if x.dim() == 2:
        return F.pad(x, (0, pad)).unflatten(1, (-1, chunk))
    return F.pad(x, (0, 0, 0, pad)).unflatten(1, (-1, chunk))


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same result as `recurrent_gated_delta_rule` (up to rounding), chunk by chunk.

    Padding tokens (k = v = 0, g = 0, beta = 0) leave the state unchanged, so the sequence is
    padded to whole chunks. In a chunk, with `c` the running sum of `g` and `D[i, j] =
    exp(c_i - c_j)` (i >= j) the decay between two of its tokens, the values actually written
    `u` solve `(I + tril(diag(beta) K K^T * D, -1)) u = beta (V - exp(c) K S0)`; the outputs
    are `exp(c) Q S0 + (Q K^T * D) u` and the state after the chunk `exp(c_last) S0 +
    (exp(c_last - c) K)^T u`.
    """
    length = q.shape[0]
    pad = (-length) % chunk_size
    q, k, v = (_chunks(x, pad, chunk_size) for x in (q, k, v))
    g, beta = (_chunks(x, pad, chunk_size) for x in (g, beta))
    dk, dv = k.shape[-1], v.shape[-1]
    cum = g.cumsum(dim=-1)  # [H, N, C]
    future = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(future, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # only its strict lower part is read
    rhs = torch.cat((v * beta[..., None], k_beta * cum.exp()[..., None]), dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    written, state_part = solved.split((dv, dk), dim=-1)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_from_start = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [H, N, 1, 1]
    s = state.float()
    out = torch.empty_like(written)
    for n in range(q.shape[1]):
        u = written[:, n] - state_part[:, n] @ s
        out[:, n] = q_from_start[:, n] @ s + scores[:, n] @ u
        s = s * chunk_decay[:, n] + k_to_end[:, n].transpose(-1, -2) @ u
    return out.flatten(1, 2)[:, :length].transpose(0, 1), s


def causal_conv(window: torch.Tensor, weight: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Depthwise causal convolution then SiLU: `window` `[K - 1 + T, C]` (the previous `K - 1`
    inputs, then this step's), `weight` `[C, K]`. Returns `[T, C]`."""
    taps = weight.shape[1]
    out = window[:num_tokens] * weight[:, 0]
    for j in range(1, taps):
        out = out + window[j : j + num_tokens] * weight[:, j]
    return F.silu(out)
