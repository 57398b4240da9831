"""The docs' tutorials run: every ```python block of a tutorial page executes, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tiers import by_default

from treespec import registry

DOCS = Path(__file__).resolve().parents[1] / "docs"
TUTORIALS = ["tutorial-policy.md"]


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


@pytest.mark.parametrize("name", TUTORIALS)
def test_tutorial_runs(name, monkeypatch):
    monkeypatch.setattr(registry, "_RUNTIME", {kind: {} for kind in registry.KINDS})  # registrations stay local
    blocks = python_blocks(DOCS / name)
    assert len(blocks) >= 3, f"{name} lost its code blocks"
    namespace: dict = {"__name__": f"docs.{name}"}
    for block in blocks:
        exec(compile(block, f"{name}", "exec"), namespace)  # noqa: S102 - the docs' own code


BUILT_IN = ["caddtree", "chain", "confident-ddtree", "confident-dominotree", "cost-aware-dominotree", "ddtree",
            "ddtree-sampled", "dominotree", "dominotree-sampled", "eagle2", "gap-ddtree", "hardware-aware-sequoia",
            "learned-ddtree", "learned-dominotree", "pruned-dominotree", "router", "sequoia", "static",
            "static-corrected"]


def test_every_built_in_policy_has_a_page():
    assert registry.builtin("policy") == BUILT_IN, "a built-in policy was added or removed: update its page"
    for name in BUILT_IN:
        assert (DOCS / "policies" / f"{name}.md").is_file(), f"docs/policies/{name}.md is missing"


@pytest.mark.parametrize("name", BUILT_IN)
def test_policy_page_figures_are_drawn_by_the_script(name):
    """Every figure a policy page shows exists, is an SVG drawing of a tree, and make.sh draws it."""
    page = (DOCS / "policies" / f"{name}.md").read_text()
    script = (DOCS / "figures" / "make.sh").read_text()
    figures = re.findall(r"!\[[^\]]*\]\(\.\./figures/([^)]+)\)", page)
    assert figures, f"{name}.md shows no drawn tree"
    for figure in figures:
        svg = (DOCS / "figures" / figure).read_text()
        assert svg.lstrip().startswith("<?xml") and "<svg" in svg, f"{figure} is not an SVG"
        stem = figure.removeprefix("tree-").removesuffix(".svg")
        assert re.search(rf'"{re.escape(stem)} [^"]+"', script), f"make.sh does not draw {figure}"
    assert "FIGURE_NOTE" not in page and "MERMAID_" not in page, f"{name}.md has an unfilled placeholder"


def test_ab_walkthrough_code_prints_the_tables_it_shows(monkeypatch, capsys):
    """The walkthrough's code runs on the committed records and prints exactly what the page shows."""
    monkeypatch.chdir(DOCS.parent)
    page = (DOCS / "ab-walkthrough.md").read_text()
    blocks = python_blocks(DOCS / "ab-walkthrough.md")
    assert len(blocks) == 2, "ab-walkthrough.md lost its code blocks"
    namespace: dict = {"__name__": "docs.ab-walkthrough"}
    for block in blocks:
        exec(compile(block, "ab-walkthrough.md", "exec"), namespace)  # noqa: S102 - the docs' own code
        printed = capsys.readouterr().out.strip()
        assert printed and printed in page, "the page does not show what its code prints"
    assert len(namespace["records"]) == 220


@pytest.mark.parametrize("run", by_default(["ab", "live"], "live"))  # ab: 26 s, live: 7 s
def test_bench_report_rederives_byte_for_byte(tmp_path, run):
    """The committed tables (the A/B walkthrough's, the shipped drafters' live run in embedded.md)
    are what `treespec bench report` derives from the committed JSONL."""
    from treespec.apps.bench import write_report

    folder = DOCS / "figures" / run
    for name in ("records.jsonl", "divergences.jsonl"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    write_report(tmp_path)
    for name in ("summary.md", "summary.csv", "pairs.csv", "lossless.md"):
        assert (tmp_path / name).read_bytes() == (folder / name).read_bytes(), f"{name} differs"
    for plot in ("tau_hist.svg", "budget_curves.svg"):
        assert (folder / plot).is_file(), f"docs/figures/{run}/{plot} is missing"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_relative_link_in_the_docs_resolves():
    """Links between pages name files that exist and, after '#', a heading of that page."""
    root = Path(__file__).resolve().parents[1]
    pages = [root / "README.md", root / "benchmarks" / "README.md", *sorted((root / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(root)}: {target} (no such file)")
            elif anchor and file.suffix == ".md":
                anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", file.read_text(), flags=re.M)}
                if anchor not in anchors:
                    broken.append(f"{page.relative_to(root)}: {target} (no such heading)")
    assert broken == []


def test_the_benchmarks_index_lists_every_script_and_no_main_runs_long():
    """benchmarks/README.md names every script once; no function there is over 40 lines."""
    import ast

    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    listed = re.findall(r"^\| `(\w+\.py)` \|", (folder / "README.md").read_text(), flags=re.M)
    assert sorted(listed) == sorted(p.name for p in folder.glob("*.py"))
    long = [f"{p.name}:{n.name} ({n.end_lineno - n.lineno + 1} lines)" for p in folder.glob("*.py")
            for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.FunctionDef)
            and n.end_lineno - n.lineno + 1 > 40]
    assert long == []
