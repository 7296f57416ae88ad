"""Every model-vocabulary entry traced and run on the interpreter against NumPy or PyTorch.

Each case is a model body over data fields of an ``arrays`` data set; the
model's output (``eval_step``) is compared with a reference computed from
the same fields and the program's initial parameters. Gradients per op are
the IR core's tests (tests/ir/test_ops.py); end-to-end gradients are
tests/test_gpt_equals_torch.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from sexpgpu.devices.cpu_device import CpuGraphs
from sexpgpu.ir.compile import compile_run
from sexpgpu.ir.vocabulary import VOCABULARY
from sexpgpu.lang import load_experiment_text

BATCH = 2
RNG = np.random.default_rng(11)
FIELDS = {
    "a": RNG.normal(size=(BATCH, 3, 4)).astype(np.float32),
    "r": RNG.normal(size=(BATCH, 1, 4)).astype(np.float32),
    "p": RNG.uniform(0.5, 2.0, size=(BATCH, 3, 4)).astype(np.float32),
    "w": RNG.normal(size=(BATCH, 4, 5)).astype(np.float32),
    "t": RNG.integers(0, 4, size=(BATCH, 3)).astype(np.int32),
}
ARGS = " ".join(FIELDS)

Ref = Callable[[dict, dict], np.ndarray]


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _norm(x: np.ndarray, centered: bool) -> np.ndarray:
    if centered:
        x = x - x.mean(-1, keepdims=True)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5)


def _rope(x: torch.Tensor, base: float) -> torch.Tensor:
    """Half-split rotary embeddings on [.. seq heads d] (Llama's rotate_half)."""
    s, d = x.shape[-3], x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    theta = torch.arange(s, dtype=torch.float64)[:, None] * inv  # (S d/2)
    cos, sin = (torch.cat([f(theta)] * 2, -1)[:, None, :] for f in (torch.cos, torch.sin))
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _attention(
    d: dict, q: dict, heads: int, causal: bool, kv: int | None = None, bias=True, rope=None
) -> np.ndarray:
    x = torch.from_numpy(d["a"]).double()
    b, s, w = x.shape
    kv = kv or heads

    def proj(name: str, count: int) -> torch.Tensor:  # (B S count D)
        y = x @ torch.from_numpy(q[f"m/attention/w{name}"]).double()
        if bias:
            y = y + torch.from_numpy(q[f"m/attention/b{name}"]).double()
        y = y.view(b, s, count, w // heads)
        return _rope(y, rope) if rope is not None and name in "qk" else y

    qs, ks, vs = proj("q", heads), proj("k", kv), proj("v", kv)
    ks, vs = (t.repeat_interleave(heads // kv, dim=2) for t in (ks, vs))
    y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (qs, ks, vs)), is_causal=causal)
    y = y.transpose(1, 2).reshape(b, s, w) @ torch.from_numpy(q["m/attention/wo"]).double()
    return (y + torch.from_numpy(q["m/attention/bo"]) if bias else y).numpy()


def _sdpa(d: dict, causal: bool) -> np.ndarray:
    x = torch.from_numpy(d["a"]).double()  # (B 3 4)
    qh = x.reshape(BATCH, 2, 3, 2)  # (B H=2 S=3 D=2)
    kh = x[..., :2].reshape(BATCH, 1, 3, 2).expand(BATCH, 2, 3, 2)  # one key/value head
    return F.scaled_dot_product_attention(qh, kh, kh, is_causal=causal, scale=0.5).numpy()


def _within(w: np.ndarray, lo: float, hi: float) -> np.ndarray:
    assert w.min() >= lo and w.max() < hi, (w.min(), w.max())  # drawn from :init
    return w


def _rope_of(d: dict, base: float) -> np.ndarray:
    return _rope(torch.from_numpy(d["a"]).double().reshape(2, 3, 1, 4), base).numpy()


def _cross_entropy(d: dict) -> float:
    logits = torch.from_numpy(d["a"]).double().reshape(-1, 4)
    return F.cross_entropy(logits, torch.from_numpy(d["t"]).long().reshape(-1)).item()


# (vocabulary entries covered, model body, reference(fields, params))
CASES: list[tuple[tuple[str, ...], str, Ref]] = [
    (("+",), "(+ a r)", lambda d, q: d["a"] + d["r"]),
    (("+",), "(+ a r 1.5 a)", lambda d, q: d["a"] + d["r"] + 1.5 + d["a"]),
    (("-",), "(- a r)", lambda d, q: d["a"] - d["r"]),
    (("-",), "(- a)", lambda d, q: -d["a"]),
    (("*",), "(* 2 a r)", lambda d, q: 2 * d["a"] * d["r"]),
    (("/",), "(/ a p)", lambda d, q: d["a"] / d["p"]),
    (("neg",), "(neg a)", lambda d, q: -d["a"]),
    (("exp",), "(exp a)", lambda d, q: np.exp(d["a"])),
    (("log",), "(log p)", lambda d, q: np.log(d["p"])),
    (("sqrt",), "(sqrt p)", lambda d, q: np.sqrt(d["p"])),
    (("rsqrt",), "(rsqrt p)", lambda d, q: 1 / np.sqrt(d["p"])),
    (("pow",), "(pow p 1.5)", lambda d, q: d["p"] ** 1.5),
    (("abs",), "(abs a)", lambda d, q: np.abs(d["a"])),
    (("sin",), "(sin a)", lambda d, q: np.sin(d["a"])),
    (("cos",), "(cos a)", lambda d, q: np.cos(d["a"])),
    (("<", "where"), "(where (< a r) a r)", lambda d, q: np.where(d["a"] < d["r"], d["a"], d["r"])),
    (("<=",), "(cast (<= a 0) :dtype f32)", lambda d, q: (d["a"] <= 0).astype(np.float32)),
    ((">",), "(cast (> a r) :dtype f32)", lambda d, q: (d["a"] > d["r"]).astype(np.float32)),
    ((">=",), "(cast (>= p 1) :dtype f32)", lambda d, q: (d["p"] >= 1).astype(np.float32)),
    (("=",), "(where (= t 2) 1.0 0.0)", lambda d, q: (d["t"] == 2).astype(np.float32)),
    (("max",), "(max a r)", lambda d, q: np.maximum(d["a"], d["r"])),
    (("min",), "(min a 0.25)", lambda d, q: np.minimum(d["a"], 0.25)),
    (("relu",), "(relu a)", lambda d, q: np.maximum(d["a"], 0)),
    (
        ("gelu",),
        "(gelu a)",
        lambda d, q: F.gelu(torch.from_numpy(d["a"]).double(), approximate="tanh").numpy(),
    ),
    (("silu",), "(silu a)", lambda d, q: d["a"] / (1 + np.exp(-d["a"]))),
    (("sigmoid",), "(sigmoid a)", lambda d, q: 1 / (1 + np.exp(-d["a"]))),
    (("tanh",), "(tanh a)", lambda d, q: np.tanh(d["a"])),
    (("softmax",), "(softmax a)", lambda d, q: _softmax(d["a"], -1)),
    (("softmax",), "(softmax a :axis 1)", lambda d, q: _softmax(d["a"], 1)),
    (
        ("log-softmax",),
        "(log-softmax a :axis -2)",
        lambda d, q: np.log(_softmax(d["a"].astype(np.float64), -2)),
    ),
    (("sum",), "(sum a :axis 1)", lambda d, q: d["a"].sum(1)),
    (("sum",), "(sum a :axis [0 2] :keep true)", lambda d, q: d["a"].sum((0, 2), keepdims=True)),
    (("mean",), "(mean a :axis -1 :keep true)", lambda d, q: d["a"].mean(-1, keepdims=True)),
    (("mean",), "(reshape (mean a) [1])", lambda d, q: d["a"].mean().reshape(1)),
    (("amax",), "(amax a :axis 1)", lambda d, q: d["a"].max(1)),
    (("reshape",), "(reshape a [2 -1])", lambda d, q: d["a"].reshape(2, 12)),
    (("transpose",), "(transpose a)", lambda d, q: d["a"].transpose(0, 2, 1)),
    (("transpose",), "(transpose a :axes [2 0 1])", lambda d, q: d["a"].transpose(2, 0, 1)),
    (("slice",), "(slice a :axis 1 :from 1 :to 3)", lambda d, q: d["a"][:, 1:3]),
    (("slice",), "(slice a :from 2)", lambda d, q: d["a"][..., 2:]),
    (("concat",), "(concat a r :axis 1)", lambda d, q: np.concatenate([d["a"], d["r"]], 1)),
    (("concat",), "(concat [a p] :axis -1)", lambda d, q: np.concatenate([d["a"], d["p"]], -1)),
    (("take",), "(take (param [4 3] :init (normal 1.0)) t)", lambda d, q: q["m/param"][d["t"]]),
    (("positions",), "(positions t)", lambda d, q: np.broadcast_to(np.arange(3), (BATCH, 3))),
    (("cast",), "(cast a :dtype int32)", lambda d, q: np.trunc(d["a"]).astype(np.int32)),
    (("cast",), "(+ (cast t :dtype f32) 0.5)", lambda d, q: d["t"] + 0.5),
    (("matmul",), "(matmul a w)", lambda d, q: d["a"] @ d["w"]),
    (
        ("linear",),
        "(linear a 5)",
        lambda d, q: d["a"] @ q["m/linear/weight"] + q["m/linear/bias"],
    ),
    (("linear",), "(linear a 2 :bias false)", lambda d, q: d["a"] @ q["m/linear/weight"]),
    (
        ("linear",),
        "(linear a 3 :bias false :init (uniform 2 3))",
        lambda d, q: d["a"] @ _within(q["m/linear/weight"], 2, 3),
    ),
    (("embed",), "(embed t 4 6)", lambda d, q: q["m/embed/weight"][d["t"]]),
    (("embed",), "(embed t 4 6 :init ones)", lambda d, q: np.ones((BATCH, 3, 6))),
    (
        ("layernorm",),
        "(layernorm a :bias false)",
        lambda d, q: _norm(d["a"], True) * q["m/layernorm/weight"],
    ),
    (("rope",), "(rope (reshape a [2 3 1 4]) :base 50.0)", lambda d, q: _rope_of(d, 50.0)),
    (
        ("sdpa",),
        "(sdpa (reshape a [2 2 3 2]) (reshape (slice a :to 2) [2 1 3 2]) "
        "(reshape (slice a :to 2) [2 1 3 2]) :causal true :scale 0.5)",
        lambda d, q: _sdpa(d, True),
    ),
    (("dropout",), "(dropout a :p 0.5)", lambda d, q: d["a"]),  # evaluation: the identity
    (("layernorm",), "(layernorm (* 3 a))", lambda d, q: _norm(3 * d["a"], True)),
    (("rmsnorm",), "(rmsnorm a :eps 1e-5)", lambda d, q: _norm(d["a"], False)),
    (("attention",), "(attention a :heads 2)", lambda d, q: _attention(d, q, 2, False)),
    (
        ("attention",),
        "(attention a :heads 2 :kv-heads 1 :bias false :rope 100.0 :causal true)",
        lambda d, q: _attention(d, q, 2, True, kv=1, bias=False, rope=100.0),
    ),
    (
        ("attention",),
        "(attention a :heads 4 :causal true)",
        lambda d, q: _attention(d, q, 4, True),
    ),
    (
        ("cross-entropy",),
        "(reshape (cross-entropy a t) [1])",
        lambda d, q: np.array([_cross_entropy(d)]),
    ),
    (
        ("mse",),
        "(reshape (mse a (* a r)) [1])",  # operands of one shape: a loss never broadcasts
        lambda d, q: np.array([((d["a"] - d["a"] * d["r"]) ** 2).mean()]),
    ),
]


@pytest.fixture(scope="module")
def npz(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vocab") / "fields.npz"
    np.savez(path, **FIELDS)
    return path


def model_output(npz: Path, body: str, head: str = "") -> tuple[np.ndarray, dict]:
    """The model `body` run on FIELDS: its output and the parameters it was run with."""
    text = f"""
        (defparams (width 4) (heads 2))
        (defdata d (arrays "{npz.name}" :fields [{ARGS}]))
        {head}
        (defmodel m ({ARGS}) {body})
        (defrun r :model m :data d :loss (sum (cast (m {ARGS}) :dtype f32))
          :optimizer (sgd :lr 0.1) :batch {BATCH} :steps 1)
    """
    experiment = load_experiment_text(text, "vocab.lisp", base_dir=npz.parent)
    program = CpuGraphs(compile_run(experiment, experiment.run()))
    params = program.init_params(seed=0)
    _, out = program.eval_step(params, FIELDS)
    return out, params


@pytest.mark.parametrize(("names", "body", "ref"), CASES, ids=[c[1] for c in CASES])
def test_entry_forward_matches_reference(npz: Path, names, body: str, ref: Ref) -> None:
    out, params = model_output(npz, body)
    want = np.asarray(ref(FIELDS, params))
    assert out.shape == want.shape
    if want.dtype.kind in "iu":
        np.testing.assert_array_equal(out, want)
    else:
        np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-6)


def test_every_vocabulary_entry_has_a_case() -> None:
    covered = {name for names, _, _ in CASES for name in names}
    assert covered == set(VOCABULARY)


def test_structure_let_thread_repeat_and_defn(npz: Path) -> None:
    head = "(defn twice (x k) (* k (+ x x)))"
    body = "(let [s 0.5 y (-> a (twice s) exp (* s))] (repeat y 3 (twice 2)))"
    out, _ = model_output(npz, body, head)
    np.testing.assert_allclose(out, 4**3 * 0.5 * np.exp(FIELDS["a"]), rtol=2e-5)


def test_parameter_reference_and_literals(npz: Path) -> None:
    out, _ = model_output(npz, "(+ a (* width heads) -1 2.5)")
    np.testing.assert_allclose(out, FIELDS["a"] + 8 - 1 + 2.5, rtol=1e-6)


def test_number_arithmetic_folds_at_trace_time(npz: Path) -> None:
    numbers = "(sqrt 4) (exp 0) (rsqrt 4) (pow 2 3) (max 1 2) (- 5) (abs -1) (+ 1 2 (log 1))"
    out, _ = model_output(npz, f"(* a (* {numbers}) (/ 1 (tanh 100)) (sigmoid 0))")
    np.testing.assert_allclose(out, FIELDS["a"] * -240 * 0.5, rtol=1e-6)
