import numpy as np
import pytest
from tiny_lm import TEXT, train_tiny_lm, write_tiny_lm

from sexpgpu.cli import main
from sexpgpu.ir.compile import compile_run, output_graph
from sexpgpu.lang import load_experiment_text
from sexpgpu.train.sampling import Sampler, Vocabulary, check_samplable, cpu_step, pick
from sexpgpu.train.trained import load_trained


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm")
    path, run_dir = train_tiny_lm(folder)
    return path, run_dir


def _sample(capsys, path, run_dir, *extra):
    argv = ["sample", str(path), "--out", str(run_dir), "--resume", "latest", *extra]
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_output_graph_equals_the_evaluation_graphs_output(trained):
    path, run_dir = trained
    model = load_trained(path, resume="latest", out=run_dir)
    graph = output_graph(model.experiment, model.run)
    seq, vocab = check_samplable(graph, "x")
    assert (seq, vocab) == (16, 256)
    ids = np.random.default_rng(0).integers(0, 256, size=(4, 16)).astype(np.int32)
    from sexpgpu.devices.cpu import CpuProgram

    full = CpuProgram(model.compiled.eval_graph)({**model.params, "tokens": ids, "next": ids})
    step = cpu_step(graph, model.params)
    for row in range(4):
        window = ids[row : row + 1]
        np.testing.assert_allclose(step(window, 15), full["output"][row, 15], rtol=1e-5, atol=1e-5)


def test_right_padding_does_not_change_a_causal_models_logits(trained):
    path, run_dir = trained
    model = load_trained(path, resume="latest", out=run_dir)
    step = cpu_step(output_graph(model.experiment, model.run), model.params)
    ids = np.arange(16, dtype=np.int32)[None] + 40
    padded = ids.copy()
    padded[0, 6:] = 0
    np.testing.assert_allclose(step(ids, 5), step(padded, 5), rtol=1e-6, atol=1e-6)


def test_the_cuda_step_lowered_on_torchs_cpu_equals_the_interpreter(trained):
    pytest.importorskip("torch")
    from sexpgpu.devices.cuda.decode import TorchDecodeStep

    path, run_dir = trained
    model = load_trained(path, resume="latest", out=run_dir)
    graph = output_graph(model.experiment, model.run)
    torch_step = TorchDecodeStep(graph, model.params, None)
    assert not torch_step.captured
    step = cpu_step(graph, model.params)
    ids = np.random.default_rng(1).integers(0, 256, size=(1, 16)).astype(np.int32)
    for position in (0, 7, 15):
        np.testing.assert_allclose(torch_step(ids, position), step(ids, position), atol=1e-4)
    sampler = Sampler(torch_step, 16, Vocabulary(256, True))
    again = Sampler(step, 16, Vocabulary(256, True))
    prompt = list(b"the quick brown fox jumps over")
    assert list(sampler.generate(prompt, 12, temperature=0)) == list(
        again.generate(prompt, 12, temperature=0)
    )


def test_sample_is_seeded_and_continues_the_prompt(trained, capsys):
    path, run_dir = trained
    code, first, _ = _sample(capsys, path, run_dir, "--prompt", "the quick", "--tokens", "20")
    assert code == 0 and first.startswith("the quick")
    assert len(first.encode()) >= len("the quick") + 1
    code, second, _ = _sample(capsys, path, run_dir, "--prompt", "the quick", "--tokens", "20")
    assert second == first
    code, other, _ = _sample(
        capsys, path, run_dir, "--prompt", "the quick", "--tokens", "20", "--seed", "5"
    )
    assert code == 0 and other != first


def test_greedy_samples_are_the_evaluation_graphs_argmax_over_a_sliding_window(trained, capsys):
    path, run_dir = trained
    model = load_trained(path, resume="latest", out=run_dir)
    from sexpgpu.devices.cpu import CpuProgram

    evaluation = CpuProgram(model.compiled.eval_graph)
    context = list(b"the quick brown")  # 15 ids: the window slides from the second token on
    for _ in range(6):
        ids = np.zeros((4, 16), np.int32)
        window = context[-16:]
        ids[0, : len(window)] = window
        out = evaluation({**model.params, "tokens": ids, "next": ids})["output"]
        context.append(int(np.argmax(out[0, len(window) - 1])))
    greedy = ["--prompt", "the quick brown", "--tokens", "6", "--temperature", "0"]
    code, out, _ = _sample(capsys, path, run_dir, *greedy)
    assert code == 0
    assert out.encode()[:-1] == bytes(context) or out[:-1] == bytes(context).decode(
        "utf-8", errors="replace"
    )


def test_a_long_prompt_keeps_its_last_seq_tokens_said_once(trained, capsys):
    path, run_dir = trained
    long = "x" * 40 + "the quick"
    code, out, err = _sample(capsys, path, run_dir, "--prompt", long, "--tokens", "30")
    assert code == 0 and out.startswith(long)
    assert err.count("continuing its last 16") == 1
    code, short, _ = _sample(capsys, path, run_dir, "--prompt", long[-16:], "--tokens", "30")
    assert short[16:] == out[len(long) :]


def test_top_k_one_is_greedy():
    rng = np.random.default_rng(0)
    logits = np.array([0.1, 3.0, 2.9, -1.0])
    assert {pick(logits, 1.0, 1, rng) for _ in range(20)} == {1}
    assert pick(logits, 0.0, None, rng) == 1
    draws = {pick(logits, 5.0, 2, rng) for _ in range(200)}
    assert draws == {1, 2}


def test_token_models_take_and_print_ids():
    vocab = Vocabulary(100, False)
    assert vocab.encode("1 2, 99") == [1, 2, 99]
    assert vocab.decoder()([5, 6]) == " 5 6"
    utf8 = Vocabulary(256, True).decoder()
    text = "é".encode()
    assert utf8([text[0]]) == "" and utf8([text[1]]) == "é"


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", "--prompt is empty"),
        ("1 x", "a token model's prompt is token ids"),
        ("1 100", "holds id 100, outside the model's vocabulary of 100"),
    ],
)
def test_prompts_that_do_not_encode_are_e_sample_002(prompt, message):
    with pytest.raises(Exception) as err:
        Vocabulary(100, False).encode(prompt)
    assert err.value.code == "E-SAMPLE-002" and message in err.value.message


def test_a_classifier_does_not_sample(tmp_path, capsys):
    path = write_tiny_lm(tmp_path, TEXT.replace(":causal true", ":causal false"))
    main(["run", str(path), "--out", str(tmp_path / "run")])
    capsys.readouterr()
    code, _, err = _sample(capsys, path, tmp_path / "run", "--prompt", "the")
    assert code == 1 and "error[E-SAMPLE-001]" in err and "is not causal" in err


def test_a_digits_model_does_not_sample():
    exp = load_experiment_text(
        "(defdata d (digits))\n(defmodel m (x) (linear x 10))\n"
        "(defrun r :model m :data d :loss (cross-entropy (m x) y)\n"
        "  :optimizer (adamw :lr 0.1) :batch 4 :steps 1)"
    )
    graph = output_graph(exp, exp.run())
    with pytest.raises(Exception) as err:
        check_samplable(graph, "x")
    assert err.value.code == "E-SAMPLE-001" and "not one [batch seq] field of int32 ids" in str(
        err.value.message
    )
    assert compile_run(exp, exp.run()) is not None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tokens", "-1"], "--tokens -1 is negative"),
        (["--temperature", "-0.5"], "--temperature -0.5 is not a finite number >= 0"),
        (["--temperature", "nan"], "--temperature nan is not a finite number >= 0"),
        (["--top-k", "0"], "--top-k 0 is not positive"),
        (["--seed", "-3"], "--seed -3 is out of range"),
    ],
)
def test_sample_options_are_checked(trained, capsys, extra, message):
    path, run_dir = trained
    code, _, err = _sample(capsys, path, run_dir, "--prompt", "a", *extra)
    assert code == 1 and "error[E-CLI-001]" in err and message in err


def test_sample_without_a_checkpoint_is_e_ckpt_001(tmp_path, capsys):
    path = write_tiny_lm(tmp_path)
    code, _, err = _sample(capsys, path, tmp_path / "nothing", "--prompt", "a")
    assert code == 1 and "error[E-CKPT-001]" in err


def test_sample_with_other_set_values_names_them(trained, capsys):
    path, run_dir = trained
    code, _, err = _sample(capsys, path, run_dir, "--prompt", "a", "--set", "lr=0.5")
    assert code == 1 and "error[E-CKPT-003]" in err
    assert "--set lr=0.5 here, no --set lr in the checkpoint" in err


def test_sample_help_has_options_and_examples(capsys):
    with pytest.raises(SystemExit):
        main(["sample", "--help"])
    out = capsys.readouterr().out
    assert "--temperature" in out and "--top-k" in out and out.count("  sexpgpu sample ") == 2


@pytest.mark.gpu
def test_the_captured_cuda_step_equals_the_uncaptured_one(trained):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    from sexpgpu.devices.cuda.decode import TorchDecodeStep
    from sexpgpu.runtime.devices import parse_device

    path, run_dir = trained
    model = load_trained(path, resume="latest", out=run_dir)
    graph = output_graph(model.experiment, model.run)
    where = parse_device("cuda:0")
    captured = TorchDecodeStep(graph, model.params, where)
    plain = TorchDecodeStep(graph, model.params, where, capture=False)
    assert captured.captured and not plain.captured
    reference = cpu_step(graph, model.params)
    rng = np.random.default_rng(4)
    for position in (0, 9, 15):  # the window changes between replays
        ids = rng.integers(0, 256, size=(1, 16)).astype(np.int32)
        np.testing.assert_array_equal(captured(ids, position), plain(ids, position))
        np.testing.assert_allclose(captured(ids, position), reference(ids, position), atol=1e-3)
