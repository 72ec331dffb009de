"""Input row formats → one normalised conversation, or a reason the row cannot be used.

Three formats are recognised by their keys (DESIGN.md §2):
- ShareGPT: `conversations: [{from, value}]` (human→user, gpt/chatgpt/bing/bard→assistant),
- OpenAI:   `messages: [{role, content}]` (content may be a list of text parts),
- eval:     `turns: [str, …]` (user turns only).
System turns are kept in place. In ShareGPT/OpenAI rows, consecutive turns of one role are merged
(chat templates expect user and assistant to alternate). In the output, every user turn is followed
by an assistant turn to regenerate, so `[user, user]` there means two rounds.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

ROLE_MAP = {
    "human": "user", "user": "user", "prompter": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "assistant": "assistant", "model": "assistant",
    "system": "system", "developer": "system",
}
ID_KEYS = ("id", "conversation_id", "question_id", "task_id", "uuid")


class RowError(ValueError):
    """The row cannot be used; the message is the quarantine reason, `kind` its category."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class Conversation:
    """A usable conversation: prompt turns (system/user, in order) and the original answers."""

    source_id: str | None
    source: str | None
    messages: list[dict[str, str]]
    original_assistant: list[str]

    def prompt_hash(self) -> str:
        """Content hash of the prompt turns: equal prompts are duplicates whatever their ids."""
        blob = json.dumps(self.messages, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        return hashlib.sha256(blob).hexdigest()


def _text(value: Any, where: str) -> str:
    """Message content as text: a string, or the concatenated text parts of an OpenAI list."""
    if isinstance(value, list):
        parts = []
        for part in value:
            is_text = isinstance(part, dict) and part.get("type", "text") == "text"
            if is_text and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise RowError(f"{where}: non-text content part", "non-text content")
        value = "".join(parts)
    if not isinstance(value, str):
        raise RowError(f"{where}: content is {type(value).__name__}, not a string", "non-text content")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RowError(f"{where}: not valid UTF-8 ({e.reason})", "not UTF-8") from None
    if not value.strip():
        raise RowError(f"{where}: empty content", "empty content")
    return value


def _turns(row: dict[str, Any]) -> list[tuple[str, str]]:
    """(role, content) pairs in the row's format, roles mapped, same-role runs merged; RowError."""
    if "conversations" in row:
        turns = row["conversations"]
        role_key, content_key = "from", "value"
    elif "messages" in row:
        turns = row["messages"]
        role_key, content_key = "role", "content"
    elif "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list):
            raise RowError("turns: not a list", "unknown format")
        # Each eval turn is its own user turn: the answers between them are to be generated.
        return [("user", _text(t, f"turn {i}")) for i, t in enumerate(turns)]
    else:
        raise RowError("unknown row format: no 'conversations', 'messages' or 'turns' key", "unknown format")
    if not isinstance(turns, list):
        raise RowError(f"{role_key}/{content_key} turns: not a list", "unknown format")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RowError(f"turn {i}: not an object", "unknown format")
        raw_role = turn.get(role_key)
        role = ROLE_MAP.get(str(raw_role).strip().lower()) if raw_role is not None else None
        if role is None:
            raise RowError(f"turn {i}: unknown role {raw_role!r}", "unknown role")
        out.append((role, _text(turn.get(content_key), f"turn {i}")))
    return _merge_runs(out)


def _merge_runs(turns: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Join consecutive turns of one role with a blank line (chat templates need alternation)."""
    merged: list[tuple[str, str]] = []
    for role, content in turns:
        if merged and merged[-1][0] == role:
            merged[-1] = (role, merged[-1][1] + "\n\n" + content)
        else:
            merged.append((role, content))
    return merged


def _utf8(value: Any) -> str | None:
    """value if it is text that encodes as UTF-8, else None."""
    if not isinstance(value, str):
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return value


def _source_id(row: dict[str, Any]) -> str | None:
    for key in ID_KEYS:
        value = row.get(key)
        if isinstance(value, str | int) and not isinstance(value, bool) and str(value).strip():
            text = _utf8(str(value).strip())
            if text is None:
                raise RowError(f"{key}: not valid UTF-8", "not UTF-8")
            return text
    return None


def normalise(row: Any) -> Conversation:
    """One input row → Conversation; raises RowError with the quarantine reason."""
    if not isinstance(row, dict):
        raise RowError(f"row is {type(row).__name__}, not an object", "unknown format")
    turns = _turns(row)
    messages: list[dict[str, str]] = []
    original: list[str] = []
    seen_user = False
    for role, content in turns:
        if role == "assistant":
            if not seen_user:
                raise RowError("assistant turn before the first user turn", "assistant first")
            original.append(content)
        else:
            seen_user = seen_user or role == "user"
            messages.append({"role": role, "content": content})
    if not seen_user:
        raise RowError("no user turn", "no user turn")
    source = _utf8(row.get("source"))
    return Conversation(_source_id(row), source, messages, original)
