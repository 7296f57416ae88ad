"""Hugging Face `transformers` folders: export a trained model, start a run from one.

`export_hf` writes ``config.json`` and ``model.safetensors`` in the names and
layouts `transformers` expects, for models of GPT-2's and Llama's shape
(`sexpgpu.train.hf.architectures`); `read_hf` reads such a folder back into
the parameters of a matching experiment (``run --init-from``). Nothing here
imports `transformers`: the folders are plain files, and the mapping is
checked against a NumPy reference of each architecture before anything is
written (`sexpgpu.train.hf.reference`).
"""

from sexpgpu.train.hf.folder import export_hf, read_hf

__all__ = ["export_hf", "read_hf"]
