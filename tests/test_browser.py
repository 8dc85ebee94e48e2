"""StepInspector in a real browser (Debian's chromium, driven by Playwright), two ways:

- live in JupyterLab: run tests/notebooks/inspector_browser.ipynb, click Step twice, open Metadata
  and check that it shows the seq_lens_cpu_upper_bound / query_start_loc the runner used (the
  notebook's last cell, run again after the clicks, prints them); then pick a Mamba layer in the
  State view and wait for its heatmaps; then plant a fault (the next step raises a RuntimeError,
  as a bug would), click Step and find the error, and its traceback behind a toggle, in the
  inspector's status line; the Step after it runs; last (the notebook's engine caches prefixes),
  type a 20-token prompt into the request box, Run to end, add it again, Step, and find in the
  Prefix cache tab the second request's hit of 16 tokens: its one block chip marked hit and
  checkpointed, the reason, where its state came from and what the cache holds now; then
  `speculate()` switches the inspector to demo-hybrid with n-gram drafts and prefix caching: a
  repetitive prompt, Step to its first verify step, and the Speculation tab draws the verify row's
  drafts against the target's tokens; Step on until a verify row saves a block's checkpoint, which
  the tab names;
- the notebook exported by nbconvert (widget state stored, widget JS from the local npm install),
  opened from file:// with every other request aborted: the rendered widget shows the Metadata tab.

Needs chromium and .browser/node_modules: scripts/setup_browser_test.sh installs them (`make test`
runs it first). Without them these tests fail, saying so; they are not skipped. Screenshots go to
the test's tmp_path, and the main ones (the State view, the planted fault, the export) to
tests/output/ (git-ignored).
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

import browser_support as B

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

OUTPUT = Path(__file__).resolve().parent / "output"
VIEWPORT = {"width": 1400, "height": 1800}
PREFIX_PROMPT = ", ".join(str(t) for t in range(5, 25))     # 20 token ids: one full block of 16


def _tools() -> str:
    """chromium's path; without the tools the test fails (not skips), naming the setup script."""
    try:
        return B.browser_tools()
    except B.MissingBrowserTools as err:
        missing = str(err)
    pytest.fail(missing, pytrace=False)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab serving a tmp folder holding a copy of the test notebook; ended after the module
    (also when a test failed)."""
    root = tmp_path_factory.mktemp("lab_root")
    B.prepare_notebook(root)
    server = B.JupyterLab(root, tmp_path_factory.mktemp("lab_state"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _keep(shot: Path, name: str) -> None:
    OUTPUT.mkdir(exist_ok=True)
    shutil.copyfile(shot, OUTPUT / name)


def _forget(name: str) -> None:
    """Drop a screenshot a previous run left in tests/output (e.g. of a failure since fixed)."""
    (OUTPUT / name).unlink(missing_ok=True)


def _values_as_text(values: list) -> str:
    return str(values)             # how the Metadata view previews a short int list: "[3, 12]"


# demo-hybrid's token ids of "for i in range(10):\n    print(i)\n" three times, cut after the third
# line's indent: greedy decoding goes on with spaces and `print`, which prompt lookup proposes
SPEC_PROMPT = ("1, 105, 114, 117, 35, 108, 35, 108, 113, 35, 117, 100, 113, 106, 104, 43, 52, 51, 44, 61, 13, 35, "
               "35, 35, 35, 115, 117, 108, 113, 119, 43, 108, 44, 13, 105, 114, 117, 35, 108, 35, 108, 113, 35, 117, "
               "100, 113, 106, 104, 43, 52, 51, 44, 61, 13, 35, 35, 35, 35, 115, 117, 108, 113, 119, 43, 108, 44, 13, "
               "105, 114, 117, 35, 108, 35, 108, 113, 35, 117, 100, 113, 106, 104, 43, 52, 51, 44, 61, 13, 35, 35, 35")


def test_inspector_live_in_jupyterlab(lab, tmp_path):
    chromium = _tools()
    _forget("test_browser_lab_failure.png")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = B.launch_chromium(p, chromium)
        page = browser.new_page(viewport=VIEWPORT)
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        nb = B.LabNotebook(page, lab, "inspector.ipynb")
        try:
            nb.open()
            nb.run_all()
            page.screenshot(path=tmp_path / "lab_1_ran_all.png")
            start = nb.position_text()
            assert re.match(r"record \d+/\d+: warmup/", start), start   # warmed up, nothing stepped yet

            labels = [nb.click_step(), nb.click_step()]
            assert [re.search(r"step (\d+) \(by step\(\)\)", t) is not None for t in labels] == [True, True], labels

            panel = nb.open_tab("Metadata")
            nb.wait_text(panel, "seq_lens_cpu_upper_bound")
            # what the runner used, printed by the notebook's last cell run after the clicks
            ran = B.runner_values(nb.rerun_cell(-1))
            m = re.match(r"record (\d+)/(\d+): step (\d+)", labels[-1])
            assert (ran["record"] + 1, ran["step_index"]) == (int(m.group(1)), int(m.group(3))), (ran, labels)
            assert ran["seq_lens_cpu_upper_bound"] and ran["query_start_loc"], ran

            tables = B.metadata_tables(panel)
            bound = _values_as_text(ran["seq_lens_cpu_upper_bound"])
            qsl = _values_as_text(ran["query_start_loc"])
            assert B.metadata_values(tables, "Mamba", "seq_lens_cpu_upper_bound") == [bound], tables
            assert B.metadata_values(tables, "Mamba", "query_start_loc") == [qsl], tables
            assert B.metadata_values(tables, "Mamba", "query_start_loc_cpu") == [qsl], tables
            html = panel.inner_html()
            assert bound in html and qsl in html
            nb.inspector.screenshot(path=tmp_path / "lab_2_metadata.png")

            panel = nb.open_tab("State")
            layer = nb.pick_state_layer(panel, prefer="mamba")
            assert "mamba" in layer
            heatmaps = B.loaded_images(panel.locator(":scope > .widget-vbox").first)
            assert heatmaps, "no heatmap <img> in the State view"
            final = tmp_path / "lab_3_state.png"
            nb.inspector.screenshot(path=final)
            _keep(final, "test_browser_lab_state.png")

            # a planted bug: the next step raises a plain RuntimeError; Step shows it in the status line
            assert nb.run_code("plant_fault()") == ""
            before = nb.position_text()
            nb.click_button("Step")
            nb.wait_text(nb.status_line, "RuntimeError: planted fault: the runner raised")
            assert "raised by Step" in nb.status_line.inner_text()
            assert nb.position_text() == before                  # no step was recorded
            nb.status_line.locator("summary", has_text="traceback").click()
            nb.wait_text(nb.status_line, "Traceback (most recent call last)")
            assert "in execute_model" in nb.status_line.locator("pre").inner_text()
            fault = tmp_path / "lab_4_fault.png"
            nb.inspector.screenshot(path=fault)
            _keep(fault, "test_browser_lab_fault.png")
            after = nb.click_step()                              # the engine still serves
            assert re.search(r"step \d+ \(by step\(\)\)", after) and after != before, after
            assert nb.status_line.inner_text().strip() == ""

            # prefix caching: a prompt served twice; the step admitting the second shows its hit
            first = nb.add_request(PREFIX_PROMPT)
            nb.click_and_follow("Run to end")
            assert "no request left" in nb.status_line.inner_text(), nb.status_line.inner_text()
            second = nb.add_request(PREFIX_PROMPT)
            rid = re.search(r"added request '([^']+)'", second).group(1)
            assert rid not in first, (first, second)
            nb.click_step()
            panel = nb.open_tab("Prefix cache")
            nb.wait_text(panel, f"request '{rid}': 20 tokens")
            text = panel.inner_text()
            assert "hit 16 of 20 tokens: every full block before the last token is cached" in text, text[:2000]
            assert panel.locator(".pc-block").count() == 1
            chip = panel.locator(".pc-block.pc-hit.pc-checkpoint")
            assert chip.count() == 1 and chip.get_attribute("title").startswith("block 0: tokens [0, 16)")
            assert "(the checkpoint after 16 tokens, its prefix hit) -> page" in text, text[:2000]
            assert "below, what the prefix cache holds now" in text and "eviction rank" in text
            shot = tmp_path / "lab_5_prefix_cache.png"
            nb.inspector.screenshot(path=shot)
            _keep(shot, "test_browser_lab_prefix_cache.png")

            # speculative decoding: the inspector switches to an engine with n-gram drafts; a repetitive
            # prompt's first decode verifies drafts, and the Speculation tab draws them against the target
            assert nb.run_code("speculate()") == ""
            nb.wait_text(nb.status_line, "now showing LLM('demo-hybrid'")
            nb.add_request(SPEC_PROMPT)
            for _ in range(4):          # the prefill (two chunks: prefix caching ends one on a block boundary)
                nb.click_step()
                panel = nb.open_tab("Speculation")
                if "Verify rows of this step (1)" in panel.inner_text():     # the first verify step
                    break
            nb.wait_text(panel, "Verify rows of this step (1)")
            text = panel.inner_text()
            m = re.search(r"request '(\w+)': (\d+) drafts?, (\d+) accepted", text)
            assert m and int(m.group(2)) >= 1, text[:2000]
            drafts, accepted = int(m.group(2)), int(m.group(3))
            assert panel.locator(".sd-pos").count() == 1 + drafts
            assert panel.locator(".sd-pos.sd-accepted").count() == accepted
            assert panel.locator(".sd-pos.sd-input").count() == 1
            assert "the next step starts from column" in text
            # a verify row whose kept tokens reach a block boundary says which column became the checkpoint
            for _ in range(6):
                if "checkpoint: the row reached token" in panel.inner_text():
                    break
                nb.click_step()
                panel = nb.open_tab("Speculation")
            nb.wait_text(panel, "checkpoint: the row reached token")
            assert "the checkpoint later requests may hit" in panel.inner_text()
            shot = tmp_path / "lab_6_speculation.png"
            nb.inspector.screenshot(path=shot)
            _keep(shot, "test_browser_lab_speculation.png")
            assert not errors, errors
        except Exception:
            page.screenshot(path=tmp_path / "lab_failure.png")
            _keep(tmp_path / "lab_failure.png", "test_browser_lab_failure.png")
            print("page errors:", errors, "\njupyter lab log:\n", lab.log_tail())
            raise
        finally:
            browser.close()


def test_exported_html_renders_the_metadata_view_offline(tmp_path):
    """The notebook run by nbconvert (it steps twice and selects the Metadata tab itself when
    INSPECTOR_NOTEBOOK_HEADLESS=1, as nobody clicks there), opened without a network."""
    chromium = _tools()
    _forget("test_browser_export_failure.png")
    from playwright.sync_api import sync_playwright

    notebook = B.prepare_notebook(tmp_path)
    html_path = B.export_html(notebook, tmp_path)
    source = html_path.read_text()
    assert B.WIDGET_JS.as_uri() in source and B.REQUIRE_JS.as_uri() in source
    assert "application/vnd.jupyter.widget-state+json" in source

    with sync_playwright() as p:
        browser = B.launch_chromium(p, chromium)
        context = browser.new_context(viewport=VIEWPORT)
        blocked: list[str] = []
        B.block_network(context, blocked)
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.set_default_timeout(60_000)
        try:
            page.goto(html_path.as_uri())
            # the tab bar exists only once the widget manager rendered the stored state
            tab = page.locator(".widget-tab:visible").first
            tab.wait_for()
            current = tab.locator("li.lm-TabBar-tab.lm-mod-current")
            assert current.inner_text().strip() == "Metadata"
            panel = tab.locator(":scope > .widget-tab-contents > .widget-box").nth(B.TABS.index("Metadata"))
            assert panel.is_visible()
            text = panel.inner_text()
            assert "seq_lens_cpu_upper_bound" in text and "query_start_loc" in text, text[:2000]

            printed = page.locator(".jp-OutputArea-output:visible", has_text="RUNNER_VALUES").first.inner_text()
            ran = B.runner_values(printed)
            assert ran["stage"] == "step" and ran["step_index"] == 1, ran
            tables = B.metadata_tables(panel)
            assert B.metadata_values(tables, "Mamba", "seq_lens_cpu_upper_bound") == \
                [_values_as_text(ran["seq_lens_cpu_upper_bound"])], tables
            assert B.metadata_values(tables, "Mamba", "query_start_loc") == \
                [_values_as_text(ran["query_start_loc"])], tables
            final = tmp_path / "export_metadata.png"
            tab.screenshot(path=final)
            _keep(final, "test_browser_export_metadata.png")
            assert not any("html-manager" in u or "require" in u for u in blocked), blocked
            assert not errors, errors
        except Exception:
            page.screenshot(path=tmp_path / "export_failure.png", full_page=True)
            _keep(tmp_path / "export_failure.png", "test_browser_export_failure.png")
            print("page errors:", errors, "\nblocked requests:", blocked)
            raise
        finally:
            browser.close()
