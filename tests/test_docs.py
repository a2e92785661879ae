"""Every citation of the method's definitions points at a section docs/method.md has."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CITATION = re.compile(r"(?:docs/)?method\.md,? (?:sections? |s\.)(\d+)(?: and (\d+))?", re.IGNORECASE)


def sections() -> set[int]:
    text = (REPO / "docs" / "method.md").read_text()
    return {int(n) for n in re.findall(r"^## (\d+)\. ", text, re.MULTILINE)}


def test_method_has_the_seven_sections():
    assert sections() == set(range(1, 8))


def test_every_cited_section_exists():
    have, bad, n = sections(), [], 0
    for path in sorted(REPO.rglob("*")):
        if path.suffix not in (".py", ".md", ".yaml") or ".git" in path.parts or "samples" in path.parts:
            continue
        for m in CITATION.finditer(path.read_text(errors="replace")):
            for g in m.groups():
                n += g is not None
                if g is not None and int(g) not in have:
                    bad.append(f"{path.relative_to(REPO)}: {m.group(0)!r}")
    assert n >= 30, "the code cites docs/method.md by section"
    assert not bad, "citations of sections docs/method.md does not have:\n" + "\n".join(bad)
