"""The Markdown pages link to files and sections that exist: every relative link of README.md, docs/,
benchmarks/ and examples/ names a file of the checkout, and its #anchor a heading of that file (GitHub's slugs)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("benchmarks/*.md"),
                *ROOT.glob("examples/*/README.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(text):
    """The page without its fenced code blocks (whose lines may start with #) or inline code."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", lambda m: m.group(0) if "](" in m.group(0) else "", text)


def anchors(page):
    """GitHub's anchor of each heading: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen, out = {}, set()
    for line in re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M).splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_names_a_file_and_a_heading_that_exist(page):
    bad = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert bad == [], f"{page.relative_to(ROOT)}: " + "; ".join(bad)


def test_the_front_page_fits_and_names_every_command():
    """README.md is a front page (at most 220 lines); every command (a module at the top of fairseq_moe/ with a
    main: docs/architecture.md's recipe) has its row in the README's table and its section in docs/tools.md."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 220, "README.md is a front page: move the detail to a page of docs/"
    door = {"__init__", "errors", "patches", "refusals"}
    commands = sorted(p.stem for p in (ROOT / "fairseq_moe").glob("*.py")
                      if p.stem not in door and "def main(" in p.read_text())
    assert "average" in commands and "reshard" in commands, commands
    tools = [line for line in (ROOT / "docs" / "tools.md").read_text().splitlines() if line.startswith("## ")]
    for name in commands:
        assert f"| `python -m fairseq_moe.{name}` |" in readme, f"{name}: no row in the README's table of commands"
        assert any(re.search(rf"\b{name}\b", h) for h in tools), f"{name}: no section of docs/tools.md"
