import json

import numpy as np
import pytest
from tiny_lm import TEXT, train_tiny_lm, write_tiny_lm

from sexpgpu.cli import main
from sexpgpu.devices.cpu import CpuProgram
from sexpgpu.ir.compile import output_graph
from sexpgpu.train.checkpoint import load_checkpoint
from sexpgpu.train.trained import load_trained

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LLAMA_SETS = [
    "--variant", "smoke", "--set", "layers=2", "--set", "width=32", "--set", "heads=4",
    "--set", "kv-heads=2", "--set", "ffn=48", "--set", "seq=16", "--set", "rope-base=500000.0",
    "--set", "steps=2", "--set", "checkpoint-every=2", "--set", "eval-every=2",
    "--set", "batch=2",
]  # fmt: skip


def _ours(path, run_dir, ids, *sets):
    sets = [s for s in sets if s != "--set"]
    variant = None
    if "--variant" in sets:
        variant = sets[sets.index("--variant") + 1]
        sets = [s for s in sets if s not in ("--variant", variant)]
    model = load_trained(path, resume="latest", out=run_dir, variant=variant, sets=sets)
    graph = output_graph(model.experiment, model.run, batch=len(ids), dtype="f32")
    feeds = {k: model.params[k] for k in graph.params}
    return CpuProgram(graph)({**feeds, "tokens": ids})["output"]


def _theirs(folder, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.from_numpy(ids).long()).logits.numpy()


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    return train_tiny_lm(tmp_path_factory.mktemp("gpt"))


def test_a_gpt_exports_to_gpt2_with_equal_logits(gpt, tmp_path, capsys):
    path, run_dir = gpt
    folder = tmp_path / "hf"
    argv = ["export", str(path), "--resume", "latest", "--out", str(run_dir)]
    assert main([*argv, "--to", "hf", str(folder)]) == 0
    assert "(gpt2, step 4 of" in capsys.readouterr().out
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["n_layer"] == 2 and config["n_head"] == 2
    ids = np.random.default_rng(0).integers(0, 256, size=(2, 16)).astype(np.int32)
    np.testing.assert_allclose(_theirs(folder, ids), _ours(path, run_dir, ids), atol=1e-4)


def test_a_llama_exports_to_llama_with_equal_logits(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "examples/llama.lisp", *LLAMA_SETS, "--out", str(out)]) == 0
    folder = tmp_path / "hf"
    argv = ["export", "examples/llama.lisp", *LLAMA_SETS, "--resume", "latest", "--out", str(out)]
    assert main([*argv, "--to", "hf", str(folder)]) == 0
    config = json.loads((folder / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["rope_theta"] == 500000.0
    ids = np.random.default_rng(1).integers(0, 256, size=(1, 16)).astype(np.int32)
    ours = _ours("examples/llama.lisp", out, ids, *LLAMA_SETS)
    np.testing.assert_allclose(_theirs(folder, ids), ours, atol=1e-4)


def test_run_init_from_a_random_gpt2_folder_starts_from_its_weights(tmp_path, capsys):
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=16, n_embd=32, n_layer=2, n_head=2,
        activation_function="gelu_new", resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    folder = tmp_path / "gpt2"
    model.save_pretrained(folder)
    path = write_tiny_lm(tmp_path)
    out = tmp_path / "run"
    argv = ["run", str(path), "--out", str(out), "--init-from", str(folder)]
    assert main([*argv, "--set", "lr=1e-30", "--steps", "2"]) == 0  # the weights stay
    assert json.loads((out / "run.json").read_text())["init_from"] == str(folder.resolve())
    ckpt = load_checkpoint(out / "checkpoints" / "step-2")
    tensors = model.state_dict()
    np.testing.assert_array_equal(
        ckpt.params["gpt/block.1/linear/weight"], tensors["transformer.h.1.mlp.c_fc.weight"]
    )
    ids = np.random.default_rng(2).integers(0, 256, size=(1, 16)).astype(np.int32)
    with torch.no_grad():
        theirs = model(torch.from_numpy(ids).long()).logits.numpy()
    np.testing.assert_allclose(_ours(path, out, ids, "--set", "lr=1e-30"), theirs, atol=1e-4)


def _error(capsys, argv):
    assert main(argv) == 1
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("gelu", "relu"), "gpt2: the model computes no gelu, which gpt2 does"),
        (("(+ x (-> x layernorm", "(+ (* x 2) (-> x layernorm"), "computes something else"),
    ],
)
def test_a_model_unlike_gpt2_is_refused_naming_the_first_mismatch(tmp_path, capsys, edit, message):
    path = write_tiny_lm(tmp_path, TEXT.replace(*edit))
    assert main(["run", str(path), "--out", str(tmp_path / "run"), "--steps", "2"]) == 0
    capsys.readouterr()
    argv = ["export", str(path), "--resume", "latest", "--out", str(tmp_path / "run")]
    err = _error(capsys, [*argv, "--to", "hf", str(tmp_path / "hf")])
    assert "error[E-HF-001]" in err and message in err
    assert not (tmp_path / "hf").exists()


def test_another_feed_forward_width_is_gpt2s_n_inner(tmp_path, capsys):
    path = write_tiny_lm(tmp_path, TEXT.replace("(* 4 width)", "(* 3 width)"))
    assert main(["run", str(path), "--out", str(tmp_path / "run"), "--steps", "2"]) == 0
    argv = ["export", str(path), "--resume", "latest", "--out", str(tmp_path / "run")]
    assert main([*argv, "--to", "hf", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["n_inner"] == 96
    ids = np.arange(16, dtype=np.int32)[None] * 5
    ours = _ours(path, tmp_path / "run", ids)
    np.testing.assert_allclose(_theirs(tmp_path / "hf", ids), ours, atol=1e-4)


def test_export_of_a_classifier_names_each_architectures_first_mismatch(tmp_path, capsys):
    text = (
        "(defdata d (digits))\n(defmodel m (x) (-> x (linear 16) relu (linear 10)))\n"
        "(defrun r :model m :data d :loss (cross-entropy (m x) y) :optimizer (adamw :lr 0.1)\n"
        '  :batch 4 :steps 2 :checkpoint (every 2 "checkpoints"))'
    )
    path = tmp_path / "c.lisp"
    path.write_text(text)
    assert main(["run", str(path), "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    argv = ["export", str(path), "--resume", "latest", "--out", str(tmp_path / "run")]
    err = _error(capsys, [*argv, "--to", "hf", str(tmp_path / "hf")])
    assert "error[E-HF-001]" in err
    assert "gpt2: no token embedding `m/wte`" in err and "llama: no token embedding" in err


def test_export_misuse(gpt, tmp_path, capsys):
    path, run_dir = gpt
    argv = ["export", str(path), "--resume", "latest", "--out", str(run_dir)]
    err = _error(capsys, [*argv, "--to", "onnx", str(tmp_path / "x")])
    assert "error[E-CLI-001]" in err and "--to onnx: unknown format" in err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    err = _error(capsys, [*argv, "--to", "hf", str(tmp_path / "full")])
    assert "error[E-CLI-001]" in err and "export writes a new folder" in err
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"
    err = _error(capsys, [*argv[:-2], "--to", "hf", str(tmp_path / "y")])  # no --out: runs/train
    assert "error[E-CKPT-001]" in err
    err = _error(capsys, argv)
    assert "error[E-CLI-001]" in err and "--to" in err


def test_init_from_misuse(gpt, tmp_path, capsys):
    path, run_dir = gpt
    small = transformers.GPT2Config(
        vocab_size=256,
        n_positions=16,
        n_embd=32,
        n_layer=3,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    transformers.GPT2LMHeadModel(small).save_pretrained(tmp_path / "deep")
    run = ["run", str(path), "--out", str(tmp_path / "r"), "--init-from"]
    err = _error(capsys, [*run, str(tmp_path / "deep")])
    assert "error[E-HF-002]" in err and "n_layer is 3, the experiment's is 2" in err
    err = _error(capsys, [*run, str(tmp_path / "nothing")])
    assert "error[E-HF-002]" in err and "no readable config.json" in err
    llama = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    transformers.LlamaForCausalLM(llama).save_pretrained(tmp_path / "llama")
    err = _error(capsys, [*run, str(tmp_path / "llama")])
    assert (
        "error[E-HF-002]" in err and "holds a 'llama' model; the experiment's model is gpt2" in err
    )
    ok = transformers.GPT2Config(
        vocab_size=256,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    transformers.GPT2LMHeadModel(ok).save_pretrained(tmp_path / "ok")
    resume = ["run", str(path), "--out", str(run_dir), "--resume", "latest", "--steps", "6"]
    err = _error(capsys, [*resume, "--init-from", str(tmp_path / "ok")])
    assert "error[E-CLI-001]" in err and "--init-from starts a run" in err
