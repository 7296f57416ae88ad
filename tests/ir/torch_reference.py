"""PyTorch twins of the language's GPT, Llama and MLP, addressed by sexpgpu path names.

The models are written with ``torch.nn`` modules (Linear, LayerNorm,
Embedding, scaled_dot_product_attention), independently of sexpgpu, so a
test can copy sexpgpu's initial parameters in by path name and compare the
loss and every gradient. sexpgpu stores a linear weight as ``[in out]``
(``x @ w``); ``torch.nn.Linear`` stores ``[out in]``, so copies transpose.

Imported by tests and by ``benches/cpu_interpreter.py``; torch is imported
only here, never by the package.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["TorchGPT", "TorchLlama", "TorchMLP", "load_named", "named_grads"]


class _Block(nn.Module):
    """Pre-norm transformer block: x + attention(ln x); x + mlp(ln x)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width, eps=1e-5)
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.o = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width, eps=1e-5)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        h = self.ln1(x)

        def split(t: torch.Tensor) -> torch.Tensor:  # (B, S, W) -> (B, H, S, D)
            return t.view(b, s, self.heads, w // self.heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(
            split(self.q(h)), split(self.k(h)), split(self.v(h)), is_causal=True
        )
        x = x + self.o(y.transpose(1, 2).reshape(b, s, w))
        return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))


class TorchGPT(nn.Module):
    """The GPT of LANGUAGE.md: tied token embedding, learned positions, pre-norm blocks."""

    def __init__(self, layers: int, width: int, heads: int, seq: int, vocab: int) -> None:
        super().__init__()
        self.wte = nn.Parameter(torch.zeros(vocab, width))
        self.wpe = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width, eps=1e-5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1])
        x = F.embedding(tokens, self.wte) + self.wpe(positions)  # (B, S, W)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.T  # (B, S, V)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def path_names(self, model: str = "gpt") -> dict[str, tuple[nn.Parameter, bool]]:
        """sexpgpu path name -> (torch parameter, stored transposed)."""
        names: dict[str, tuple[nn.Parameter, bool]] = {
            f"{model}/wte": (self.wte, False),
            f"{model}/embed/weight": (self.wpe.weight, False),
            f"{model}/layernorm/weight": (self.ln_f.weight, False),
            f"{model}/layernorm/bias": (self.ln_f.bias, False),
        }
        for i, blk in enumerate(self.blocks):
            p = f"{model}/block.{i}"
            names[f"{p}/layernorm/weight"] = (blk.ln1.weight, False)
            names[f"{p}/layernorm/bias"] = (blk.ln1.bias, False)
            for short, lin in zip("qkvo", (blk.q, blk.k, blk.v, blk.o), strict=True):
                names[f"{p}/attention/w{short}"] = (lin.weight, True)
                names[f"{p}/attention/b{short}"] = (lin.bias, False)
            names[f"{p}/layernorm.1/weight"] = (blk.ln2.weight, False)
            names[f"{p}/layernorm.1/bias"] = (blk.ln2.bias, False)
            names[f"{p}/linear/weight"] = (blk.up.weight, True)
            names[f"{p}/linear/bias"] = (blk.up.bias, False)
            names[f"{p}/linear.1/weight"] = (blk.down.weight, True)
            names[f"{p}/linear.1/bias"] = (blk.down.bias, False)
        return names


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embeddings as Llama and GPT-NeoX apply them: the halves of d rotate together."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin


class _LlamaBlock(nn.Module):
    """x + attention(rmsnorm x) (grouped-query, rotary, no biases); x + swiglu(rmsnorm x)."""

    def __init__(self, width: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.d = heads, kv_heads, width // heads
        self.norm1 = nn.RMSNorm(width, eps=1e-5)
        self.q = nn.Linear(width, width, bias=False)
        self.k = nn.Linear(width, kv_heads * self.d, bias=False)
        self.v = nn.Linear(width, kv_heads * self.d, bias=False)
        self.o = nn.Linear(width, width, bias=False)
        self.norm2 = nn.RMSNorm(width, eps=1e-5)
        self.gate = nn.Linear(width, ffn, bias=False)
        self.up = nn.Linear(width, ffn, bias=False)
        self.down = nn.Linear(ffn, width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        h = self.norm1(x)
        q = _rotate(self.q(h).view(b, s, self.heads, self.d).transpose(1, 2), cos, sin)
        k = _rotate(self.k(h).view(b, s, self.kv_heads, self.d).transpose(1, 2), cos, sin)
        v = self.v(h).view(b, s, self.kv_heads, self.d).transpose(1, 2)
        group = self.heads // self.kv_heads  # each key/value head serves `group` query heads
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, s, w))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TorchLlama(nn.Module):
    """examples/llama.lisp in PyTorch: untied embedding and head, rotary base `base`."""

    def __init__(
        self,
        layers: int,
        width: int,
        heads: int,
        kv_heads: int,
        ffn: int,
        seq: int,
        vocab: int,
        base: float = 10000.0,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(_LlamaBlock(width, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(width, eps=1e-5)
        self.head = nn.Linear(width, vocab, bias=False)
        d = width // heads
        inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)  # (S, d/2)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (B, S, W)
        s = tokens.shape[1]
        cos, sin = self.cos[:s].to(x.dtype), self.sin[:s].to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))  # (B, S, V)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    def path_names(self, model: str = "llama") -> dict[str, tuple[nn.Parameter, bool]]:
        """sexpgpu path name -> (torch parameter, stored transposed)."""
        names: dict[str, tuple[nn.Parameter, bool]] = {
            f"{model}/embed/weight": (self.embed.weight, False),
            f"{model}/rmsnorm/weight": (self.norm.weight, False),
            f"{model}/linear/weight": (self.head.weight, True),
        }
        for i, blk in enumerate(self.blocks):
            p = f"{model}/block.{i}"
            names[f"{p}/rmsnorm/weight"] = (blk.norm1.weight, False)
            for short, lin in zip("qkvo", (blk.q, blk.k, blk.v, blk.o), strict=True):
                names[f"{p}/attention/w{short}"] = (lin.weight, True)
            names[f"{p}/rmsnorm.1/weight"] = (blk.norm2.weight, False)
            names[f"{p}/linear/weight"] = (blk.gate.weight, True)
            names[f"{p}/linear.1/weight"] = (blk.up.weight, True)
            names[f"{p}/linear.2/weight"] = (blk.down.weight, True)
        return names


class TorchMLP(nn.Module):
    """Two linear layers with a relu between: the digits classifier."""

    def __init__(self, inputs: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.l1 = nn.Linear(inputs, hidden)
        self.l2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self(x), y)

    def path_names(self, model: str = "mlp") -> dict[str, tuple[nn.Parameter, bool]]:
        """sexpgpu path name -> (torch parameter, stored transposed)."""
        return {
            f"{model}/linear/weight": (self.l1.weight, True),
            f"{model}/linear/bias": (self.l1.bias, False),
            f"{model}/linear.1/weight": (self.l2.weight, True),
            f"{model}/linear.1/bias": (self.l2.bias, False),
        }


def load_named(model: nn.Module, params: dict[str, np.ndarray], dtype=torch.float32) -> None:
    """Copy sexpgpu parameters (by path name) into `model`; every name must match."""
    names = model.path_names()  # type: ignore[operator]
    assert set(names) == set(params), sorted(set(names) ^ set(params))
    with torch.no_grad():
        for name, (tensor, transposed) in names.items():
            value = torch.from_numpy(np.ascontiguousarray(params[name])).to(dtype)
            tensor.copy_(value.T if transposed else value)


def named_grads(model: nn.Module) -> dict[str, np.ndarray]:
    """Each parameter's gradient under its sexpgpu path name and layout."""
    out = {}
    for name, (tensor, transposed) in model.path_names().items():  # type: ignore[operator]
        grad = tensor.grad.detach()
        out[name] = (grad.T if transposed else grad).double().numpy()
    return out


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """The tanh form of gelu, for NumPy references."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
