"""The device tests keep their compile cache in the session's temporary folder, not ~/.cache."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _session_compile_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> None:
    """``XDG_CACHE_HOME`` in the session's folder (a test may set its own).

    The cuda device points Inductor's and Triton's caches into the compile
    cache when it opens (`sexpgpu.devices.cuda.compile_cache.open_cache`):
    setting them here too has them restored after each test.
    """
    folder = tmp_path_factory.getbasetemp() / "xdg-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(folder / "sexpgpu" / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(folder / "sexpgpu" / "triton"))
    monkeypatch.delenv("SEXPGPU_CACHE", raising=False)
