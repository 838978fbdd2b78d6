"""The documents a user reads: a README short enough to read, links that lead
somewhere, a docs index that lists every document, every option documented, and each figure in
one place, so that numbers cannot drift apart.

User documents are README.md and docs/*.md except docs/BENCHMARKS.md, the dated measurement log
that every figure comes from (it repeats the figures by design: it is their source)."""

import re
from pathlib import Path

import pytest

from imagenet.base.config import Config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
LOG = DOCS / "BENCHMARKS.md"
PERFORMANCE = DOCS / "PERFORMANCE.md"
OPTIONS = DOCS / "OPTIONS.md"
README_LIMIT = 12_000  # characters: what, how to run, how fast, where next

USER_DOCS = [README] + sorted(p for p in DOCS.glob("*.md") if p != LOG)
LINKING_DOCS = USER_DOCS + [LOG, ROOT / "scripts" / "perf" / "README.md"]


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


# -- markdown, just enough of it -------------------------------------------------------------

FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`]*`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)


def without_code(text: str) -> str:
    """The prose: fenced blocks and inline code spans (commands, flags, file names) removed."""
    return INLINE_CODE.sub(" ", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set:
    """Every heading anchor of a markdown file (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict = {}
    out = set()
    for _, text in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(text)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list:
    """The relative link targets of a markdown file's prose (not inside code)."""
    return [t for t in LINK.findall(without_code(path.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: ...


def section(text: str, heading: str) -> str:
    """The text of a level-2 section, up to the next level-2 heading."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


# -- figures -----------------------------------------------------------------------------------

# A number token: grouped thousands (8,140), or plain digits, optionally with decimals. Not part
# of a longer token (a hash, a name, an issue number #169545, 1024x683, the decimals of 2.5),
# but a trailing x (2.66x, a ratio) is allowed, and so is a spread's second end (7,898..7,914).
NUMBER = re.compile(r"(?<![\w,#/])(?<!\d\.)(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?=x\b|[^\w]|$)")
UNIT = re.compile(r"x\b|\s?(?:%|ms\b|s\b|points?\b|minutes?\b|img/s\b|GB\b|MB\b|GiB\b)")
NOT_FIGURES = [
    re.compile(r"\]\([^)]*\)"),  # link targets (their anchors spell dates)
    re.compile(r"\b\d{4}-\d{2}-\d{2}\b"),  # dates
    re.compile(r"\b(?:torch|torchvision|Triton|Python|CUDA|cuDNN|NCCL|TorchCodec)\s+\d+(?:\.\d+)+"),  # versions
]


def _prose_for_figures(text: str) -> str:
    text = without_code(text)
    for pattern in NOT_FIGURES:
        text = pattern.sub(" ", text)
    return text


def figures(text: str) -> dict:
    """Measured-looking numbers in prose and tables -> how they were written. A figure is a number
    of 4 or more digits (8,140; 11736), a decimal of 3 or more significant digits (45.5, 0.957),
    a decimal with a unit (2.5 minutes, 1.9x) or a signed one (+0.06). Small counts, defaults in
    prose (0.1) and 0 or 1 (baselines: 1.00x) are not figures; neither is anything in code."""
    text = _prose_for_figures(text)
    found = {}
    for m in NUMBER.finditer(text):
        whole, frac = m.group(1), m.group(2) or ""
        digits = whole.replace(",", "")
        before = text[max(0, m.start() - 2):m.start()]
        signed = len(before) > 0 and before[-1] in "+-\u2212" and not (len(before) > 1 and before[-2].isalnum())
        significant = len((digits + frac[1:]).lstrip("0"))
        is_figure = ("," in whole or len(digits) >= 4 or
                     (frac and (significant >= 3 or signed or UNIT.match(text, m.end()))))
        value = float(digits + frac)
        if is_figure and value not in (0.0, 1.0):
            found.setdefault(value, m.group(0))
    return found


def test_the_figure_finder_finds_figures_and_leaves_the_rest():
    found = figures("ResNet-50 8,140 img/s (was 3057), cold 45.5 s, 0.957 of it, 2.66x, +0.06 points, "
                    "1.5-2.5 minutes, 7,898..7,914, lr 0.1, 256 px, 1.00x, torch 2.11, 2026-12-03, pytorch/pytorch#169545, "
                    "1024x683 JPEGs, `--shuffle-window 65536`, [log](BENCHMARKS.md#runs-2026-12-03)")
    assert set(found) == {8140.0, 3057.0, 45.5, 0.957, 2.66, 0.06, 2.5, 7898.0, 7914.0}


# -- the checks ------------------------------------------------------------------------------------


def test_the_readme_is_short():
    size = len(README.read_text())
    assert size <= README_LIMIT, f"README.md is {size} characters; the limit is {README_LIMIT}: move detail to docs/"


@pytest.mark.parametrize("doc", LINKING_DOCS, ids=_name)
def test_every_relative_link_leads_to_a_file_and_its_anchor(doc):
    broken = []
    for target in links(doc):
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {_name(dest)}")
    assert not broken, f"{_name(doc)}: " + "; ".join(broken)


def test_the_readme_indexes_every_document():
    index = section(README.read_text(), "Documentation")
    listed = {(README.parent / t.partition("#")[0]).resolve() for t in LINK.findall(index)}
    missing = [_name(p) for p in sorted(DOCS.glob("*.md")) if p.resolve() not in listed]
    assert not missing, f"README's Documentation section does not link {missing}"


def test_every_option_is_documented():
    text = OPTIONS.read_text()
    flags = ["--" + f.replace("_", "-") for f in Config.__dataclass_fields__ if f != "data"]
    missing = [f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", text)]
    assert not missing, f"docs/OPTIONS.md does not mention {missing}"
    assert "`DIR`" in text


def test_no_figure_appears_in_two_user_documents():
    where: dict = {}
    for doc in USER_DOCS:
        for value, written in figures(doc.read_text()).items():
            where.setdefault(value, []).append(f"{_name(doc)} ({written})")
    twice = {value: docs for value, docs in where.items() if len(docs) > 1}
    assert not twice, ("a figure belongs in one document, linked from the others: "
                       + "; ".join(" and ".join(docs) for docs in twice.values()))


def test_the_current_figures_come_from_the_measurement_log():
    """PERFORMANCE.md and the README's speed table quote the log; they never hold a figure of their own."""
    logged = {float(m.group(1).replace(",", "") + (m.group(2) or ""))
              for m in NUMBER.finditer(LOG.read_text())}
    quoted = dict(figures(PERFORMANCE.read_text()))
    quoted.update(figures(section(README.read_text(), "How fast")))
    unlogged = sorted(written for value, written in quoted.items() if value not in logged)
    assert not unlogged, f"figures not in docs/BENCHMARKS.md (add the run, with its command, there): {unlogged}"


def test_the_log_opens_with_an_index_of_every_entry():
    """BENCHMARKS.md's first section indexes its entries by subject: every entry's heading is
    linked from it, so a reader coming from PERFORMANCE.md finds an entry without reading the log."""
    text = FENCE.sub("", LOG.read_text())
    sections = [t.strip() for level, t in HEADING.findall(text) if len(level) == 2]
    assert sections and sections[0] == "Index by subject", "the log's first section is its index"
    index = section(LOG.read_text(), "Index by subject")
    linked = set(re.findall(r"\]\(#([^)]+)\)", index))
    entries = [slug(t) for level, t in HEADING.findall(text) if len(level) == 2 and t.strip() != "Index by subject"]
    missing = [e for e in entries if e not in linked]
    assert not missing, f"entries missing from the log's index: {missing}"


def test_the_documents_speak_of_the_project_only():
    """How much machine time a work session had is no reader's concern."""
    for doc in LINKING_DOCS:
        said = re.findall(r"[^.]*\bsessions?\b[^.]*", doc.read_text(), flags=re.IGNORECASE)
        assert not said, f"{_name(doc)}: {said[:2]}"
