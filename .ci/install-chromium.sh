#!/usr/bin/env bash
# Install Debian's Chromium for the headless-browser test of report.html
# (tests/kvfrag/test_report.py drives /usr/bin/chromium with playwright and skips without it).
#
# Part of the README's set-up command 2 (and so of .ci/run). Uses apt-get as root, or through
# `sudo -n` where that works without a password. Best effort: where Chromium cannot be
# installed it says so on stderr and exits 0, and that one test skips (pytest -ra lists it).
set -uo pipefail

if [ -x /usr/bin/chromium ]; then
    exit 0
fi
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO=(sudo -n)
    else
        echo "install-chromium: not root and no password-less sudo; run" \
             "'sudo apt-get install chromium' for the report.html browser test (it skips)" >&2
        exit 0
    fi
fi
install() {
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1
}
if ! install; then
    "${SUDO[@]}" apt-get update -qq >/dev/null 2>&1
    install || echo "install-chromium: apt-get could not install chromium;" \
                    "the report.html browser test will skip" >&2
fi
exit 0
