#!/usr/bin/env bash
# Puts Debian's Chromium at /usr/bin/chromium for the viewer's browser test
# (tests/test_viewer_browser.py), which drives it with Playwright's Python package (the `test`
# extra). Playwright never downloads a browser of its own here. Idempotent: apt runs only while
# /usr/bin/chromium is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x /usr/bin/chromium ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -q
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q chromium
fi
/usr/bin/chromium --headless --no-sandbox --disable-gpu --version 2>/dev/null | head -1
.venv/bin/python -c "import playwright" 2>/dev/null \
    || { echo "playwright is not in .venv: pip install -e '.[test]' first" >&2; exit 1; }
