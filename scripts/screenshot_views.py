"""Screenshots of the StepInspector's eight views in JupyterLab, for the README:

    .venv/bin/python scripts/screenshot_views.py [--model tiny-bamba] [--out docs/images]

writes inspector_{batch,metadata,blocks,state,timeline,warmup,prefix_cache,speculation}.png (each at
most --max-kb, 200 KB by default: larger shots are stored with a 256-colour palette). It runs
tests/notebooks/inspector_browser.ipynb on `--model` in a throwaway JupyterLab, clicks Step twice
(step 1: a chunked prefill next to a fresh one), shows Batch, Metadata, Blocks and
State (a Mamba layer, request '0', whose state carries over from step 0), then clicks Run to end
and shows Timeline and Warmup; then serves one prompt twice (the notebook's engine caches prefixes)
and shows the Prefix cache tab at the step that admitted the second; last, switches the inspector
to demo-hybrid with n-gram drafts and prefix caching (the notebook's speculate()), adds a repetitive
prompt, steps to the verify step whose row saves a block's checkpoint and shows the Speculation tab.
Needs what
scripts/setup_browser_test.sh installs.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import browser_support as B  # noqa: E402

SHOTS = [  # (file stem, tab, text the drawn view contains)
    ("batch", "Batch", "StepRecord"),
    ("metadata", "Metadata", "query_start_loc"),
    ("blocks", "Blocks", "holdings after the step"),
    ("state", "State", None),
    ("timeline", "Timeline", None),
    ("warmup", "Warmup", "memory ledger"),
    ("prefix_cache", "Prefix cache", "hit 16 of 20 tokens"),
    ("speculation", "Speculation", "checkpoint: the row reached token"),
]
PREFIX_PROMPT = ", ".join(str(t) for t in range(40, 60))     # 20 token ids: one full block of 16 to hit
from test_browser import SPEC_PROMPT  # noqa: E402  (demo-hybrid token ids whose decode verifies drafts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-bamba", help="preset or HF folder (default: tiny-bamba)")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "images")
    ap.add_argument("--max-kb", type=int, default=200)
    ap.add_argument("--width", type=int, default=1200, help="browser window width (CSS px)")
    args = ap.parse_args(argv)
    try:
        chromium = B.browser_tools()
    except B.MissingBrowserTools as err:
        print(err, file=sys.stderr)
        return 1
    from playwright.sync_api import sync_playwright

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="inspector_shots_") as tmp:
        root = Path(tmp) / "root"
        root.mkdir()
        B.prepare_notebook(root, model=args.model)
        with B.JupyterLab(root, Path(tmp) / "lab") as lab, sync_playwright() as p:
            browser = B.launch_chromium(p, chromium)
            page = browser.new_page(viewport={"width": args.width, "height": 2400})
            nb = B.LabNotebook(page, lab, "inspector.ipynb", timeout_ms=120_000)
            try:
                nb.open()
                page.keyboard.press("Escape")
                page.keyboard.press("Control+b")           # hide the file browser: the notebook gets the width
                nb.run_all()
                nb.click_step()
                nb.click_step()
                for stem, tab, ready in SHOTS:
                    if stem == "timeline":
                        nb.click_and_follow("Run to end")
                    if stem == "prefix_cache":
                        nb.add_request(PREFIX_PROMPT)
                        nb.click_and_follow("Run to end")
                        nb.add_request(PREFIX_PROMPT)
                        nb.click_step()
                    if stem == "speculation":                  # the notebook's speculate(): n-gram drafts
                        nb.run_code("speculate()")
                        nb.wait_text(nb.status_line, "now showing")
                        nb.add_request(SPEC_PROMPT)
                        for _ in range(8):           # to the verify step whose row saves a checkpoint
                            nb.click_step()
                            if "checkpoint: the row reached token" in nb.open_tab(tab).inner_text():
                                break
                    panel = nb.open_tab(tab)
                    if stem == "state":
                        nb.pick_state_layer(panel, prefer="mamba")
                        requests = nb.state_dropdown(panel, "request").evaluate(
                            "e => [...e.options].map(o => o.value)")
                        if "0" in requests:
                            nb.pick_state_request(panel, "0")
                    elif stem in ("timeline", "blocks"):
                        page.wait_for_function(
                            "el => [...el.querySelectorAll('img')].some(i => i.complete && i.naturalWidth > 0)",
                            arg=panel.element_handle())
                    if ready:
                        nb.wait_text(panel, ready)
                    page.wait_for_timeout(300)                 # let the layout settle
                    path = B.save_png(args.out / f"inspector_{stem}.png", nb.inspector.screenshot(),
                                      max_bytes=args.max_kb * 1024)
                    print(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}: "
                          f"{path.stat().st_size // 1024} KB")
            except Exception:
                fail = args.out / "screenshot_failure.png"
                page.screenshot(path=fail)
                print(f"failed; the page is in {fail}\n{lab.log_tail()}", file=sys.stderr)
                raise
            finally:
                browser.close()
    print(f"done in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
