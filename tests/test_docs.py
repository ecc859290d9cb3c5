"""The documentation builds strictly, its links resolve, it speaks of no development history, and every
sample it presents as runnable runs (the convention: tests/snippets.py)."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

from cluster import free_port
from snippets import ROOT, Snippet, all_snippets, extract, pages

#: what a guide page must not say: development history belongs nowhere, dates only on results pages
HISTORY = re.compile(r"\b(?:sessions?|campaigns?|was fixed|fixed on the way|break-?tests?|issue \d+|"
                     r"(?:seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth) session|"
                     r"\d{4}-\d{2}-\d{2})\b", re.IGNORECASE)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "choosing" / "index.html").exists()


def anchors(page: Path) -> set[str]:
    """The heading anchors of a Markdown page, as MkDocs' toc (and, for these headings, GitHub) makes them."""
    return {slugify(m.group(1).strip(), "-") for m in re.finditer(r"^#+\s+(.*)$", page.read_text(), re.MULTILINE)}


def test_the_readme_links_resolve():
    readme = ROOT / "README.md"
    broken = []
    for target in LINK.findall(readme.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        page = (readme.parent / path) if path else readme
        if not page.exists() or (anchor and page.suffix == ".md" and anchor not in anchors(page)):
            broken.append(target)
    assert not broken, f"README.md links to what does not exist: {broken}"


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_guide_page_speaks_of_no_development_history(page):
    hits = [f"{page.name}:{n + 1}: {line.strip()}" for n, line in enumerate(page.read_text().splitlines())
            if HISTORY.search(line)]
    assert not hits, "\n".join(hits)


def test_the_readme_and_the_guides_have_runnable_samples():
    snippets = all_snippets()
    assert {s.kind for s in snippets} == {"python", "torchrun"}
    assert any(s.origin.startswith("README.md") and s.kind == "torchrun" for s in snippets)


def test_a_marker_without_a_code_block_is_an_error(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- snippet: torchrun -->\nno code here\n")
    with pytest.raises(ValueError, match="must be followed by a ```python block"):
        extract(page)


def write(snippets: list[Snippet], folder: Path) -> Path:
    folder.mkdir()
    for index, snippet in enumerate(snippets):
        (folder / f"{index:02d}_{snippet.file_name}").write_text(snippet.source)
    return folder


def run_samples(kind: str, tmp_path: Path) -> tuple[str, float]:
    # a sample shown on two pages (the README's smallest program) runs once
    snippets = list({s.source: s for s in all_snippets() if s.kind == kind}.values())
    folder = write(snippets, tmp_path / kind)
    launcher = [sys.executable] if kind == "python" else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    start = time.perf_counter()
    done = subprocess.run([*launcher, str(ROOT / "tests" / "snippet_runner.py"), str(folder)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert done.stdout.count("ran ") == len(snippets) * (1 if kind == "python" else 2), done.stdout
    return done.stdout, time.perf_counter() - start


def test_the_python_samples_run(tmp_path):
    run_samples("python", tmp_path)


@pytest.mark.slow  # 16 s: the python samples stay in the fast tier
def test_the_torchrun_samples_run(tmp_path):
    run_samples("torchrun", tmp_path)
