#!/usr/bin/env bash
# Installs what the browser tests (tests/test_browser.py) and scripts/screenshot_views.py need,
# only where it is missing; prints one line per thing it does and exits 0 when all is there.
#   - Debian's `chromium` (apt-get), driven by Playwright (PyPI, no browser download)
#   - @jupyter-widgets/html-manager + requirejs (npm) into .browser/node_modules (git-ignored), so that
#     nbconvert's HTML renders its widgets offline (by default it loads them from a CDN)
# Works as root in CI (no stdin); as another user it uses sudo for apt-get.
set -euo pipefail
cd "$(dirname "$0")/.."
BROWSER_DIR="${BROWSER_DIR:-.browser}"
NM="$BROWSER_DIR/node_modules"

if command -v chromium >/dev/null 2>&1; then
    echo "setup_browser_test: chromium present ($(command -v chromium))"
else
    echo "setup_browser_test: installing Debian chromium (apt-get)"
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo -n"; fi
    export DEBIAN_FRONTEND=noninteractive
    log="$(mktemp)"
    # quiet unless it fails (apt's debconf notes go to stderr)
    if ! { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends chromium; } \
            </dev/null >"$log" 2>&1; then
        cat "$log" >&2; rm -f "$log"; echo "setup_browser_test: apt-get failed" >&2; exit 1
    fi
    rm -f "$log"
    command -v chromium >/dev/null 2>&1 || { echo "setup_browser_test: chromium still missing" >&2; exit 1; }
fi

if [ -f "$NM/@jupyter-widgets/html-manager/dist/embed-amd.js" ] && [ -f "$NM/requirejs/require.js" ]; then
    echo "setup_browser_test: widget JS present ($NM)"
else
    command -v npm >/dev/null 2>&1 || { echo "setup_browser_test: npm is needed for the widget JS" >&2; exit 1; }
    echo "setup_browser_test: installing @jupyter-widgets/html-manager and requirejs (npm) into $NM"
    mkdir -p "$BROWSER_DIR"
    [ -f "$BROWSER_DIR/package.json" ] || echo '{"private": true}' > "$BROWSER_DIR/package.json"
    npm install --prefix "$BROWSER_DIR" --no-audit --no-fund --loglevel=error --no-save \
        "@jupyter-widgets/html-manager@^1.0.15" "requirejs@^2.3.7" </dev/null >/dev/null
fi
