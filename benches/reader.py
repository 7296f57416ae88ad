"""Reader speed: a file of 100k forms (about 12 MB) read by `sexpgpu.lang.read_file`, against peers.

The same nested structure is written to three files and each is read and
parsed in the same run: as S-expressions (`sexpgpu.lang.read_file`, spans on
every node), as JSON (`json.loads`, C, no positions) and as Python
(`ast.parse`, C, positions on every node). Prints one line per parser with
the best of `--repeat` runs.

    python benches/reader.py [--forms 100000] [--repeat 3]
    python benches/reader.py --smoke       # 1,000 forms once, in a second (CI)
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import tempfile
import time
from pathlib import Path

from sexpgpu.lang import read_file


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
    parser.add_argument("--smoke", action="store_true", help="1,000 forms, read once")
    args = parser.parse_args()
    if args.smoke:
        args.forms, args.repeat = 1000, 1
    forms = make_forms(args.forms)
    with tempfile.TemporaryDirectory() as folder:
        sexp, js, py = Path(folder, "f.lisp"), Path(folder, "f.json"), Path(folder, "f.py")
        sexp.write_text("\n".join(as_sexp(form) for form in forms) + "\n")
        js.write_text(json.dumps(forms))
        py.write_text("\n".join(as_python(form) for form in forms) + "\n")
        assert len(read_file(sexp)) == args.forms
        size = sexp.stat().st_size
        print(f"{args.forms} forms, {size / 1e6:.1f} MB of S-expressions")
        ours = best_of(args.repeat, lambda: read_file(sexp))
        peers = {
            "json.loads": best_of(args.repeat, lambda: json.loads(js.read_text())),
            "ast.parse": best_of(args.repeat, lambda: ast.parse(py.read_text())),
        }
    print(f"sexpgpu.lang.read_file  {ours:7.3f} s  {size / ours / 1e6:6.1f} MB/s")
    for name, seconds in peers.items():
        print(f"{name:<22}  {seconds:7.3f} s  read_file/{name} = {ours / seconds:.2f}")


if __name__ == "__main__":
    main()
