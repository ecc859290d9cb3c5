"""The runnable samples of the README and the documentation's guide pages.

Convention (documented in docs/getting-started.md): a fenced ```python block directly preceded by the
line ``<!-- snippet: python -->`` or ``<!-- snippet: torchrun -->`` is a complete program; ``python``
ones run in one Python process, ``torchrun`` ones in one ``torchrun --nproc_per_node 2`` launch, each in
a fresh namespace, one after the other. A marker not followed by a python block, or of another kind, is
an error, so a typo cannot silently drop a sample. Results pages (docs/results/) are not searched: they
hold measurements and their shell commands, not samples.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("python", "torchrun")
MARKER = re.compile(r"^<!--\s*snippet:\s*(\S+)\s*-->\s*$")


@dataclass(frozen=True)
class Snippet:
    kind: str
    source: str
    origin: str  #: "path:line" of the block's first code line

    @property
    def file_name(self) -> str:
        """A file name that says where the sample comes from, e.g. ``docs_ssp.md_L12.py``."""
        return re.sub(r"[^A-Za-z0-9_.]", "_", self.origin.replace(":", "_L")) + ".py"


def pages() -> list[Path]:
    """The README and every guide page."""
    return [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md"))


def extract(page: Path) -> list[Snippet]:
    lines = page.read_text().splitlines()
    where = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
    found = []
    for number, line in enumerate(lines):
        marker = MARKER.match(line)
        if not marker:
            continue
        kind = marker.group(1)
        if kind not in KINDS:
            raise ValueError(f"{where}:{number + 1}: snippet kind {kind!r} is not one of {KINDS}")
        if number + 1 >= len(lines) or lines[number + 1].strip() != "```python":
            raise ValueError(f"{where}:{number + 1}: a snippet marker must be followed by a ```python block")
        end = next((i for i in range(number + 2, len(lines)) if lines[i].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{where}:{number + 2}: the snippet's code block is not closed")
        found.append(Snippet(kind, "\n".join(lines[number + 2:end]) + "\n", f"{where}:{number + 3}"))
    return found


def all_snippets() -> list[Snippet]:
    return [snippet for page in pages() for snippet in extract(page)]
