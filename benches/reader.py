"""Reader speed: 100k forms (about 10 MB) read by `sexpgpu.lang.read`, against peers.

The same nested structure is written three ways and parsed in the same run:
as S-expressions (`sexpgpu.lang.read`, spans on every node), as JSON
(`json.loads`, C, no positions) and as Python (`ast.parse`, C, positions on
every node). Prints one line per parser with the best of `--repeat` runs.

    python benches/reader.py [--forms 100000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import time

from sexpgpu.lang import read


def make_forms(count: int, seed: int = 0) -> list[list]:
    """`count` nested forms of symbols, keywords, numbers, strings and vectors."""
    rng = random.Random(seed)
    forms = []
    for i in range(count):
        forms.append(
            [
                "defrun",
                f"run-{i}",
                ":model",
                "gpt",
                ":opt",
                ["adamw", ":lr", round(rng.random() * 1e-3, 6), ":betas", [0.9, 0.95]],
                ":steps",
                rng.randrange(1, 10**6),
                ":checkpoint",
                ["every", rng.randrange(1, 1000), f"runs/{i}"],
            ]
        )
    return forms


def as_sexp(form: object) -> str:
    if isinstance(form, list):
        return "(" + " ".join(as_sexp(item) for item in form) + ")"
    if isinstance(form, str) and "/" in form:
        return json.dumps(form)
    return str(form) if not isinstance(form, float) else repr(form)


def as_python(form: object) -> str:
    if isinstance(form, list):
        return "(" + ", ".join(as_python(item) for item in form) + ",)"
    return repr(form)


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forms", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    forms = make_forms(args.forms)
    sexp = "\n".join(as_sexp(form) for form in forms) + "\n"
    js = json.dumps(forms)
    py = "\n".join(as_python(form) for form in forms) + "\n"
    nodes = read(sexp, "bench.lisp")
    assert len(nodes) == args.forms
    print(f"{args.forms} forms, {len(sexp) / 1e6:.1f} MB of S-expressions")
    ours = best_of(args.repeat, lambda: read(sexp, "bench.lisp"))
    peers = {
        "json.loads": best_of(args.repeat, lambda: json.loads(js)),
        "ast.parse": best_of(args.repeat, lambda: ast.parse(py)),
    }
    print(f"sexpgpu.lang.read  {ours:7.3f} s  {len(sexp) / ours / 1e6:6.1f} MB/s")
    for name, seconds in peers.items():
        print(f"{name:<17}  {seconds:7.3f} s  read/{name} = {ours / seconds:.2f}")


if __name__ == "__main__":
    main()
