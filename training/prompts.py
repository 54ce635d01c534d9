"""Reading prompt files and turning each prompt into the verifier's token ids.

One prompt per jsonl line: a JSON string, {"prompt": str}, {"text": str}, or {"messages": [...]}
(chat messages). Text prompts are wrapped as one user message when the tokenizer has a chat template
(the verifier is an instruct model, and its continuations should look like its real replies).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

Prompt = str | list[dict]


def read_prompts(path: Path, limit: int | None = None) -> list[Prompt]:
    """Parse a jsonl prompt file; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--prompts {path}: file not found")
    prompts: list[Prompt] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--prompts {path}:{lineno}: not valid JSON ({e})") from None
            prompts.append(_prompt_of(item, f"{path}:{lineno}"))
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompts")
    return prompts


def _prompt_of(item: Any, where: str) -> Prompt:
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        if isinstance(item.get("messages"), list):
            return item["messages"]
        for key in ("prompt", "text"):
            if isinstance(item.get(key), str):
                return item[key]
    raise ValueError(f"--prompts {where}: expected a string, or an object with 'prompt', 'text' "
                     f"or 'messages'")


def encode_prompt(tokenizer: Any, prompt: Prompt, chat_template: bool = True,
                  max_tokens: int | None = None) -> list[int]:
    """Token ids of one prompt, keeping its last `max_tokens` (the part nearest the reply)."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if isinstance(prompt, list):
        if not has_template:
            raise ValueError("chat-message prompts need a tokenizer with a chat template")
        ids = _apply_template(tokenizer, prompt)
    elif chat_template and has_template:
        ids = _apply_template(tokenizer, [{"role": "user", "content": prompt}])
    else:
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    ids = [int(t) for t in ids]
    if max_tokens is not None and len(ids) > max_tokens:
        ids = ids[-max_tokens:]
    if not ids:
        raise ValueError("a prompt encoded to zero tokens")
    return ids


def _apply_template(tokenizer: Any, messages: list[dict]) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)
