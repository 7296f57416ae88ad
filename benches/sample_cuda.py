"""Decoding tokens/s of `sexpgpu sample` on cuda: GPT-2 small, one captured step per token.

sexpgpu's side is the product's path (`sexpgpu.train.sampling.Sampler` over
`sexpgpu.devices.cuda.decode.TorchDecodeStep`): the model's output graph
at one row of ``seq`` ids, captured once as a CUDA graph and replayed for
each new token over the last ``seq`` ids (no key/value cache: each token
recomputes the window). Measured the same way without the capture (the
lowering op by op), and, when `transformers` is installed, the peer in the
same run: the same shape as `GPT2LMHeadModel` (random weights, bf16 on the
GPU) generating greedily with its key/value cache. Reported per side:
tokens/s over ``--tokens`` new tokens after ``--warmup`` ones, and the first
token's latency (the capture included).

    python benches/sample_cuda.py                   # examples/gpt.lisp (GPT-2 small, seq 1024)
    python benches/sample_cuda.py --tokens 500 --prompt 512
    python benches/sample_cuda.py --smoke           # a tiny GPT on the CPU (CI)

The model is examples/gpt.lisp at its full size (12 layers, width 768, 12
heads, seq 1024, bf16; its vocabulary is the 256 byte values) with random
weights: speed does not depend on them. ``--smoke`` runs a one-layer GPT of
width 32 on the cpu interpreter and on PyTorch's CPU device in seconds; its
numbers say nothing of a GPU. Results are recorded in benches/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sexpgpu.ir.compile import output_graph  # noqa: E402
from sexpgpu.lang import load_experiment  # noqa: E402
from sexpgpu.train.sampling import Sampler, Vocabulary, check_samplable, cpu_step  # noqa: E402

SMOKE = ["layers=1", "width=32", "heads=2", "seq=16", 'dtype="f32"']


def _model(smoke: bool):
    experiment = load_experiment(ROOT / "examples" / "gpt.lisp", sets=SMOKE if smoke else ())
    run = experiment.run()
    graph = output_graph(experiment, run)
    seq, vocab = check_samplable(graph, "examples/gpt.lisp")
    rng = np.random.default_rng(0)
    params = {k: (rng.standard_normal(n.shape, np.float32) * 0.02) for k, n in graph.params.items()}
    return experiment, run, graph, params, seq, vocab


def _time(step, seq: int, vocab: int, prompt: int, warmup: int, tokens: int) -> dict:
    sampler = Sampler(step, seq, Vocabulary(vocab, True))
    ids = list(np.random.default_rng(1).integers(0, vocab, prompt))
    begin = time.perf_counter()
    drawn = sampler.generate(ids, warmup + tokens, temperature=0.0)
    next(drawn)
    first = time.perf_counter() - begin
    for _ in range(warmup - 1):
        next(drawn)
    start = time.perf_counter()
    count = sum(1 for _ in drawn)
    seconds = time.perf_counter() - start
    return {"tokens_per_s": count / seconds, "first_token_s": first, "tokens": count}


def _hf_peer(seq: int, vocab: int, width: int, layers: int, heads: int, args) -> dict | None:
    try:
        import torch
        import transformers
    except ImportError:
        return None
    config = transformers.GPT2Config(
        vocab_size=vocab, n_positions=seq, n_embd=width, n_layer=layers, n_head=heads,
        activation_function="gelu_new", bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = transformers.GPT2LMHeadModel(config).to(device, dtype).eval()
    ids = torch.randint(0, vocab, (1, args.prompt), device=device)
    new = min(args.tokens, seq - args.prompt)  # its positions end at seq
    kwargs = {"do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        model.generate(ids, max_new_tokens=args.warmup, min_new_tokens=args.warmup, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"tokens_per_s": new / seconds, "tokens": new, "device": device}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny GPT on the CPU (CI)")
    parser.add_argument("--tokens", type=int, default=256, help="new tokens timed")
    parser.add_argument("--warmup", type=int, default=8, help="new tokens before the timing")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.warmup, args.prompt = 6, 2, 4
    experiment, run, graph, params, seq, vocab = _model(args.smoke)
    p = experiment.params
    rows = []
    if args.smoke:
        from sexpgpu.devices.cuda.decode import TorchDecodeStep

        sides = {
            "sexpgpu cpu interpreter": cpu_step(graph, params),
            "sexpgpu cuda lowering on torch cpu": TorchDecodeStep(graph, params, None),
        }
    else:
        from sexpgpu.devices.cuda.decode import TorchDecodeStep
        from sexpgpu.runtime.devices import parse_device

        where = parse_device("cuda:0")
        sides = {
            "sexpgpu captured": TorchDecodeStep(graph, params, where),
            "sexpgpu op by op": TorchDecodeStep(graph, params, where, capture=False),
        }
    for name, step in sides.items():
        row = {"side": name, **_time(step, seq, vocab, args.prompt, args.warmup, args.tokens)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    peer = _hf_peer(seq, vocab, p["width"], p["layers"], p["heads"], args)
    if peer is not None:
        row = {"side": "transformers GPT2 generate (kv cache)", **peer}
        rows.append(row)
        print(json.dumps(row), flush=True)
    shape = f"layers {p['layers']}, width {p['width']}, seq {seq}, {run.dtype}"
    print(f"# {shape}, prompt {args.prompt}, {args.tokens} tokens after {args.warmup}")


if __name__ == "__main__":
    main()
