import pytest

from sexpgpu.cli import main
from sexpgpu.errors import SexpgpuError
from sexpgpu.lang import load_experiment, load_experiment_text
from sexpgpu.train.settings import experiment_hash

TEXT = """
(defparams (width 8) (lr 1e-3) (dtype "f32") (hidden (* 2 width)))
(defvariant big (width 16) (lr (/ lr 2)))
"""


def test_set_applies_after_the_variant_and_sees_its_value():
    exp = load_experiment_text(TEXT, variant="big", sets=["lr=(* lr 10)", "width=4"])
    assert exp.params["lr"] == pytest.approx(5e-3) and exp.params["width"] == 4
    assert exp.params["hidden"] == 8  # later parameters see the value set
    assert dict(exp.sets) == {"lr": pytest.approx(5e-3), "width": 4}
    assert load_experiment_text(TEXT, sets=['dtype="bf16"']).params["dtype"] == "bf16"
    assert load_experiment_text(TEXT, sets=["lr=1"]).params["lr"] == 1.0  # int for a float


@pytest.mark.parametrize(
    ("sets", "code", "message"),
    [
        (["lr"], "E-CLI-001", "--set 'lr' is not NAME=VALUE with one value"),
        (["lr=1 2"], "E-CLI-001", "is not NAME=VALUE with one value"),
        (["=1"], "E-CLI-001", "is not NAME=VALUE with one value"),
        (["lr=1", "lr=2"], "E-CLI-001", "--set lr is given twice"),
        (["with=1"], "E-FORM-006", "--set with: `with` is not a parameter"),
        (["width=1.5"], "E-FORM-005", "`width` is an integer (8 without --set), but --set gives"),
        (["dtype=3"], "E-FORM-005", "`dtype` is a string"),
        (["lr=(1"], "E-READ-001", "unclosed"),
        (["lr=nope"], "E-FORM-", ""),
    ],
)
def test_set_misuse_is_refused_with_a_code(sets, code, message):
    with pytest.raises(SexpgpuError) as err:
        load_experiment_text(TEXT, sets=sets)
    assert err.value.code.startswith(code) and message in err.value.message


def test_set_changes_the_experiment_hash_only_when_given():
    path = "examples/mlp.lisp"
    plain = experiment_hash(load_experiment(path), "train")
    assert experiment_hash(load_experiment(path, sets=[]), "train") == plain
    other = experiment_hash(load_experiment(path, sets=["hidden=32"]), "train")
    assert other != plain != experiment_hash(load_experiment(path, sets=["hidden=64"]), "train")


def test_check_and_explain_take_set(capsys):
    assert main(["check", "examples/mlp.lisp", "--set", "hidden=32"]) == 0
    out = capsys.readouterr().out
    assert "--set (default 128)" in out
    assert main(["explain", "examples/mlp.lisp", "--set", "hidden=32"]) == 0
    assert "[64 32]" in capsys.readouterr().out
    assert main(["check", "examples/mlp.lisp", "--set", "hiden=32"]) == 1
    assert "hidden" in capsys.readouterr().err
