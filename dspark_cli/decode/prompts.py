"""Eval prompts: `{"turns": [...]}` JSONL files (MT-Bench style) and our own prompt/response Parquet.

Each conversation becomes an optional system prompt plus the user turns, answered one after the
other by the model being evaluated (earlier answers stay in the context of later turns).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .. import storage
from ..errors import DsparkError


@dataclass
class Conversation:
    id: str
    turns: list[str]
    system: str | None = None


def dataset_name(url: str) -> str:
    """Short name for reports: the file stem, or the artifact folder's name."""
    name = storage.basename(url)
    for suffix in (".jsonl", ".json", ".parquet"):
        name = name.removesuffix(suffix)
    return name or url


def _from_jsonl(url: str, limit: int | None) -> list[Conversation]:
    out = []
    for lineno, line in enumerate(storage.read_text(url).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DsparkError(f"{url}:{lineno}: not valid JSON ({e.msg}).") from None
        turns = row.get("turns") if isinstance(row, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise DsparkError(f"{url}:{lineno}: expected {{\"turns\": [\"…\", …]}} with at least one "
                              "string turn.")
        out.append(Conversation(id=str(row.get("id", row.get("question_id", lineno))), turns=turns,
                                system=row.get("system")))
        if limit is not None and len(out) >= limit:
            break
    return out


def _from_artifact(url: str, split: str | None, limit: int | None) -> list[Conversation]:
    """Prompt or response artifact rows: system/user turns kept, assistant turns dropped."""
    from ..data.io import read_rows

    out = []
    for row in read_rows(url, split=split, columns=["id", "messages"]):
        messages = row["messages"] or []
        system = next((m["content"] for m in messages if m["role"] == "system"), None)
        turns = [m["content"] for m in messages if m["role"] == "user"]
        if turns:
            out.append(Conversation(id=row["id"], turns=turns, system=system))
        if limit is not None and len(out) >= limit:
            break
    return out


def load_conversations(url: str, limit: int | None = None, split: str | None = None) -> list[Conversation]:
    """Read a JSONL turns file or a prompts/responses artifact folder; `split` applies to artifacts."""
    if url.endswith((".jsonl", ".json")):
        if not storage.exists(url):
            raise DsparkError(f"{url}: file not found.")
        conversations = _from_jsonl(url, limit)
    elif storage.exists(storage.join(url, "data")):
        conversations = _from_artifact(url, split, limit)
    else:
        raise DsparkError(f"{url}: neither a {{\"turns\": […]}} .jsonl file nor a prompt/response artifact "
                          "(no data/ folder).")
    if not conversations:
        where = f" in split {split!r}" if split else ""
        raise DsparkError(f"{url}: holds no usable conversation{where}.")
    return conversations
