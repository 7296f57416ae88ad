"""The architectures a trained model maps to: GPT-2 and Llama, as `transformers` names them.

Each `Architecture` knows, for the sizes of one model, sexpgpu's parameter
names and shapes (``examples/gpt.lisp``, ``examples/llama.lisp``), the
`transformers` name of each and how its layout differs (a `torch.nn.Linear`
holds ``[out in]``, sexpgpu and GPT-2's ``Conv1D`` ``[in out]``), and the
``config.json`` that describes it. `match` compares a model with each
architecture and says the first thing that differs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from sexpgpu.ir.ops import Op
from sexpgpu.train.hf.facts import ModelFacts

__all__ = ["ARCHITECTURES", "Architecture", "Sizes", "mismatch"]

Shapes = Mapping[str, tuple[int, ...]]


@dataclass(frozen=True)
class Sizes:
    """A model's sizes, as a `transformers` config gives them."""

    layers: int
    width: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int
    ffn: int
    eps: float = 1e-5
    rope_base: float = 10000.0


@dataclass(frozen=True)
class Entry:
    """One parameter: sexpgpu's name and shape, transformers' name, transposed or not.

    Entries that share transformers' name are joined along the last axis, in order.
    """

    ours: str
    shape: tuple[int, ...]
    theirs: str
    transpose: bool = False


@dataclass(frozen=True)
class Architecture:
    """A `transformers` architecture and how sexpgpu's parameters map onto it."""

    name: str  # config.json's model_type
    entries: Callable[[str, Sizes], list[Entry]]
    config: Callable[[Sizes], dict[str, Any]]
    sizes: Callable[[ModelFacts, Shapes], Sizes | str]
    ops: frozenset[Op]  # ops its graph must use (gelu or silu: the activation)

    def to_hf(self, model: str, sizes: Sizes, params: Mapping[str, np.ndarray]) -> dict:
        """sexpgpu's parameters -> transformers' tensors (float32, contiguous)."""
        out: dict[str, np.ndarray] = {}
        for e in self.entries(model, sizes):
            value = np.asarray(params[e.ours], np.float32)
            out.setdefault(e.theirs, []).append(value.T if e.transpose else value)  # type: ignore[arg-type]
        return {
            k: np.ascontiguousarray(np.concatenate(v, axis=-1) if len(v) > 1 else v[0])
            for k, v in out.items()
        }

    def from_hf(self, model: str, sizes: Sizes, tensors: Mapping[str, np.ndarray]) -> dict:
        """transformers' tensors -> sexpgpu's parameters (the inverse of `to_hf`)."""
        parts: dict[str, list[Entry]] = {}
        for e in self.entries(model, sizes):
            parts.setdefault(e.theirs, []).append(e)
        out: dict[str, np.ndarray] = {}
        for theirs, entries in parts.items():
            value = np.asarray(tensors[theirs], np.float32)
            cuts = np.cumsum([e.shape[-1] for e in entries])[:-1]
            pieces = np.split(value, cuts, axis=-1) if len(entries) > 1 else [value]
            for e, piece in zip(entries, pieces, strict=True):
                out[e.ours] = np.ascontiguousarray(piece.T if e.transpose else piece)
        return out

    def hf_shapes(self, model: str, sizes: Sizes) -> dict[str, tuple[int, ...]]:
        """transformers' tensor names -> their shapes."""
        return {k: v.shape for k, v in self.to_hf(model, sizes, _zeros(self, model, sizes)).items()}


def _zeros(arch: Architecture, model: str, sizes: Sizes) -> dict[str, np.ndarray]:
    return {e.ours: np.zeros(e.shape, np.float32) for e in arch.entries(model, sizes)}


def _blocks(shapes: Shapes, model: str) -> int:
    """How many ``MODEL/block.N`` layers the parameters hold."""
    prefix = f"{model}/block."
    numbers = {k[len(prefix) :].split("/")[0] for k in shapes if k.startswith(prefix)}
    return len(numbers)


# ---------------------------------------------------------------- GPT-2


def _gpt2_entries(m: str, s: Sizes) -> list[Entry]:
    c, f = s.width, s.ffn
    out = [
        Entry(f"{m}/wte", (s.vocab, c), "transformer.wte.weight"),
        Entry(f"{m}/embed/weight", (s.seq, c), "transformer.wpe.weight"),
    ]
    for i in range(s.layers):
        p, h = f"{m}/block.{i}", f"transformer.h.{i}"
        out += [
            Entry(f"{p}/layernorm/weight", (c,), f"{h}.ln_1.weight"),
            Entry(f"{p}/layernorm/bias", (c,), f"{h}.ln_1.bias"),
        ]
        for w in "qkv":  # c_attn is [q k v] side by side: Conv1D's [in 3*out]
            out.append(Entry(f"{p}/attention/w{w}", (c, c), f"{h}.attn.c_attn.weight"))
        for w in "qkv":
            out.append(Entry(f"{p}/attention/b{w}", (c,), f"{h}.attn.c_attn.bias"))
        out += [
            Entry(f"{p}/attention/wo", (c, c), f"{h}.attn.c_proj.weight"),
            Entry(f"{p}/attention/bo", (c,), f"{h}.attn.c_proj.bias"),
            Entry(f"{p}/layernorm.1/weight", (c,), f"{h}.ln_2.weight"),
            Entry(f"{p}/layernorm.1/bias", (c,), f"{h}.ln_2.bias"),
            Entry(f"{p}/linear/weight", (c, f), f"{h}.mlp.c_fc.weight"),
            Entry(f"{p}/linear/bias", (f,), f"{h}.mlp.c_fc.bias"),
            Entry(f"{p}/linear.1/weight", (f, c), f"{h}.mlp.c_proj.weight"),
            Entry(f"{p}/linear.1/bias", (c,), f"{h}.mlp.c_proj.bias"),
        ]
    out += [
        Entry(f"{m}/layernorm/weight", (c,), "transformer.ln_f.weight"),
        Entry(f"{m}/layernorm/bias", (c,), "transformer.ln_f.bias"),
    ]
    return out


def _matrices(
    facts: ModelFacts, shapes: Shapes, embed: str, names: tuple[str, str, str]
) -> tuple[int, int, int] | str:
    """``(vocab, width, ffn)`` read off the token embedding `embed` and the first linear weight.

    Or what is missing: `names` are the embedding's name in the family, the
    weight's kind and its name in the family.
    """
    m = facts.model
    wte, ffn = shapes.get(f"{m}/{embed}"), shapes.get(f"{m}/block.0/linear/weight")
    if wte is None or len(wte) != 2:
        return f"no token embedding `{m}/{embed}` [vocab width] ({names[0]})"
    if ffn is None or len(ffn) != 2:
        return f"no {names[1]} `{m}/block.0/linear/weight` ({names[2]})"
    if not facts.attentions:
        return "no attention"
    return wte[0], wte[1], ffn[1]


def _gpt2_sizes(facts: ModelFacts, shapes: Shapes) -> Sizes | str:
    found = _matrices(facts, shapes, "wte", ("GPT-2's wte", "feed-forward layer", "GPT-2's c_fc"))
    if isinstance(found, str):
        return found
    vocab, width, ffn = found
    heads = facts.attentions[0][0]
    eps = next(iter(facts.layernorm_eps), 1e-5)
    return Sizes(_blocks(shapes, facts.model), width, heads, heads, vocab, facts.seq, ffn, eps)


def _gpt2_config(s: Sizes) -> dict[str, Any]:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": s.vocab,
        "n_positions": s.seq,
        "n_ctx": s.seq,
        "n_embd": s.width,
        "n_layer": s.layers,
        "n_head": s.heads,
        "n_inner": s.ffn,
        "activation_function": "gelu_new",  # the tanh approximation, as sexpgpu's gelu
        "layer_norm_epsilon": s.eps,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": "float32",
    }


# ---------------------------------------------------------------- Llama


def _llama_entries(m: str, s: Sizes) -> list[Entry]:
    c, f, d = s.width, s.ffn, s.width // s.heads
    kv = s.kv_heads * d
    out = [Entry(f"{m}/embed/weight", (s.vocab, c), "model.embed_tokens.weight")]
    for i in range(s.layers):
        p, h = f"{m}/block.{i}", f"model.layers.{i}"
        out += [
            Entry(f"{p}/rmsnorm/weight", (c,), f"{h}.input_layernorm.weight"),
            Entry(f"{p}/attention/wq", (c, c), f"{h}.self_attn.q_proj.weight", True),
            Entry(f"{p}/attention/wk", (c, kv), f"{h}.self_attn.k_proj.weight", True),
            Entry(f"{p}/attention/wv", (c, kv), f"{h}.self_attn.v_proj.weight", True),
            Entry(f"{p}/attention/wo", (c, c), f"{h}.self_attn.o_proj.weight", True),
            Entry(f"{p}/rmsnorm.1/weight", (c,), f"{h}.post_attention_layernorm.weight"),
            Entry(f"{p}/linear/weight", (c, f), f"{h}.mlp.gate_proj.weight", True),
            Entry(f"{p}/linear.1/weight", (c, f), f"{h}.mlp.up_proj.weight", True),
            Entry(f"{p}/linear.2/weight", (f, c), f"{h}.mlp.down_proj.weight", True),
        ]
    out += [
        Entry(f"{m}/rmsnorm/weight", (c,), "model.norm.weight"),
        Entry(f"{m}/linear/weight", (c, s.vocab), "lm_head.weight", True),
    ]
    return out


def _llama_sizes(facts: ModelFacts, shapes: Shapes) -> Sizes | str:
    names = ("Llama's embed_tokens", "gate projection", "Llama's gate_proj")
    found = _matrices(facts, shapes, "embed/weight", names)
    if isinstance(found, str):
        return found
    vocab, width, ffn = found
    heads, kv, _, _ = facts.attentions[0]
    base = next(iter(facts.rope_bases), 10000.0)
    return Sizes(_blocks(shapes, facts.model), width, heads, kv, vocab, facts.seq, ffn, 1e-5, base)


def _llama_config(s: Sizes) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": s.vocab,
        "hidden_size": s.width,
        "intermediate_size": s.ffn,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.width // s.heads,
        "max_position_embeddings": s.seq,
        "rms_norm_eps": s.eps,
        "rope_theta": s.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": s.rope_base},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": "float32",
    }


ARCHITECTURES: dict[str, Architecture] = {
    "gpt2": Architecture(
        "gpt2", _gpt2_entries, _gpt2_config, _gpt2_sizes, frozenset({Op.GELU, Op.LAYERNORM})
    ),
    "llama": Architecture(
        "llama", _llama_entries, _llama_config, _llama_sizes, frozenset({Op.SIGMOID, Op.RSQRT})
    ),
}


def mismatch(arch: Architecture, facts: ModelFacts, shapes: Shapes) -> tuple[Sizes | None, str]:
    """(the sizes, "") when the model has `arch`'s parameters and parts, else (None, why not).

    Why not is the first difference: a missing, extra or misshapen parameter
    (in sexpgpu's order), a missing activation, or non-causal attention.
    """
    sizes = arch.sizes(facts, shapes)
    if isinstance(sizes, str):
        return None, sizes
    entries = arch.entries(facts.model, sizes)
    for e in entries:
        if e.ours not in shapes:
            return None, f"no parameter `{e.ours}` {list(e.shape)} ({e.theirs})"
        if tuple(shapes[e.ours]) != e.shape:
            got = list(shapes[e.ours])
            return None, f"`{e.ours}` is {got}, {arch.name} has {list(e.shape)} ({e.theirs})"
    known = {e.ours for e in entries}
    extra = [k for k in shapes if k not in known]
    if extra:
        return None, f"parameter `{extra[0]}` {list(shapes[extra[0]])} has no place in {arch.name}"
    missing = sorted(op.name.lower() for op in arch.ops - facts.ops)
    if missing:
        return None, f"the model computes no {missing[0]}, which {arch.name} does"
    if len(facts.attentions) != sizes.layers or not all(a[3] for a in facts.attentions):
        return None, f"{arch.name} has one causal attention per layer"
    if sizes.width % sizes.heads:
        return None, f"width {sizes.width} does not split into {sizes.heads} heads"
    return sizes, ""
