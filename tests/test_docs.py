"""The documentation (README.md, notebooks/README.md, docs/, mkdocs.yml): every ```python block runs,
and the site's navigation holds what it promises.

Code blocks: each file's ```python blocks run in order in one namespace (a block may use what the
blocks before it defined), on the CPU, in a scratch folder of their own. A marker on the line right
before a fence changes how its block is run:

    <!-- docs-test: skip (needs a GPU) -->        not run; reported as a skip with that reason
    <!-- docs-test: raises InvariantError -->     must raise that exception (a class of that name)

Other fences (bash, text, no language) are not run. Tracebacks name the Markdown file and its line.
`make test` also builds the site with `mkdocs build --strict` (`make docs`), before pytest."""
from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = [REPO / "README.md", REPO / "notebooks" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
README_MAX_LINES = 160

FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
SKIP = re.compile(r"^skip \((?P<reason>[^)]+)\)$")
RAISES = re.compile(r"^raises (?P<error>[A-Za-z_][\w.]*)$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int               # the line of the first code line (1-based)
    lang: str
    code: str
    marker: str | None      # the docs-test marker right before the fence, if any

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def skip_reason(self) -> str | None:
        m = SKIP.match(self.marker or "")
        return m["reason"] if m else None

    @property
    def raises(self) -> str | None:
        m = RAISES.match(self.marker or "")
        return m["error"] if m else None


def fenced_blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file (any language), with the marker right before it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = len(m["indent"]), m["fence"]
        close = re.compile(rf"^ *{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        body = [line[indent:] if line[:indent].strip() == "" else line for line in lines[i + 1:j]]
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = MARKER.match(lines[k]) if k >= 0 else None
        blocks.append(Block(path, i + 2, m["lang"].lower(), "\n".join(body) + "\n",
                            marker["body"] if marker else None))
        i = j + 1
    return blocks


def python_blocks(path: Path) -> list[Block]:
    return [b for b in fenced_blocks(path) if b.lang in ("python", "py")]


# ---- running a file's blocks in one namespace --------------------------------------------------
@dataclass
class FileRun:
    """One Markdown file's namespace: the blocks run so far, in order, and the first that failed."""
    blocks: list[Block]
    folder: Path
    namespace: dict = field(default_factory=lambda: {"__name__": "__main__"})
    done: int = 0
    failed: str | None = None

    def run_through(self, index: int) -> None:
        """Run the blocks up to `index` (those before it first, if not run yet); raise for `index`'s own failure."""
        while self.done <= index:
            block = self.blocks[self.done]
            self.done += 1
            if self.failed is not None:
                pytest.skip(f"{self.failed} failed; the blocks after it share its namespace")
            if block.skip_reason is not None:
                if self.done - 1 == index:
                    pytest.skip(f"{block.where}: {block.skip_reason}")
                continue
            try:
                self._run(block)
            except BaseException:
                self.failed = block.where
                raise
        if self.done == len(self.blocks):
            self.close()

    def _run(self, block: Block) -> None:
        # padded so that a traceback's line numbers are the Markdown file's
        code = compile("\n" * (block.line - 1) + block.code, str(block.path.relative_to(REPO)), "exec")
        cwd = os.getcwd()
        os.chdir(self.folder)
        try:
            if block.raises is None:
                exec(code, self.namespace)
                return
            try:
                exec(code, self.namespace)
            except Exception as err:
                names = {cls.__name__ for cls in type(err).__mro__} | {type(err).__qualname__}
                if block.raises.rsplit(".", 1)[-1] not in names:
                    raise AssertionError(f"{block.where}: marked `raises {block.raises}` but raised "
                                         f"{type(err).__name__}: {err}") from err
            else:
                raise AssertionError(f"{block.where}: marked `raises {block.raises}` but raised nothing")
        finally:
            os.chdir(cwd)

    def close(self) -> None:
        """Shut down the engines the file's blocks left in its namespace, then drop the namespace."""
        from toolkit.llm import LLM
        for value in list(self.namespace.values()):
            if isinstance(value, LLM):
                value.shutdown()
        self.namespace.clear()


_RUNS: dict[Path, FileRun] = {}


def _cases() -> list:
    cases = []
    for path in DOC_FILES:
        rel = str(path.relative_to(REPO))
        for i, block in enumerate(python_blocks(path)):
            marks = [pytest.mark.xdist_group(f"docs-{rel}"), pytest.mark.slow]
            cases.append(pytest.param(path, i, id=f"{rel}:{block.line}", marks=marks))
    return cases


@pytest.mark.parametrize(("path", "index"), _cases())
def test_code_block_runs(path: Path, index: int, tmp_path_factory):
    run = _RUNS.get(path)
    if run is None:
        folder = tmp_path_factory.mktemp(re.sub(r"\W+", "_", str(path.relative_to(REPO))))
        run = _RUNS[path] = FileRun(python_blocks(path), folder)
    run.run_through(index)


def test_a_planted_wrong_line_fails_its_block(tmp_path):
    """The runner above is not a no-op: a wrong line fails its block, and the traceback names the
    Markdown file and line; a block marked `raises` that raises nothing fails too."""
    doc = REPO / "docs" / "planted.md"        # never written: the blocks are made here
    run = FileRun([Block(doc, 3, "python", "x = 1\n", None),
                   Block(doc, 7, "python", "y = x + 1\nassert y == 3, 'planted'\n", None)], tmp_path)
    run.run_through(0)
    with pytest.raises(AssertionError, match="planted") as info:
        run.run_through(1)
    tb = info.value.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert (tb.tb_frame.f_code.co_filename, tb.tb_lineno) == ("docs/planted.md", 8)
    with pytest.raises(AssertionError, match="raised nothing"):
        FileRun([Block(doc, 3, "python", "pass\n", "raises ValueError")], tmp_path).run_through(0)


def test_every_marker_sits_right_before_a_python_block():
    problems = []
    for path in DOC_FILES:
        lines = path.read_text(encoding="utf-8").splitlines()
        inside = {n for b in fenced_blocks(path) for n in range(b.line - 1, b.line + b.code.count("\n") + 1)}
        for number, line in enumerate(lines, 1):
            m = MARKER.match(line)
            if m is None or number in inside:
                continue
            where = f"{path.relative_to(REPO)}:{number}"
            if not (SKIP.match(m["body"]) or RAISES.match(m["body"])):
                problems.append(f"{where}: unknown marker {m['body']!r} (use `skip (reason)` or `raises ErrorName`)")
                continue
            following = next((rest for rest in lines[number:] if rest.strip()), "")
            fence = FENCE.match(following)
            if fence is None or fence["lang"].lower() not in ("python", "py"):
                problems.append(f"{where}: the marker is not right before a ```python fence")
    assert not problems, "\n".join(problems)


# ---- the README and the site's navigation ---------------------------------------------------------
def test_readme_fits_on_two_screens():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move the rest into docs/"


def _mkdocs() -> dict:
    # mkdocs.yml uses no !!python tags, so the safe loader reads it
    return yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))


def _nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages.extend(_nav_pages(value) if isinstance(value, list) else [value])
    return pages


def test_every_nav_page_exists():
    missing = []
    for page in _nav_pages(_mkdocs()["nav"]):
        if page.startswith("tutorials/") and page.endswith(".ipynb"):
            source = REPO / "notebooks" / page.removeprefix("tutorials/")     # docs/_hooks/tutorials.py
        else:
            source = REPO / "docs" / page
        if not source.is_file():
            missing.append(f"{page} ({source.relative_to(REPO)})")
    assert not missing, missing


def test_the_tutorials_are_every_committed_notebook():
    nav = {p.removeprefix("tutorials/") for p in _nav_pages(_mkdocs()["nav"]) if p.endswith(".ipynb")}
    committed = {p.name for p in (REPO / "notebooks").glob("*.ipynb")}
    assert nav == committed, f"in the nav only: {sorted(nav - committed)}; not in the nav: {sorted(committed - nav)}"


def _hook():
    spec = importlib.util.spec_from_file_location("docs_tutorials_hook", REPO / "docs" / "_hooks" / "tutorials.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_rendered_tutorials_are_the_committed_notebooks():
    """The site renders each notebook from a copy that leaves out only the widget views that have a
    saved fallback (HTML or text) and the saved widget state; every cell, source and other output is
    the committed one, as nbval checked it."""
    hook = _hook()
    for path in sorted((REPO / "notebooks").glob("*.ipynb")):
        nb = json.loads(path.read_text(encoding="utf-8"))
        copy = hook.without_widget_views(nb)
        assert "widgets" not in copy["metadata"]
        assert len(copy["cells"]) == len(nb["cells"]), path.name
        for ours, theirs in zip(copy["cells"], nb["cells"]):
            assert ours["source"] == theirs["source"], path.name
            assert len(ours.get("outputs", [])) == len(theirs.get("outputs", [])), path.name
            for out, committed in zip(ours.get("outputs", []), theirs.get("outputs", [])):
                data = dict(committed.get("data", {}))
                if hook.WIDGET_VIEW in data and len(data) > 1:
                    del data[hook.WIDGET_VIEW]
                    assert set(data) & {"text/html", "text/plain"}, f"{path.name}: a widget view without a fallback"
                assert out.get("data", {}) == data and out.get("text") == committed.get("text"), path.name


def test_the_api_reference_covers_the_public_names():
    reference = "\n".join(p.read_text(encoding="utf-8") for p in (REPO / "docs" / "reference").glob("*.md"))
    for target in ["toolkit.llm.LLM", "toolkit.sampling.SamplingParams", "toolkit.outputs.RequestOutput",
                   "toolkit.inspect.step_record.StepRecord", "toolkit.inspect.trace.Trace",
                   "toolkit.widgets.inspector.StepInspector", "toolkit.inspect.compare_hf.compare_with_hf",
                   "toolkit.inspect.trace_diff.diff_traces", "toolkit.inspect.checks", "toolkit.inspect.faults"]:
        assert f"::: {target}\n" in reference, target


def test_the_checks_guide_names_every_check_and_fault():
    from toolkit.inspect import faults
    guide = (REPO / "docs" / "guides" / "checks-and-faults.md").read_text(encoding="utf-8")
    checks = set()
    for source in (REPO / "toolkit").rglob("*.py"):
        checks |= set(re.findall(r'Violation\(\s*"([a-z_]+)"', source.read_text(encoding="utf-8")))
    assert len(checks) > 15
    missing = [c for c in sorted(checks) if f"`{c}`" not in guide]
    missing += [f.name for f in faults.catalogue() if f"`{f.name}`" not in guide]
    assert not missing, f"not in docs/guides/checks-and-faults.md: {missing}"


def test_the_readme_links_to_files_that_exist():
    """README.md is read on the code host, outside the site's link check: its relative links must resolve."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = [t for t in targets if "://" not in t and not (REPO / t).exists()]
    assert targets and not missing, missing
