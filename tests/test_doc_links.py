"""Every relative link in README.md and docs/*.md points at a file that exists and, when it names
one, at a heading that file has: the README sends readers to docs/benchmarks.md and the stage docs
by anchor, and a renamed heading would otherwise break the link silently."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in FENCE.sub("", path.read_text()).splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[str]:
    return [t for t in LINK.findall(FENCE.sub("", path.read_text()))
            if not re.match(r"[a-z]+:", t)]  # http:, https:, mailto: are not checked offline


def test_slug_follows_github():
    assert slug("`make bench-quality`") == "make-bench-quality"
    assert slug("The demo (`make demo`)") == "the-demo-make-demo"
    assert slug("`pipeline run`, and a config's paths") == "pipeline-run-and-a-configs-paths"
    assert slug("Decode speed: `make bench-decode`") == "decode-speed-make-bench-decode"
    assert slug("The trial (`benchmarks/trial_faults.py`)") == "the-trial-benchmarkstrial_faultspy"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves(doc):
    broken = []
    for target in links(doc):
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor}")
    assert not broken, broken
