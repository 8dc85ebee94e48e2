"""The one place that styles HTML: palette, inline styles and the building blocks every view uses
(record views, compare_with_hf / diff_traces reports, the fault catalogue, the memory ledger and
the widgets).

Rules, and why:
- The HTML must read the same in JupyterLab (light or dark theme), VS Code (which paints outputs
  on white whatever its theme) and nbconvert exports, so every element carries explicit light
  colours and a background; nothing inherits the notebook theme's.
- Inline styles only: no <style> block, no external CSS, no links, no <script>. Outputs are
  sanitised or sandboxed differently by each front end (and exports open offline), so only what
  sits on the element itself survives everywhere.
- Text is escaped here (`escape`, `span`, `title`, headers of `table`); table cells are HTML
  already, built with these helpers by the caller.
"""
from __future__ import annotations

import base64
import html
import traceback
from collections.abc import Collection, Sequence
from typing import Any

# ---- palette -------------------------------------------------------------------------------------
FG, BG, LINE, HEAD_BG = "#1f2328", "#ffffff", "#d0d7de", "#f6f8fa"
ROW_LINE = "#eaeef2"
BAD_FG, BAD_BG, BAD_LINE, RED = "#82071e", "#ffebe9", "#ffcecb", "#cf222e"
GOOD_FG, GOOD_BG, GOOD_LINE, GREEN = "#116329", "#dafbe1", "#aceebb", "#1a7f37"
AMBER = "#9a6700"
FONT = "-apple-system,BlinkMacSystemFont,'Segoe UI',Helvetica,Arial,sans-serif"

# ---- styles (inline only; see the module docstring) ----------------------------------------------
MONO = "font-family:SFMono-Regular,Menlo,Consolas,'Liberation Mono',monospace"
WRAP = (f"background:{BG};color:{FG};font-family:{FONT};font-size:12px;line-height:1.45;"
        f"padding:6px 10px;border:1px solid {LINE};border-radius:6px;text-align:left;"
        "max-width:100%;overflow-x:auto;box-sizing:border-box")
TABLE = (f"border-collapse:collapse;margin:4px 0 8px 0;background:{BG};color:{FG};"
         f"table-layout:auto;font-size:12px;width:auto;{MONO}")
TH = (f"text-align:left;padding:2px 8px;border-bottom:1px solid {LINE};"
      f"background:{HEAD_BG};color:{FG};font-weight:600;white-space:nowrap")
TR = f"background:{BG};color:{FG};border-bottom:1px solid {ROW_LINE}"
TR_BAD = f"background:{BAD_BG};color:{BAD_FG};border-bottom:1px solid {BAD_LINE}"
TD = "text-align:left;padding:1px 8px"      # per cell: JupyterLab right-aligns and pads cells
TD_RIGHT = "text-align:right;padding:1px 8px"
MUTED = "color:#8c959f;font-style:italic"
SOFT = "color:#57606a"
ALERT = f"color:{RED};font-weight:600"
GOOD = f"color:{GREEN}"
CHANGED = f"color:{AMBER};font-weight:600"
TITLE = f"font-weight:600;color:{FG};margin:6px 0 2px 0"
HEADER = f"font-size:13px;font-weight:600;color:{FG}"
SUMMARY = f"cursor:pointer;font-weight:600;color:{FG};margin:6px 0 2px 0"
VIOLATION = (f"background:{BAD_BG};color:{BAD_FG};border-left:3px solid {RED};padding:3px 8px;"
             f"margin:2px 0;{MONO}")
PRE = (f"background:{HEAD_BG};color:{FG};border:1px solid {ROW_LINE};padding:4px 8px;margin:2px 0;"
       f"white-space:pre;overflow:auto;max-height:24em;font-size:11px;{MONO}")
VERDICT_OK = (f"background:{GOOD_BG};color:{GOOD_FG};border:1px solid {GOOD_LINE};font-weight:600;"
              "padding:2px 8px;margin:2px 0 4px 0;border-radius:4px")
# a block of a prompt's hash chain (the Prefix cache tab): one chip per block, coloured by its state
CHIP = ("display:inline-block;min-width:30px;padding:1px 3px;margin:1px;border-radius:3px;"
        f"text-align:center;font-size:10px;line-height:1.25;vertical-align:top;{MONO}")
CHIP_STATES = {
    "hit": f"background:{GOOD_BG};color:{GOOD_FG};border:1px solid {GREEN}",
    "cached": f"background:#fff8c5;color:{AMBER};border:1px solid #d4a72c",
    "missing": f"background:{BG};color:{FG};border:1px solid {LINE}",
    "capped": f"background:{HEAD_BG};color:#8c959f;border:1px dashed {LINE}",
}
# a position of a verify row (the Speculation tab): its input draft accepted, rejected, unchecked
SPEC_CHIP_STATES = {
    "input": CHIP_STATES["missing"],
    "accepted": CHIP_STATES["hit"],
    "rejected": f"background:{BAD_BG};color:{BAD_FG};border:1px solid {RED}",
    "unchecked": CHIP_STATES["capped"],
}
JUNCTION = (f"display:inline-block;padding:1px 3px;margin:1px;border-left:3px solid #0969da;color:#0969da;"
            f"font-size:10px;font-weight:600;vertical-align:top;{MONO}")
CHIP_ROW = "display:flex;flex-wrap:wrap;align-items:flex-start;margin:2px 0 4px 0"
VERDICT_BAD = (f"background:{BAD_BG};color:{BAD_FG};border:1px solid {BAD_LINE};font-weight:600;"
               "padding:2px 8px;margin:2px 0 4px 0;border-radius:4px")


# ---- building blocks -----------------------------------------------------------------------------
def escape(s: Any) -> str:
    return html.escape(str(s), quote=True)


def span(text: str, style: str) -> str:
    return f'<span style="{style}">{escape(text)}</span>'


def div(text: str, style: str) -> str:
    return f'<div style="{style}">{escape(text)}</div>'


def title(text: str, style: str = TITLE) -> str:
    return div(text, style)


def verdict(text: str, ok: bool) -> str:
    """A one-line outcome on a green (ok) or red background: "no divergence", "traces part"."""
    return div(text, VERDICT_OK if ok else VERDICT_BAD)


def chip(lines: Sequence[str], style: str, hover: str, cls: str) -> str:
    """A small labelled box (one line per entry of `lines`, escaped) with a tooltip (`hover`) and a
    class naming what it stands for (tests and browser tests find it by that class; no styling)."""
    body = "<br>".join(escape(line) for line in lines)
    return f'<span class="{escape(cls)}" title="{escape(hover)}" style="{style}">{body}</span>'


def muted_none() -> str:
    return span("None", MUTED)


def note(text: str) -> str:
    """A view with nothing to show: one muted sentence saying why, framed like any view."""
    return wrap(span(text, MUTED))


def table(headers: Sequence[str] | None, rows: Sequence[Sequence[str]], bad_rows: Collection[int] = (),
          right: Collection[int] = ()) -> str:
    """Cells are HTML already; headers are escaped here (None: no header row). Rows in `bad_rows`
    are highlighted red; columns in `right` are right-aligned (numbers). Colours sit on the rows
    (they override JupyterLab's striped/hover row backgrounds); alignment and padding on the cells."""
    head = ""
    if headers is not None:
        cells = "".join(f'<th style="{TH}">{escape(h)}</th>' for h in headers)
        head = f"<thead><tr>{cells}</tr></thead>"
    body = "".join(f'<tr style="{TR_BAD if i in bad_rows else TR}">'
                   + "".join(f'<td style="{TD_RIGHT if j in right else TD}">{c}</td>' for j, c in enumerate(row))
                   + "</tr>" for i, row in enumerate(rows))
    return f'<table style="{TABLE}">{head}<tbody>{body}</tbody></table>'


def section(summary: str, body: str, open_: bool = True) -> str:
    """A collapsible block; <details> needs no script and works in JupyterLab, VS Code and exports."""
    return (f'<details{" open" if open_ else ""} style="margin:4px 0">'
            f'<summary style="{SUMMARY}">{escape(summary)}</summary>{body}</details>')


def pre(text: str) -> str:
    """Preformatted text (a traceback), escaped; long text scrolls inside the block."""
    return f'<pre style="{PRE}">{escape(text)}</pre>'


def exception(err: BaseException, context: str) -> str:
    """An exception in a status line, framed: its type and message in red, `context` (who raised
    it, what state things are left in) below, and its traceback in a closed `section`."""
    tb = "".join(traceback.format_exception(err))
    return wrap(div(f"{type(err).__name__}: {err}", ALERT) + div(context, SOFT)
                + section("traceback", pre(tb), open_=False))


def wrap(body: str) -> str:
    """The frame every standalone view sits in (white background, dark text)."""
    return f'<div style="{WRAP}">{body}</div>'


def img(png: bytes, alt: str) -> str:
    """A PNG inlined as a data URI (no file, no link). Callers with no picture show a `note`."""
    if not png:
        raise ValueError(f"img({alt!r}): no PNG data; say why there is no picture instead")
    return f'<img alt="{escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}"/>'
