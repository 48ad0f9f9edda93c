"""The project's Markdown documents: every in-page link (`](#anchor)`) names a heading of the same
document, and every relative link names a file or folder of the repository. A section renamed or
removed by mistake shows here, not as a dead link a reader finds."""
import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen, out = Counter(), set()
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not (m := re.match(r"#{1,6} (.*)", line)):
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        out.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return out


def test_heading_anchors_follow_githubs_rules():
    text = "# A title\n## The paper's load: 4 GPUs\n```\n# not a heading\n```\n## A title\n"
    assert anchors(text) == {"a-title", "the-papers-load-4-gpus", "a-title-1"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(doc):
    text = doc.read_text()
    heads, broken = anchors(text), []
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        if not path:
            if anchor not in heads:
                broken.append(target)
        elif not (doc.parent / path).exists():
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)}: links to nothing: {broken}"
