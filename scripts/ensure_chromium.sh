#!/usr/bin/env bash
# Best effort: make a headless Chromium available for tests/test_dashboard_browser.py.
#
# When no Chromium is found, installs Debian's `chromium` package with apt-get (about 30 s on a
# fresh Debian 12 machine). Never fails: when it cannot install (no apt-get, Ubuntu's snap-only
# package, not root and no passwordless sudo, no network, ...) it says why and exits 0, and the
# browser test then skips with a clear reason.
#
#   bash scripts/ensure_chromium.sh          (`make test` runs it before pytest)
#   CHROMIUM=/path/to/chromium               a Chromium of your own (the test uses it too)
#   DASKDIST_SKIP_CHROMIUM_INSTALL=1         never install anything
set -u

log() { echo "ensure_chromium: $*" >&2; }

for candidate in "${CHROMIUM:-}" /usr/bin/chromium "$(command -v chromium 2>/dev/null)" \
                 "$(command -v chromium-browser 2>/dev/null)"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ]; then
        log "found $candidate"
        exit 0
    fi
done

skip="the browser test will skip"
if [ -n "${DASKDIST_SKIP_CHROMIUM_INSTALL:-}" ]; then
    log "chromium not found; DASKDIST_SKIP_CHROMIUM_INSTALL is set: not installing ($skip)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    log "chromium not found and apt-get is not available: not installing ($skip)." \
        "Install Chromium yourself and set CHROMIUM=/path/to/chromium"
    exit 0
fi
if [ -r /etc/os-release ] && grep -qi '^ID=ubuntu' /etc/os-release; then
    # Ubuntu's chromium package only installs the snap, which does not run without snapd (containers)
    log "chromium not found; on Ubuntu the chromium package is a snap: not installing ($skip)." \
        "Install Chromium yourself and set CHROMIUM=/path/to/chromium"
    exit 0
fi

SUDO=()
if [ "$(id -u)" != "0" ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO=(sudo -n)
    else
        log "chromium not found; installing it needs root or passwordless sudo: not installing ($skip)." \
            "By hand: sudo apt-get install chromium"
        exit 0
    fi
fi
APT=("${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=120)

start=$(date +%s)
log "chromium not found: installing Debian's chromium with apt-get (about half a minute)"
if ! "${APT[@]}" update -qq >&2; then
    log "apt-get update failed (no network or no package sources?): not installing ($skip)"
    exit 0
fi
if ! "${APT[@]}" install -y -qq --no-install-recommends chromium fonts-dejavu-core >&2; then
    log "apt-get install chromium failed: not installing ($skip)"
    exit 0
fi
if [ -x /usr/bin/chromium ]; then
    log "installed $(/usr/bin/chromium --version 2>/dev/null) in $(( $(date +%s) - start )) s"
else
    log "apt-get succeeded but /usr/bin/chromium is missing ($skip)"
fi
exit 0
