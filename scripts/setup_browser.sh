#!/usr/bin/env bash
# Puts Debian's Chromium at /usr/bin/chromium for the viewer's browser test
# (tests/test_viewer_browser.py), which drives it with Playwright's Python package (the `test`
# extra), and speedscope (npm) in .tools/ for the trace's viewer test (tests/test_trace_run.py),
# which opens a run's trace.json in it in the same Chromium. Playwright never downloads a browser
# of its own here. Idempotent: apt runs only while /usr/bin/chromium is missing, npm only while
# .tools/ lacks that speedscope version.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x /usr/bin/chromium ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -q
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q chromium
fi
/usr/bin/chromium --headless --no-sandbox --disable-gpu --version 2>/dev/null | head -1
SPEEDSCOPE=1.25.0
if ! grep -qs "\"version\": \"$SPEEDSCOPE\"" .tools/node_modules/speedscope/package.json; then
    npm install --no-save --no-audit --no-fund --prefix .tools "speedscope@$SPEEDSCOPE"
fi
echo "speedscope $SPEEDSCOPE in .tools/node_modules/speedscope"
.venv/bin/python -c "import playwright" 2>/dev/null \
    || { echo "playwright is not in .venv: pip install -e '.[test]' first" >&2; exit 1; }
