"""GPT-2 and Llama in NumPy, over `transformers`' tensors: what an export is checked against.

Written from the architectures' definitions (Radford et al. 2019; Touvron
et al. 2023, arXiv:2302.13971) in float64, so that a model whose parameters
fit an architecture but which computes something else (another norm, a
missing residual, another rotary base) is refused before a folder is written.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from sexpgpu.train.hf.architectures import Sizes

__all__ = ["REFERENCES"]

Tensors = Mapping[str, np.ndarray]


def _layernorm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def _rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal softmax attention over (H S D) heads."""
    s = q.shape[-2]
    scores = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])  # (H S S)
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return weights / weights.sum(-1, keepdims=True) @ v


def _heads(x: np.ndarray, count: int) -> np.ndarray:
    s, w = x.shape
    return x.reshape(s, count, w // count).transpose(1, 0, 2)  # (H S D)


def _merge(x: np.ndarray) -> np.ndarray:
    h, s, d = x.shape
    return x.transpose(1, 0, 2).reshape(s, h * d)


def gpt2_logits(t: Tensors, s: Sizes, ids: np.ndarray) -> np.ndarray:
    """GPT2LMHeadModel's logits (S V) for one row of ids."""
    g = {k.removeprefix("transformer."): np.asarray(v, np.float64) for k, v in t.items()}
    x = g["wte.weight"][ids] + g["wpe.weight"][: len(ids)]
    for i in range(s.layers):
        p = f"h.{i}."
        h = _layernorm(x, g[p + "ln_1.weight"], g[p + "ln_1.bias"], s.eps)
        qkv = h @ g[p + "attn.c_attn.weight"] + g[p + "attn.c_attn.bias"]
        q, k, v = (_heads(part, s.heads) for part in np.split(qkv, 3, axis=-1))
        x = x + _merge(_attend(q, k, v)) @ g[p + "attn.c_proj.weight"] + g[p + "attn.c_proj.bias"]
        h = _layernorm(x, g[p + "ln_2.weight"], g[p + "ln_2.bias"], s.eps)
        u = h @ g[p + "mlp.c_fc.weight"] + g[p + "mlp.c_fc.bias"]
        u = 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u**3)))
        x = x + u @ g[p + "mlp.c_proj.weight"] + g[p + "mlp.c_proj.bias"]
    x = _layernorm(x, g["ln_f.weight"], g["ln_f.bias"], s.eps)
    return x @ g["wte.weight"].T


def _rotate(x: np.ndarray, base: float) -> np.ndarray:
    """Rotary embeddings on (H S D), the half-split convention (`rotate_half`)."""
    _, seq, d = x.shape
    inv = base ** (-np.arange(0, d, 2) / d)
    theta = np.arange(seq)[:, None] * inv[None]  # (S D/2)
    cos, sin = (
        np.cos(np.concatenate([theta, theta], -1)),
        np.sin(np.concatenate([theta, theta], -1)),
    )
    half = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


def llama_logits(t: Tensors, s: Sizes, ids: np.ndarray) -> np.ndarray:
    """LlamaForCausalLM's logits (S V) for one row of ids."""
    g = {k: np.asarray(v, np.float64) for k, v in t.items()}
    x = g["model.embed_tokens.weight"][ids]
    group = s.heads // s.kv_heads
    for i in range(s.layers):
        p = f"model.layers.{i}."
        h = _rmsnorm(x, g[p + "input_layernorm.weight"], s.eps)
        q = _rotate(_heads(h @ g[p + "self_attn.q_proj.weight"].T, s.heads), s.rope_base)
        k = _rotate(_heads(h @ g[p + "self_attn.k_proj.weight"].T, s.kv_heads), s.rope_base)
        v = _heads(h @ g[p + "self_attn.v_proj.weight"].T, s.kv_heads)
        k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
        x = x + _merge(_attend(q, k, v)) @ g[p + "self_attn.o_proj.weight"].T
        h = _rmsnorm(x, g[p + "post_attention_layernorm.weight"], s.eps)
        gate = h @ g[p + "mlp.gate_proj.weight"].T
        up = h @ g[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ g[p + "mlp.down_proj.weight"].T
    x = _rmsnorm(x, g["model.norm.weight"], s.eps)
    return x @ g["lm_head.weight"].T


REFERENCES = {"gpt2": gpt2_logits, "llama": llama_logits}
