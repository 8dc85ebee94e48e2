"""MkDocs hook: the committed notebooks (notebooks/*.ipynb) become the site's tutorials/ pages.

mkdocs-jupyter renders each from a copy that differs from the committed notebook in one way only:
the widget views (`application/vnd.jupyter.widget-view+json`) and the saved widget state are left out,
so every widget output is shown by the HTML or text fallback saved beside it (the StepInspector saves a
static HTML summary of its step), and the page loads no widget manager from the network. Cells, their
sources and every other output are the committed ones (tests/test_docs.py checks it).
"""
from __future__ import annotations

import json
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def without_widget_views(nb: dict) -> dict:
    """The notebook with its widget views and saved widget state left out (nothing else changes)."""
    nb = json.loads(json.dumps(nb))
    nb.get("metadata", {}).pop("widgets", None)
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []):
            data = out.get("data")
            if data and WIDGET_VIEW in data and len(data) > 1:
                del data[WIDGET_VIEW]
    return nb


@event_priority(100)      # before mkdocs-jupyter's on_files, which turns .ipynb files into pages
def on_files(files: Files, config) -> Files:
    # a source folder of their own (not File.generated: mkdocs-jupyter's page wrapper reads the
    # source path from src_dir, which a generated file does not have)
    src_dir = REPO / ".cache" / "docs-tutorials"
    (src_dir / "tutorials").mkdir(parents=True, exist_ok=True)
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        copy = src_dir / "tutorials" / path.name
        text = json.dumps(without_widget_views(json.loads(path.read_text(encoding="utf-8"))), indent=1)
        if not copy.exists() or copy.read_text(encoding="utf-8") != text:
            copy.write_text(text, encoding="utf-8")
        files.append(File(f"tutorials/{path.name}", str(src_dir), config["site_dir"], config["use_directory_urls"]))
    return files
