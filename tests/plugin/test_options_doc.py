"""docs/options.md is generated from the options' declaration and must stay in step with it."""

from __future__ import annotations


def test_options_doc_is_up_to_date():
    from vllm_specdiff.config_docs import PATH, main, render

    assert PATH.read_text() == render(), \
        "docs/options.md is out of date: run python -m vllm_specdiff.config_docs"
    assert main(["--check"]) == 0


def test_options_doc_lists_every_option_and_flag():
    from vllm_specdiff.commands.flags import flag
    from vllm_specdiff.config_docs import render
    from vllm_specdiff.plugin.config import DECLARED

    rows = [line for line in render().splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == list(DECLARED)
    for row, opt in zip(rows, DECLARED.values(), strict=True):
        assert f"`{flag(opt)}`" in row and opt.spec.help in row
