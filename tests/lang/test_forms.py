from pathlib import Path

import pytest

from sexpgpu.errors import SexpgpuError
from sexpgpu.lang import ListNode, Symbol, load_experiment_text

BASE = """\
(defparams (width 64) (heads 4) (head-dim (// width heads)) (batch 8) (lr 1e-3))
(defvariant small (width 32) (lr (/ lr 10)))
(defdata text (bytes "corpus.txt") :seq 16)
(defn block (x)
  (relu (linear x width)))
(defmodel net (tokens)
  (block tokens))
(defrun train
  :model net
  :data text
  :loss (cross-entropy (net tokens) next)
  :optimizer (adamw :lr lr)
  :batch batch
  :steps 10)
"""


def load(text=BASE, variant=None, base_dir=None):
    return load_experiment_text(text, "exp.lisp", variant, base_dir=base_dir)


def error(text=BASE, variant=None):
    with pytest.raises(SexpgpuError) as info:
        load(text, variant)
    return info.value.render()


def edit(old, new):
    assert old in BASE
    return BASE.replace(old, new)


# -- what loads ------------------------------------------------------------------


def test_parameters_are_evaluated_in_order():
    exp = load()
    assert dict(exp.params) == {"width": 64, "heads": 4, "head-dim": 16, "batch": 8, "lr": 1e-3}
    assert exp.variant is None and exp.overridden == frozenset()
    assert exp.variants == ("small",)
    assert exp.param_spans["heads"].col == 24


def test_variant_overrides_and_derived_parameters_follow():
    exp = load(variant="small")
    assert exp.params["width"] == 32 and exp.params["head-dim"] == 8
    assert exp.params["lr"] == pytest.approx(1e-4)  # its own name is the value before the variant
    assert exp.overridden == {"width", "lr"}
    assert exp.defaults["width"] == 64 and exp.defaults["head-dim"] == 16


def test_run_settings_are_evaluated_and_defaults_filled():
    run = load().run()
    assert (run.name, run.model, run.data, run.batch, run.steps) == ("train", "net", "text", 8, 10)
    assert run.loss.items[0] == Symbol("cross-entropy", None)
    assert run.optimizer.name == "adamw"
    assert dict(run.optimizer.options) == {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.0,
    }
    assert (run.schedule.name, dict(run.schedule.options)) == ("constant", {})
    assert (run.clip, run.microbatches, run.dtype, run.seed) == (None, 1, "f32", 0)
    assert (run.eval, run.checkpoint, run.diagnostics) == (None, None, ())
    assert run.span.line == 8


def test_every_run_key():
    text = edit(
        ":steps 10)",
        """:steps 10 :schedule (cosine :warmup 5) :clip 1 :microbatches 2 :dtype bf16
  :seed 7 :eval (every 5 :batches 2) :checkpoint (every 5 "ck")
  :diagnostics ((grad-norm :every 10) (activation-rms :every 100 :reduce max)))""",
    ).replace("(adamw :lr lr)", "(sgd :lr 0.1 :momentum 0.9 :nesterov true)")
    run = load(text).run()
    assert dict(run.optimizer.options) == {"lr": 0.1, "momentum": 0.9, "nesterov": True}
    assert dict(run.schedule.options) == {"warmup": 5, "floor": 0.0}
    assert (run.clip, run.microbatches, run.dtype, run.seed) == (1.0, 2, "bf16", 7)
    assert (run.eval.every, run.eval.batches) == (5, 2)
    assert (run.checkpoint.every, run.checkpoint.location) == (5, "ck")
    assert [(d.name, d.every, d.reduce) for d in run.diagnostics] == [
        ("grad-norm", 10, "mean"),
        ("activation-rms", 100, "max"),
    ]


def test_definitions_keep_syntax_for_the_tracer():
    exp = load()
    block = exp.functions["block"]
    assert [a.name for a in block.args] == ["x"]
    assert isinstance(block.body, ListNode) and block.body.items[0] == Symbol("relu", None)
    assert [i.name for i in exp.models["net"].inputs] == ["tokens"]


def test_data_paths_resolve_against_the_experiment_folder(tmp_path):
    data = load(base_dir=tmp_path).data["text"]
    assert (data.kind, data.path) == ("bytes", tmp_path / "corpus.txt")
    assert dict(data.options) == {"seq": 16, "split": 0.9, "fields": ("tokens", "next")}


@pytest.mark.parametrize(
    ("source", "kind", "options"),
    [
        ('(tokens "t.bin")', "tokens", {"dtype": "u16"}),
        ('(tokens "t.bin" :dtype u32)', "tokens", {"dtype": "u32"}),
        ("(python-stdlib)", "python-stdlib", {}),
    ],
)
def test_stream_sources(source, kind, options):
    data = load(edit('(bytes "corpus.txt")', source)).data["text"]
    assert data.kind == kind
    assert {k: v for k, v in data.options.items() if k == "dtype"} == options
    assert data.fields == ("tokens", "next")


def test_array_and_digit_sources():
    text = edit('(bytes "corpus.txt") :seq 16', '(arrays "d.npz" :fields [tokens next]) :split 0.5')
    data = load(text).data["text"]
    assert (data.kind, data.fields, data.options["split"], data.path.name) == (
        "arrays",
        ("tokens", "next"),
        0.5,
        "d.npz",
    )
    text = edit('(bytes "corpus.txt") :seq 16', "(digits)").replace("(tokens)", "(x)")
    text = text.replace("(block tokens)", "(block x)").replace("(net tokens) next", "(net x) y")
    data = load(text).data["text"]
    assert (data.kind, data.path, data.fields) == ("digits", None, ("x", "y"))


def test_run_selection():
    two = BASE + BASE[BASE.index("(defrun") :].replace("defrun train", "defrun long")
    exp = load(two)
    assert exp.run("long").name == "long"
    with pytest.raises(SexpgpuError) as info:
        exp.run()
    assert info.value.render() == (
        "error[E-FORM-006]: the experiment defines 2 runs; choose one\n"
        " --> exp.lisp\n"
        "  = hint: pass --run NAME; runs: train, long"
    )
    with pytest.raises(SexpgpuError) as info:
        exp.run("lnog")
    assert info.value.hint == "did you mean `long`? runs: long, train"


def test_nothing_is_evaluated_as_python():
    text = edit("(width 64)", '(width (__import__ "os"))')
    assert "unknown operation `__import__`" in error(text)


# -- errors, pinned in full ----------------------------------------------------------


def test_unknown_variant_suggests_the_nearest():
    assert error(variant="smal") == (
        "error[E-FORM-006]: unknown variant `smal`\n"
        " --> exp.lisp\n"
        "  = hint: did you mean `small`? variants: small"
    )


def test_unknown_parameter_in_a_variant():
    assert error(edit("(defvariant small (width 32)", "(defvariant small (widht 32)")) == (
        "error[E-FORM-006]: variant `small` sets `widht`, which is not a parameter\n"
        " --> exp.lisp:2:20\n"
        "  |\n"
        "2 | (defvariant small (widht 32) (lr (/ lr 10)))\n"
        "  |                    ^\n"
        "  = hint: did you mean `width`? parameters: batch, head-dim, heads, lr, width"
    )


def test_duplicate_defn():
    assert error(BASE + "(defn block (y) y)\n") == (
        "error[E-FORM-004]: duplicate definition of `block`\n"
        "  --> exp.lisp:15:7\n"
        "   |\n"
        "15 | (defn block (y) y)\n"
        "   |       ^\n"
        "   = hint: `block` is already defined as a function at 4:7; rename one of them"
    )


def test_unknown_run_key():
    assert error(edit(":steps 10)", ":steps 10\n  :stpes 20)")) == (
        "error[E-FORM-003]: unknown key `:stpes` in run `train`\n"
        "  --> exp.lisp:15:3\n"
        "   |\n"
        "15 |   :stpes 20)\n"
        "   |   ^\n"
        "   = hint: did you mean `:steps`? keys: :batch, :checkpoint, :clip, :data, :diagnostics,"
        " :dtype, :eval, :log, :loss, :microbatches, :model, :optimizer, :schedule, :seed, :steps"
    )


def test_missing_run_key():
    assert error(edit("\n  :steps 10", "")) == (
        "error[E-FORM-003]: run `train` needs `:steps`\n"
        " --> exp.lisp:8:1\n"
        "  |\n"
        "8 | (defrun train\n"
        "  | ^\n"
        "  = hint: add :steps (required: :model, :data, :loss, :optimizer, :batch, :steps)"
    )


def test_wrong_type_names_the_parameter_it_came_from():
    assert error(edit("(batch 8)", "(batch 8.5)")) == (
        "error[E-FORM-005]: `:batch` of run `train` must be an integer, found float 8.5"
        " (from `batch`)\n"
        "  --> exp.lisp:13:10\n"
        "   |\n"
        "13 |   :batch batch\n"
        "   |          ^\n"
        "   = hint: give an integer, written out or through a parameter"
    )


def test_variant_type_mismatch():
    assert error(edit("(width 32)", "(width 32.5)"), "small") == (
        "error[E-FORM-005]: `width` is an integer (64 without the variant), but the variant"
        " gives a float 32.5\n"
        " --> exp.lisp:2:26\n"
        "  |\n"
        "2 | (defvariant small (width 32.5) (lr (/ lr 10)))\n"
        "  |                          ^\n"
        "  = hint: give `width` an integer"
    )


def test_parameter_used_before_its_definition():
    assert error(edit("(width 64)", "(width (* 2 heads))")).endswith(
        "hint: `heads` is defined after this point; define it earlier"
    )


def test_wrong_body_count():
    assert error(edit("(relu (linear x width))", "(relu x) (linear x width)")) == (
        "error[E-FORM-002]: defn `block` takes one body expression, found 2\n"
        " --> exp.lisp:5:12\n"
        "  |\n"
        "5 |   (relu x) (linear x width))\n"
        "  |            ^\n"
        "  = hint: combine steps with (let [name expr ...] body) or (-> x f g)"
    )


@pytest.mark.parametrize(
    ("old", "new", "code", "message"),
    [
        ("(defparams", "(defparam", "E-FORM-001", "unknown top-level form `defparam`"),
        ("(heads 4)", "(heads 4 5)", "E-FORM-002", "a defparams entry takes a name and one"),
        ("(heads 4)", "(heads (// 4 0))", "E-FORM-007", "`//` divides by zero"),
        ("(heads 4)", "(heads (pow 10 100))", "E-FORM-007", "`pow` has no finite result"),
        ("(heads 4)", '(heads (+ 1 "a"))', "E-FORM-005", '`+` needs numbers, found string "a"'),
        ("(heads 4)", "(heads (max))", "E-FORM-002", "`max` takes at least 1 argument, found 0"),
        ("(lr 1e-3)", "(lr 1e-3) (lr 2)", "E-FORM-004", "`lr` is set twice in defparams"),
        ("(defn block (x)", "(defn block (x x)", "E-FORM-004", "`x` appears twice"),
        ("(defn block (x)", "(defn 3 (x)", "E-FORM-005", "the name of a defn must be a symbol"),
        ("(defn block (x)", "(defn block x", "E-FORM-005", "defn `block` needs a list of"),
        ("(defmodel net", "(defmodel batch", "E-FORM-004", "duplicate definition of `batch`"),
        (":model net", ":model block", "E-FORM-006", "unknown model `block`"),
        (":data text", ":data txt", "E-FORM-006", "unknown data set `txt`"),
        ("(adamw :lr lr)", "(adam :lr lr)", "E-FORM-006", "unknown optimizer `adam`"),
        ("(adamw :lr lr)", "(adamw)", "E-FORM-003", "(adamw ...) needs `:lr`"),
        ("(adamw :lr lr)", "(adamw :lr -1)", "E-FORM-005", "`:lr` of (adamw ...) must be above"),
        ("(adamw :lr lr)", "(adamw :lr lr :betas [1])", "E-FORM-005", "must be a vector of two"),
        ("(adamw :lr lr)", "(adamw :lr lr :lr 2)", "E-FORM-004", "`:lr` is given twice"),
        ("(adamw :lr lr)", "(adamw :lr)", "E-FORM-002", "`:lr` has no value in (adamw ...)"),
        ("(adamw :lr lr)", "adamw", "E-FORM-005", "`:optimizer` of run `train` must be a call"),
        (":steps 10", ":steps 10 :dtype f16", "E-FORM-005", "must be one of f32, bf16"),
        (":steps 10", ":steps 10 :schedule (cos)", "E-FORM-006", "unknown schedule `cos`"),
        ("(adamw :lr lr)", "(sgd :lr 0.1 :beta 0.9)", "E-FORM-003", "unknown key `:beta`"),
        (":steps 10", ":steps 10 :schedule (constant :warmup 3)", "E-FORM-003", ":warmup"),
        (":steps 10", ":steps 10 :schedule (cosine :floor 2.0)", "E-FORM-005", "`:floor` of"),
        (":steps 10", ":steps 10 :eval (each 5)", "E-FORM-005", "must be (every N :batches M)"),
        (":steps 10", ":steps 10 :checkpoint (every 5)", "E-FORM-002", "takes N and one loc"),
        (":steps 10", ":steps 10 :diagnostics ((x))", "E-FORM-006", "unknown diagnostic `x`"),
        (":steps 10", ":steps 0", "E-FORM-005", "`:steps` of run `train` must be at least 1"),
        (":seq 16", ":seq 16 :split 1.0 ", "", ""),
        (":seq 16", "", "E-FORM-003", "data `text` needs `:seq`"),
        (":seq 16", ":seq 16 :split 0", "E-FORM-005", "`:split` of data `text` must be above 0"),
        ('(bytes "corpus.txt")', '"corpus.txt"', "E-FORM-005", "must be a call such as"),
        ('(bytes "corpus.txt")', "(byte 1)", "E-FORM-006", "unknown data source `byte`"),
        ('(bytes "corpus.txt")', "(bytes)", "E-FORM-002", "`bytes` needs a path"),
        ('(bytes "corpus.txt")', '(arrays "a.txt")', "E-FORM-005", "`arrays` reads a .npz"),
        ('(bytes "corpus.txt")', '(bytes "s3://b/c")', "E-FORM-005", "must name a local file"),
        ('(bytes "corpus.txt")', "(digits)", "E-FORM-003", "`:seq` does not apply to `digits`"),
        ('(bytes "corpus.txt")', '(tokens "t.bin" :dtype f32)', "E-FORM-005", "one of u16, u32"),
        ("net (tokens)", "net (tokns)", "E-FORM-006", "model `net` takes `tokns`"),
        ("(defrun train", "(defrun heads", "E-FORM-004", "duplicate definition of `heads`"),
        ("(defrun train", "(defvariant small)\n(defrun train", "E-FORM-004", "duplicate variant"),
    ],
)
def test_form_errors(old, new, code, message):
    text = edit(old, new)
    if not code:
        load(text)
        return
    rendered = error(text)
    assert rendered.startswith(f"error[{code}]: "), rendered
    assert message in rendered.splitlines()[0]
    assert "\n --> exp.lisp:" in rendered or "\n  --> exp.lisp:" in rendered


def test_eval_needs_an_evaluation_share():
    text = edit(":seq 16", ":seq 16 :split 1").replace(":steps 10", ":steps 10 :eval (every 2)")
    assert error(text).startswith(
        "error[E-FORM-005]: run `train` evaluates, but data `text` keeps nothing for evaluation"
    )


def test_a_file_without_runs():
    exp = load(BASE[: BASE.index("(defrun")])
    with pytest.raises(SexpgpuError, match="defines no run"):
        exp.run()


def test_empty_text_is_an_empty_experiment():
    exp = load("; nothing here\n")
    assert (dict(exp.params), dict(exp.runs), exp.path) == ({}, {}, Path("exp.lisp"))


def test_registries_match_the_definitions():
    from dataclasses import fields

    from sexpgpu.lang import RunDef
    from sexpgpu.lang.forms import SPECIAL_FORMS
    from sexpgpu.lang.runs import RUN_KEYS

    assert set(RUN_KEYS) == {f.name for f in fields(RunDef)} - {"name", "span"}
    assert set(SPECIAL_FORMS) == {
        "defparams",
        "defvariant",
        "defdata",
        "defn",
        "defmodel",
        "defrun",
    }
