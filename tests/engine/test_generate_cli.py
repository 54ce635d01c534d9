"""`vllm-specdiff generate`: jsonl in, jsonl out, with and without speculation (greedy)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.tiny_models import word_prompt

pytestmark = pytest.mark.vllm


def _generate(tmp_path, verifier, drafter, extra: list[str], name: str):
    out = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, "-P", "-m", "vllm_specdiff.cli", "generate",
           "--input", str(tmp_path / "prompts.jsonl"), "--output", str(out),
           "--model", str(verifier), "--max-model-len", "256", "--max-num-seqs", "2",
           "--max-tokens", "10", "--chunk-size", "3", "--gamma", "3", "--drafter", str(drafter),
           *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()], proc.stderr


def test_generate_jsonl_matches_plain_decoding(tmp_path, tiny_verifier, tiny_drafter):
    records = [{"id": f"p{i}", "prompt": word_prompt(i, 3 + 4 * i)} for i in range(5)]
    records.append({"messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 4})
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    spec, err = _generate(tmp_path, tiny_verifier, tiny_drafter, [], "spec")
    plain, _ = _generate(tmp_path, tiny_verifier, tiny_drafter, ["--no-spec"], "plain")
    assert [r["id"] for r in spec] == ["p0", "p1", "p2", "p3", "p4", 5]
    assert [r["output_token_ids"] for r in spec] == [r["output_token_ids"] for r in plain]
    assert len(spec[-1]["output_token_ids"]) <= 4
    assert all(r["output"] for r in spec)
    assert "generate: 100%" in err  # the progress bar
    assert "mean_accepted_length" in err


def test_generate_rejects_bad_input(tmp_path, tiny_verifier, tiny_drafter):
    def run(record: str, drafter) -> subprocess.CompletedProcess:
        (tmp_path / "prompts.jsonl").write_text(record + "\n")
        cmd = [sys.executable, "-P", "-m", "vllm_specdiff.cli", "--no-speed-env", "generate",
               "--input", str(tmp_path / "prompts.jsonl"), "--output", str(tmp_path / "o.jsonl"),
               "--model", str(tiny_verifier), "--drafter", str(drafter)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    # the input file is checked first, before any engine starts, with file and line
    proc = run('{"question": "no prompt field"}', tiny_drafter)
    assert proc.returncode == 2
    assert "prompts.jsonl:1: a record needs 'messages'" in proc.stderr
    proc = run('{"prompt": "hi"}', tmp_path / "missing")
    assert proc.returncode == 2
    assert "'drafter'" in proc.stderr


def _args(tmp_path, *extra: str):
    from vllm_specdiff.cli import build_parser

    return build_parser().parse_args(
        ["generate", "--input", str(tmp_path / "prompts.jsonl"), "--output",
         str(tmp_path / "out.jsonl"), "--max-model-len", "64", *extra])


@pytest.mark.parametrize(("bad", "message"), [
    ('{"prompt": "w1", "max_tokens": 0}', "max_tokens must be an integer >= 1, got 0"),
    ('{"prompt": "w1", "max_tokens": "many"}', "max_tokens must be an integer >= 1, got 'many'"),
    ('{"prompt": "w1", "max_tokens": true}', "max_tokens must be an integer >= 1, got True"),
    ('{"messages": []}', "'messages' must be a non-empty list"),
    ('{"messages": "w1 w2"}', "'messages' must be a list, got str"),
    ('{"messages": [{"role": "user", "content": 5}]}', "'messages' must be a non-empty list"),
    ('{"prompt": "' + " ".join(["w1"] * 80) + '"}', "the prompt has 8[0-9] tokens; "
                                                    "--max-model-len 64 leaves no room"),
    ('{"prompt": 5}', "a record needs 'messages'"),
])
def test_every_record_is_checked_before_the_engine(tmp_path, tiny_verifier, bad, message):
    from vllm_specdiff.commands.generate import prepare_requests

    good = json.dumps({"prompt": "w1 w2", "max_tokens": 3})
    (tmp_path / "prompts.jsonl").write_text(f"{good}\n\n{bad}\n{good}\n")  # bad is line 3
    with pytest.raises(ValueError, match=rf"prompts\.jsonl:3: .*{message}"):
        prepare_requests(_args(tmp_path), str(tiny_verifier))


def test_prepared_requests_keep_ids_and_max_tokens(tmp_path, tiny_verifier):
    from vllm_specdiff.commands.generate import prepare_requests

    (tmp_path / "prompts.jsonl").write_text(
        '{"prompt": "w1 w2", "id": "a"}\n"w3"\n{"messages": [{"role": "user", "content": '
        '"w4"}], "max_tokens": 2}\n')
    requests = prepare_requests(_args(tmp_path, "--max-tokens", "7", "--chat", "never"),
                                str(tiny_verifier))
    assert [r.id for r in requests] == ["a", 1, 2]
    assert [r.params.max_tokens for r in requests] == [7, 7, 2]
    assert requests[0].prompt_ids == [6, 7]  # w1 w2, no chat template with --chat never
    with pytest.raises(ValueError, match="--max-tokens: max_tokens must be an integer >= 1"):
        prepare_requests(_args(tmp_path, "--max-tokens", "0"), str(tiny_verifier))
    with pytest.raises(ValueError, match="--max-tokens: .*top_p"):
        prepare_requests(_args(tmp_path, "--top-p", "2"), str(tiny_verifier))


def test_output_file_appears_only_complete(tmp_path):
    from vllm_specdiff.commands.generate import atomic_output

    path = tmp_path / "sub" / "out.jsonl"
    with pytest.raises(RuntimeError), atomic_output(path) as f:
        f.write("partial\n")
        raise RuntimeError("engine died")
    assert not path.exists() and list(path.parent.iterdir()) == []
    with atomic_output(path) as f:
        f.write("done\n")
        assert not path.exists()
    assert path.read_text() == "done\n" and len(list(path.parent.iterdir())) == 1


def test_bad_record_fails_fast_and_writes_nothing(tmp_path, tiny_verifier, tiny_drafter):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "w1"}\n{"prompt": "w2", '
                                            '"max_tokens": 0}\n')
    (tmp_path / "o.jsonl").write_text("previous run\n")
    cmd = [sys.executable, "-P", "-m", "vllm_specdiff.cli", "--no-speed-env", "generate",
           "--input", str(tmp_path / "prompts.jsonl"), "--output", str(tmp_path / "o.jsonl"),
           "--model", str(tiny_verifier), "--drafter", str(tiny_drafter)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "prompts.jsonl:2: max_tokens must be an integer >= 1, got 0" in proc.stderr
    assert "Traceback" not in proc.stderr and "custom proposer" not in proc.stderr
    assert (tmp_path / "o.jsonl").read_text() == "previous run\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.jsonl", "prompts.jsonl"]


def test_candidates_flag_reaches_the_proposer_section(tmp_path):
    from vllm_specdiff.commands.common import spec_options

    assert spec_options(_args(tmp_path))["candidates"] is None  # the plugin's default
    alone = spec_options(_args(tmp_path, "--candidates", "argmax,sample"))
    assert alone["candidates"] == ["argmax", "sample"]
