"""A drafter named by a hub id (`ORG/NAME`): resolved to its snapshot in the Hugging Face cache
(offline here), through the `drafter` option as through `load_drafter`."""

from __future__ import annotations

import shutil

import pytest

from vllm_specdiff.drafter.hub import is_hub_id, resolve_drafter

from .test_dflash_checkpoints import write_dflash

REPO, COMMIT = "some-org/tiny-dflash-b8", "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline Hugging Face cache holding one DFlash checkpoint under REPO; its snapshot."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(write_dflash(tmp_path / "ckpt", "llama", 300), snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return snapshot


def test_a_hub_id_resolves_to_its_cached_snapshot(hub_cache):
    assert resolve_drafter(REPO) == str(hub_cache)


def test_the_drafter_option_takes_a_hub_id_and_checks_the_snapshot(hub_cache):
    from vllm_specdiff.plugin.config import parse_specdiff_config

    config = parse_specdiff_config({"specdiff": {"drafter": REPO}}, gamma=7)
    assert config.drafter == str(hub_cache)
    with pytest.raises(ValueError, match="exceeds|block"):  # the block check read the snapshot
        parse_specdiff_config({"specdiff": {"drafter": REPO}}, gamma=8)


def test_an_id_missing_from_the_offline_cache_fails_naming_it(hub_cache):
    from vllm_specdiff.plugin.config import parse_specdiff_config

    with pytest.raises(FileNotFoundError, match=r"\['drafter'\].*'some-org/absent'.*download"):
        parse_specdiff_config({"specdiff": {"drafter": "some-org/absent"}})


def test_local_paths_are_never_taken_for_hub_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name") and resolve_drafter("org/name") == "org/name"
    assert not is_hub_id("./org/absent") and not is_hub_id("/abs/path")
    assert is_hub_id("org/absent")
