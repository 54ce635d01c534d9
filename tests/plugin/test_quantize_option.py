"""The `quantize` drafter option: checked at start-up, default chosen per device."""

import pytest

from vllm_specdiff.plugin.config import parse_specdiff_config


def test_quantize_defaults_to_auto_and_accepts_the_modes():
    assert parse_specdiff_config(None).quantize == "auto"
    for mode in ("auto", "none", "int8"):
        assert parse_specdiff_config({"specdiff": {"quantize": mode}}).quantize == mode


def test_unknown_quantize_mode_names_the_option():
    with pytest.raises(ValueError, match=r"\['quantize'\] must be one of"):
        parse_specdiff_config({"specdiff": {"quantize": "int4"}})
