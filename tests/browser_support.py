"""Helpers for the browser tests (tests/test_browser.py) and scripts/screenshot_views.py:
a throwaway JupyterLab server, Playwright on Debian's `chromium`, StepInspector actions in Lab,
and the notebook exported by nbconvert with the widget JS taken from a local npm install.

What they need and scripts/setup_browser_test.sh installs: `chromium` on PATH and
.browser/node_modules/{@jupyter-widgets/html-manager,requirejs}; `browser_tools()` says which is
missing. Facts these helpers rely on: JupyterLab refuses to run as root without --allow-root;
its news toast is switched off through a user-settings override; Lab keeps hidden duplicate
panels (hence `:visible` locators); nbconvert's HTML loads the widget manager from a CDN unless
pointed at local files, which is what lets the exported page render offline.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "tests" / "notebooks" / "inspector_browser.ipynb"
NODE_MODULES = Path(os.environ.get("BROWSER_NODE_MODULES", REPO / ".browser" / "node_modules"))
WIDGET_JS = NODE_MODULES / "@jupyter-widgets" / "html-manager" / "dist" / "embed-amd.js"
REQUIRE_JS = NODE_MODULES / "requirejs" / "require.js"
SETUP = "scripts/setup_browser_test.sh"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
# the kernel of a notebook: CPU Triton and no hub access, as in tests/conftest.py
KERNEL_ENV = {"TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
TABS = ("Batch", "Metadata", "Blocks", "State", "Timeline", "Warmup", "Prefix cache", "Speculation")


class MissingBrowserTools(RuntimeError):
    pass


def browser_tools() -> str:
    """The chromium executable; raises MissingBrowserTools naming what is missing and how to get it."""
    missing = []
    chromium = shutil.which("chromium")
    if chromium is None:
        missing.append("Debian's `chromium` (not on PATH)")
    for path in (WIDGET_JS, REQUIRE_JS):
        if not path.is_file():
            missing.append(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path} (npm)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("the `playwright` Python package (pip install -e '.[dev]')")
    if missing:
        raise MissingBrowserTools("browser tests need " + "; ".join(missing) +
                                  f": run {SETUP} (`make test` runs it first)")
    return chromium


def prepare_notebook(dest_dir: Path, model: str | None = None, name: str = "inspector.ipynb") -> Path:
    """Copy the test notebook into `dest_dir` (outputs cleared), with another model if given."""
    nb = json.loads(NOTEBOOK.read_text())
    if model is not None:
        for cell in nb["cells"]:
            cell["source"] = [line.replace('LLM("tiny-bamba"', f"LLM({json.dumps(model)}")
                              for line in cell["source"]]
    dest = Path(dest_dir) / name
    dest.write_text(json.dumps(nb, indent=1))
    return dest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterLab:
    """`jupyter lab` on 127.0.0.1 and a free port, as root too (--allow-root), with its own
    config/data/runtime/settings/workspaces dirs under `work_dir`, a random token and the news
    toast off. Use as a context manager; `stop()` also ends it when the caller failed."""

    def __init__(self, root_dir: Path, work_dir: Path, env: dict | None = None, startup_timeout: float = 90):
        self.root_dir, self.work_dir = Path(root_dir), Path(work_dir)
        self.extra_env = dict(env or {})
        self.startup_timeout = startup_timeout
        self.token = secrets.token_hex(16)
        self.port = None
        self.proc: subprocess.Popen | None = None
        self.log_path = self.work_dir / "jupyterlab.log"

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> JupyterLab:
        dirs = {k: self.work_dir / k for k in ("config", "data", "runtime", "settings", "workspaces", "ipython")}
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        # user settings: no "get Jupyter news?" toast, no update check (env.md: --LabApp.news_url=None does not)
        notif = dirs["settings"] / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
        notif.parent.mkdir(parents=True, exist_ok=True)
        notif.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
        env = dict(os.environ, JUPYTER_CONFIG_DIR=str(dirs["config"]), JUPYTER_DATA_DIR=str(dirs["data"]),
                   JUPYTER_RUNTIME_DIR=str(dirs["runtime"]), IPYTHONDIR=str(dirs["ipython"]),
                   JUPYTER_PLATFORM_DIRS="1", **KERNEL_ENV)
        env.update(self.extra_env)
        self.port = free_port()
        cmd = [sys.executable, "-m", "jupyterlab", "--allow-root", "--ServerApp.open_browser=False",
               "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root_dir}",
               f"--LabApp.user_settings_dir={dirs['settings']}",
               f"--LabApp.workspaces_dir={dirs['workspaces']}"]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=self.root_dir, env=env, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with self.api("GET", "/api/status", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.25)
        raise TimeoutError(f"jupyter lab did not answer within {self.startup_timeout}s:\n{self.log_tail()}")

    def stop(self) -> None:
        """Ask the server to shut down (it ends its kernels), then end its process group:
        SIGTERM, wait, SIGKILL."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self.api("POST", "/api/shutdown", timeout=5).close()
                self.proc.wait(timeout=15)
            except Exception:
                pass
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
        try:  # anything left in the group (it shares the server's session)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()
        self.proc = None

    def __enter__(self) -> JupyterLab:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- access -----------------------------------------------------------------------------------
    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api(self, method: str, path: str, timeout: float = 5):
        req = urllib.request.Request(self.base + path, method=method,
                                     headers={"Authorization": f"token {self.token}"})
        return urllib.request.urlopen(req, timeout=timeout)

    def notebook_url(self, name: str, workspace: str = "browser-test") -> str:
        """The notebook alone in a fresh workspace (`reset`: no restored tabs)."""
        return f"{self.base}/lab/workspaces/{workspace}/tree/{name}?reset&token={self.token}"

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def launch_chromium(playwright, chromium: str | None = None):
    """Debian's chromium through Playwright (no Playwright browser download)."""
    return playwright.chromium.launch(executable_path=chromium or browser_tools(), headless=True,
                                      args=CHROMIUM_ARGS)


# ---- the StepInspector in JupyterLab ------------------------------------------------------------
class LabNotebook:
    """One notebook open in Lab, driven like a user: menus, buttons, tabs, dropdowns. Every locator
    is `:visible`, because Lab keeps hidden duplicate panels."""

    def __init__(self, page, lab: JupyterLab, name: str, timeout_ms: float = 60_000):
        self.page, self.lab, self.name = page, lab, name
        self.timeout = timeout_ms
        page.set_default_timeout(timeout_ms)

    def open(self) -> LabNotebook:
        self.page.goto(self.lab.notebook_url(self.name))
        self.page.locator(".jp-NotebookPanel:visible .jp-Cell").first.wait_for()
        self.wait_kernel_idle()
        return self

    @property
    def panel(self):
        return self.page.locator(".jp-NotebookPanel:visible").first

    def wait_kernel_idle(self, timeout_ms: float | None = None) -> None:
        """A kernel is connected and idle: the status bar reads "<kernel name> | Idle" (before the
        kernel connects it reads "No Kernel | ..." and the toolbar indicator already says idle)."""
        timeout = timeout_ms or self.timeout
        self.page.locator(".jp-StatusBar-TextItem:visible",
                          has_text=re.compile(r"^(?!No Kernel).+ \| Idle$")).first.wait_for(timeout=timeout)
        self.page.locator(".jp-NotebookPanel:visible .jp-Notebook-ExecutionIndicator[data-status='idle']") \
            .first.wait_for(timeout=timeout)

    def run_all(self) -> None:
        """Run > Run All Cells, then wait until no cell is queued or running and the kernel is idle."""
        self.page.get_by_role("menuitem", name="Run", exact=True).click()
        self.page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
        self.wait_cells_done()

    def wait_cells_done(self) -> None:
        self.page.wait_for_function(
            """() => {
                const panel = [...document.querySelectorAll('.jp-NotebookPanel')].find(p => p.offsetParent);
                if (!panel) return false;
                const prompts = [...panel.querySelectorAll('.jp-Cell.jp-CodeCell .jp-InputPrompt')];
                return prompts.length && prompts.every(p => /\\[\\d+\\]/.test(p.textContent));
            }""", timeout=self.timeout)
        self.wait_kernel_idle()

    def code_cell(self, index: int):
        return self.panel.locator(".jp-Cell.jp-CodeCell").nth(index)

    def rerun_cell(self, index: int) -> str:
        """Run one code cell again (select it, Ctrl+Enter: run, stay on it, add no cell); returns
        its output text. A negative index counts from the end, as in Python."""
        if index < 0:
            index += self.panel.locator(".jp-Cell.jp-CodeCell").count()
        cell = self.code_cell(index)
        cell.locator(".jp-InputPrompt").click()          # select the cell (command mode)
        self.page.keyboard.press("Escape")
        return self._run_selected(cell)

    def run_code(self, code: str) -> str:
        """Add a code cell below the last one, type `code` into it and run it, as a user would;
        returns its output text ("" if none)."""
        cells = self.panel.locator(".jp-Cell.jp-CodeCell")
        count = cells.count()
        cells.nth(count - 1).locator(".jp-InputPrompt").click()
        self.page.keyboard.press("Escape")
        self.page.keyboard.press("b")                    # a new cell below, selected (command mode)
        cell = cells.nth(count)
        editor = cell.locator(".cm-content")
        editor.click()
        self.page.keyboard.type(code)
        assert editor.inner_text() == code, (editor.inner_text(), code)   # no auto-inserted brackets
        self.page.keyboard.press("Escape")
        return self._run_selected(cell)

    def _run_selected(self, cell) -> str:
        """Ctrl+Enter on the selected `cell` (run it, stay on it), wait for its new execution
        count and an idle kernel; returns its output text."""
        prompt = cell.locator(".jp-InputPrompt")
        before = prompt.inner_text()
        self.page.keyboard.press("Control+Enter")
        self.page.wait_for_function(
            """([el, before]) => { const t = el.textContent; return t !== before && /\\[\\d+\\]/.test(t); }""",
            arg=[prompt.element_handle(), before], timeout=self.timeout)
        self.wait_kernel_idle()
        outputs = cell.locator(".jp-OutputArea-output")
        return outputs.last.inner_text() if outputs.count() else ""

    # -- the inspector widget ---------------------------------------------------------------------
    @property
    def inspector(self):
        """The StepInspector's outer box (the widget output holding its Tab)."""
        return self.panel.locator(".jp-OutputArea-output:has(.widget-tab)").first \
            .locator(".widget-vbox").first

    def position_text(self) -> str:
        """'record N/M: ...' next to the history slider."""
        return self.inspector.locator(".widget-html-content", has_text=re.compile(r"^record \d+/\d+")) \
            .first.inner_text()

    def click_step(self) -> str:
        """Click Step and wait until the position label moves to a new record; returns it."""
        return self.click_and_follow("Step")

    def click_and_follow(self, button: str) -> str:
        """Click the inspector's button `button` (Step, Run N, Run to end) and wait until the
        position label moves to a new record; returns the label."""
        before = self.position_text()
        self.click_button(button)
        label = self.inspector.locator(".widget-html-content", has_text=re.compile(r"^record \d+/\d+")).first
        self.page.wait_for_function("([el, before]) => el.textContent !== before",
                                    arg=[label.element_handle(), before], timeout=self.timeout)
        return self.position_text()

    def click_button(self, button: str) -> None:
        """Click the inspector's button labelled `button` (Step, Run N, Run to end, Reset, ...)."""
        self.inspector.locator("button.jupyter-button:visible",
                               has_text=re.compile(rf"^\s*{re.escape(button)}\s*$")).click()

    def add_request(self, prompt: str) -> str:
        """Type `prompt` into the inspector's request box, click Add request and wait until the
        status line says the request was added; returns that line."""
        box = self.inspector.locator("input[type='text'][placeholder^='text, or token ids']")
        box.fill(prompt)
        self.click_button("Add request")
        self.wait_text(self.status_line, "added request")
        line = self.status_line.inner_text()
        self.page.wait_for_function("el => el.value === ''", arg=box.element_handle(), timeout=self.timeout)
        return line

    @property
    def status_line(self):
        """The inspector's status line (the HTML widget between the history slider and the tabs)."""
        return self.inspector.locator(".runnerscope-status").first

    def open_tab(self, title: str):
        """Click the inspector's tab `title`; returns its panel once it is shown."""
        self.inspector.locator("li.lm-TabBar-tab:visible", has_text=re.compile(rf"^{re.escape(title)}$")).click()
        panel = self.inspector.locator(".widget-tab > .widget-tab-contents > .widget-box").nth(TABS.index(title))
        panel.wait_for(state="visible")
        return panel

    def wait_text(self, scope, text: str) -> None:
        """Wait until `text` is in the (rendered) text of `scope`: the kernel redraws a view
        after a click, so its new values arrive a moment later."""
        self.page.wait_for_function("([el, text]) => el.innerText.includes(text)",
                                    arg=[scope.element_handle(), text], timeout=self.timeout)

    def state_dropdown(self, panel, label: str):
        """The <select> of the State view's dropdown labelled `label` ("layer" or "request")."""
        return panel.locator(".widget-dropdown", has=self.page.locator(
            "label", has_text=re.compile(rf"^{re.escape(label)}$"))).locator("select")

    def pick_state_layer(self, panel, prefer: str = "mamba") -> str:
        """In the State view, choose a recurrent layer by its <option> in the layer dropdown (one
        whose name contains `prefer`, other than the one shown), then wait until the note names it
        and new heatmap <img>s are decoded. Returns the layer name."""
        note = panel.locator(".widget-html-content").first
        self.wait_text(note, "state page")                       # the first draw, for the default layer
        select = self.state_dropdown(panel, "layer")
        options = select.evaluate("e => [...e.options].map(o => o.value)")
        current = select.input_value()
        candidates = [o for o in options if prefer in o] or options
        choice = next((o for o in reversed(candidates) if o != current), candidates[-1])
        self._select_and_wait(panel, select, choice, choice)
        return choice

    def pick_state_request(self, panel, request_id: str) -> None:
        """Choose `request_id` in the State view's request dropdown and wait for its heatmaps."""
        select = self.state_dropdown(panel, "request")
        if select.input_value() != request_id:
            self._select_and_wait(panel, select, request_id, f"request {request_id!r}")

    def _select_and_wait(self, panel, select, value: str, note_text: str) -> None:
        note = panel.locator(".widget-html-content").first
        images = panel.locator(":scope > .widget-vbox").first
        old = set(loaded_images(images))
        select.select_option(value=value)
        self.wait_text(note, note_text)
        self.page.wait_for_function(
            """([el, old]) => { const imgs = [...el.querySelectorAll('img')];
                return imgs.length > 0
                    && imgs.every(i => i.complete && i.naturalWidth > 0 && !old.includes(i.src)); }""",
            arg=[images.element_handle(), sorted(old)], timeout=self.timeout)


def metadata_tables(panel) -> list[dict]:
    """The Metadata view as the page shows it: per table its title (the line above it), header
    and rows of cell texts."""
    return panel.evaluate(
        """el => [...el.querySelectorAll('table')].map(t => ({
            title: t.previousElementSibling ? t.previousElementSibling.innerText : '',
            header: [...t.querySelectorAll('thead th')].map(th => th.innerText.trim()),
            rows: [...t.querySelectorAll('tbody tr')].map(
                tr => [...tr.querySelectorAll('td')].map(td => td.innerText.trim()))}))""")


def metadata_values(tables: list[dict], group_word: str, field: str) -> list[str]:
    """The value cells of `field` in the common-metadata tables whose title names `group_word`."""
    out = []
    for t in tables:
        if group_word in t["title"] and "common metadata" in t["title"]:
            col = t["header"].index("value")
            out += [r[col] for r in t["rows"] if r and r[0] == field]
    return out


# ---- nbconvert's HTML, rendered offline ---------------------------------------------------------
def export_html(notebook: Path, out_dir: Path, timeout: float = 300, headless_steps: bool = True) -> Path:
    """Execute `notebook` with nbconvert to HTML, widget state stored, the widget manager and
    require.js from the local npm install (file://), so that the page renders without a network."""
    env = dict(os.environ, **KERNEL_ENV)
    if headless_steps:
        env["INSPECTOR_NOTEBOOK_HEADLESS"] = "1"
    cmd = [sys.executable, "-m", "nbconvert", "--to", "html", "--execute",
           "--ExecutePreprocessor.store_widget_state=True", f"--ExecutePreprocessor.timeout={int(timeout)}",
           f"--HTMLExporter.widget_renderer_url={WIDGET_JS.as_uri()}",
           f"--HTMLExporter.require_js_url={REQUIRE_JS.as_uri()}",
           "--output-dir", str(out_dir), str(notebook)]
    res = subprocess.run(cmd, cwd=Path(notebook).parent, env=env, capture_output=True, text=True,
                         timeout=timeout + 60)
    if res.returncode != 0:
        raise RuntimeError(f"nbconvert failed ({res.returncode}):\n{res.stderr[-4000:]}")
    return Path(out_dir) / (Path(notebook).stem + ".html")


def block_network(context, seen: list[str] | None = None) -> None:
    """Abort every request that is not file:// (data: and blob: never reach routes)."""
    def handler(route):
        url = route.request.url
        if url.startswith("file://"):
            route.continue_()
        else:
            if seen is not None:
                seen.append(url)
            route.abort()
    context.route("**/*", handler)


# ---- reading results back -------------------------------------------------------------------------
RUNNER_VALUES = re.compile(r"RUNNER_VALUES (\{.*\})")


def runner_values(text: str) -> dict:
    """The JSON the notebook's last cell prints ("RUNNER_VALUES {...}")."""
    m = RUNNER_VALUES.search(text)
    if m is None:
        raise AssertionError(f"no RUNNER_VALUES line in the cell output: {text!r}")
    return json.loads(m.group(1))


def loaded_images(scope) -> list[str]:
    """`src` of the <img>s under `scope` that are shown and decoded (naturalWidth > 0)."""
    return scope.evaluate("""el => [...el.querySelectorAll('img')]
        .filter(i => i.complete && i.naturalWidth > 0 && i.offsetParent !== null).map(i => i.src)""")


def save_png(path: Path, png: bytes, max_bytes: int | None = None) -> Path:
    """Write a screenshot; above `max_bytes`, store it with a 256-colour palette (lossless-looking
    for these flat tables and plots, several times smaller)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if max_bytes is not None and len(png) > max_bytes:
        import io

        from PIL import Image
        img = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
        buf = io.BytesIO()
        img.save(buf, format="PNG", optimize=True)
        png = buf.getvalue()
    path.write_bytes(png)
    return path
