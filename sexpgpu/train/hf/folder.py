"""Reading and writing `transformers` folders (``config.json``, ``model.safetensors``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from sexpgpu.errors import SexpgpuError
from sexpgpu.train.hf.architectures import ARCHITECTURES, Architecture, Sizes, mismatch
from sexpgpu.train.hf.facts import model_facts
from sexpgpu.train.hf.reference import REFERENCES

__all__ = ["TOLERANCE", "export_hf", "read_hf"]

# Largest difference of the logits from the architecture's NumPy reference, relative
# to their largest magnitude: float32 rounding, not a different computation.
TOLERANCE = 1e-4
_WEIGHTS, _CONFIG = "model.safetensors", "config.json"
# Buffers transformers may save that are no parameters (GPT-2's causal masks).
_BUFFERS = (".attn.bias", ".attn.masked_bias")


def _architecture(experiment: Any, run: Any, shapes: Mapping[str, tuple[int, ...]]) -> Any:
    """(architecture, sizes, facts) of the run's model, or E-HF-001 naming each first mismatch."""
    facts = model_facts(experiment, run)
    reasons = []
    for arch in ARCHITECTURES.values():
        sizes, why = mismatch(arch, facts, shapes)
        if sizes is not None:
            return arch, sizes
        reasons.append(f"{arch.name}: {why}")
    raise SexpgpuError(
        "E-HF-001",
        f"the model `{run.model}` maps to no architecture transformers knows; "
        + "; ".join(reasons),
        getattr(experiment.models[run.model], "span", None) or str(experiment.path),
        hint="export handles models shaped as examples/gpt.lisp (GPT-2) or "
        "examples/llama.lisp (Llama); the first difference from each is named",
    )


def _check_numerics(
    arch: Architecture, sizes: Sizes, tensors: Mapping[str, np.ndarray], experiment: Any, run: Any,
    params: Mapping[str, np.ndarray],
) -> None:  # fmt: skip
    """E-HF-001 unless the model's logits equal the architecture's on random ids."""
    from sexpgpu.devices.cpu import CpuProgram
    from sexpgpu.ir.compile import output_graph

    graph = output_graph(experiment, run, dtype="f32")
    assert graph is not None
    (name,) = graph.inputs
    ids = np.random.default_rng(0).integers(0, sizes.vocab, size=(1, sizes.seq), dtype=np.int32)
    feeds = {k: np.asarray(params[k], np.float32) for k in graph.params}
    ours = np.asarray(CpuProgram(graph)({**feeds, name: ids})["output"][0], np.float64)
    theirs = REFERENCES[arch.name](tensors, sizes, ids[0])
    scale = max(1.0, float(np.abs(theirs).max()))
    diff = np.abs(ours - theirs)
    if not diff.max() <= TOLERANCE * scale:
        position = int(np.unravel_index(int(np.argmax(diff)), diff.shape)[0])
        raise SexpgpuError(
            "E-HF-001",
            f"the model `{run.model}` has {arch.name}'s parameters but computes something "
            f"else: its logits differ from {arch.name}'s by {diff.max():.3g} "
            f"(first at position {position})",
            getattr(experiment.models[run.model], "span", None) or str(experiment.path),
            hint=f"{arch.name} is written as examples/"
            f"{'gpt' if arch.name == 'gpt2' else 'llama'}.lisp computes it",
        )


def export_hf(trained: Any, folder: str | Path) -> tuple[str, Path]:
    """Write `trained`'s model as a `transformers` folder; returns (architecture, folder).

    Raises
    ------
    SexpgpuError
        E-HF-001 when the model maps to no known architecture (the first
        mismatch named) or computes otherwise; E-CLI-001 when `folder` is
        not a new or empty folder that can be written.
    """
    from safetensors.numpy import save_file

    experiment, run, params = trained.experiment, trained.run, trained.params
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    arch, sizes = _architecture(experiment, run, shapes)
    tensors = arch.to_hf(run.model, sizes, params)
    _check_numerics(arch, sizes, tensors, experiment, run, params)
    out = Path(folder)
    try:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            what = "a file" if not out.is_dir() else "a folder with files in it"
            raise SexpgpuError(
                "E-CLI-001",
                f"--to hf {out}: {out} is {what}; export writes a new folder",
                str(out),
                hint="name a new or empty folder",
            )
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / _WEIGHTS), metadata={"format": "pt"})
        config = arch.config(sizes)
        (out / _CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    except OSError as err:
        raise SexpgpuError(
            "E-CLI-001",
            f"cannot write {out}: {err.strerror or err}",
            str(out),
            hint="name a folder you can write to",
        ) from None
    return arch.name, out


def _read_folder(folder: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """config.json and model.safetensors of a transformers folder (E-HF-002 if unreadable)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    def fail(what: str, hint: str) -> SexpgpuError:
        return SexpgpuError("E-HF-002", f"--init-from {folder}: {what}", str(folder), hint=hint)

    hint = "point --init-from at a folder transformers' save_pretrained wrote (safetensors)"
    try:
        config = json.loads((folder / _CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise fail(f"no readable {_CONFIG} ({err})", hint) from None
    if not isinstance(config, dict):
        raise fail(f"{_CONFIG} is not a JSON object", hint)
    try:
        tensors = load_file(str(folder / _WEIGHTS))
    except (OSError, SafetensorError, ValueError) as err:
        raise fail(f"no readable {_WEIGHTS} ({err})", hint) from None
    return config, tensors


# config.json's names of the sizes, per architecture (Sizes field -> key)
_CONFIG_SIZES = {
    "gpt2": {
        "layers": "n_layer",
        "width": "n_embd",
        "heads": "n_head",
        "vocab": "vocab_size",
        "seq": "n_positions",
    },
    "llama": {
        "layers": "num_hidden_layers",
        "width": "hidden_size",
        "heads": "num_attention_heads",
        "kv_heads": "num_key_value_heads",
        "vocab": "vocab_size",
        "ffn": "intermediate_size",
    },
}


def read_hf(folder: str | Path, experiment: Any, run: Any, shapes: Mapping[str, tuple]) -> dict:
    """The parameters of a `transformers` folder, in `run`'s names (``run --init-from``).

    Raises
    ------
    SexpgpuError
        E-HF-002 when the folder cannot be read, is of another architecture
        than the model, or differs in a size, a tensor's name or shape (the
        first difference named); E-HF-001 when the model maps to none.
    """
    folder = Path(folder)
    config, tensors = _read_folder(folder)
    arch, sizes = _architecture(experiment, run, shapes)

    def fail(what: str, hint: str) -> SexpgpuError:
        return SexpgpuError("E-HF-002", f"--init-from {folder}: {what}", str(folder), hint=hint)

    kind = config.get("model_type")
    if kind != arch.name:
        raise fail(
            f"the folder holds a {kind!r} model; the experiment's model is {arch.name}",
            f"start from a {arch.name} folder of the experiment's sizes",
        )
    for field, key in _CONFIG_SIZES[arch.name].items():
        if config.get(key) != getattr(sizes, field):
            raise fail(
                f"config.json's {key} is {config.get(key)!r}, the experiment's is "
                f"{getattr(sizes, field)}",
                "give the experiment the folder's sizes (e.g. with --set), or another folder",
            )
    if arch.name == "gpt2":  # older GPT-2 files name the tensors without `transformer.`
        tensors = {
            k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}": v
            for k, v in tensors.items()
        }
        tensors.pop("lm_head.weight", None)  # tied to wte
    tensors = {k: v for k, v in tensors.items() if not k.endswith(_BUFFERS)}
    wanted = arch.hf_shapes(run.model, sizes)
    for name, shape in wanted.items():
        if name not in tensors:
            raise fail(f"{_WEIGHTS} has no tensor {name}", "start from a complete folder")
        if tuple(tensors[name].shape) != tuple(shape):
            raise fail(
                f"{name} is {list(tensors[name].shape)}, the experiment needs {list(shape)}",
                "give the experiment the folder's sizes, or another folder",
            )
    extra = sorted(set(tensors) - set(wanted))
    if extra:
        raise fail(
            f"{_WEIGHTS} holds {extra[0]}, which the experiment's model has no place for",
            "start from a folder of the same architecture and options",
        )
    return arch.from_hf(run.model, sizes, tensors)
