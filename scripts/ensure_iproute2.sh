#!/usr/bin/env bash
# Best effort: make `ip` and `tc` (Debian's iproute2) available for the network-namespace host tests
# (tests/netns.py, tests/test_multi_worker_mirrored.py). `unshare` and `nsenter` come with util-linux.
#
# Installs iproute2 with apt-get when `ip` or `tc` is missing. Never fails: when it cannot install
# (no apt-get, not root and no passwordless sudo, no network, ...) it says why and exits 0, and the
# tests then skip with a clear reason. They also skip where namespaces cannot be made (not root).
#
#   bash scripts/ensure_iproute2.sh          (`make test` runs it before pytest)
#   DASKDIST_SKIP_IPROUTE2_INSTALL=1         never install anything
set -u

log() { echo "ensure_iproute2: $*" >&2; }

if command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1; then
    log "found $(command -v ip) and $(command -v tc)"
    exit 0
fi
skip="the namespace host tests will skip"
if [ -n "${DASKDIST_SKIP_IPROUTE2_INSTALL:-}" ]; then
    log "ip/tc not found; DASKDIST_SKIP_IPROUTE2_INSTALL is set: not installing ($skip)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    log "ip/tc not found and apt-get is not available: not installing ($skip). Install iproute2 yourself"
    exit 0
fi
if [ "$(id -u)" != "0" ]; then
    # the tests need root for namespaces anyway; without root they skip, so there is nothing to install for
    log "ip/tc not found and not root: not installing ($skip; namespaces need root too)"
    exit 0
fi
APT=(env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=120)
log "ip/tc not found: installing iproute2 with apt-get"
if ! "${APT[@]}" update -qq >&2; then
    log "apt-get update failed (no network or no package sources?): not installing ($skip)"
    exit 0
fi
if ! "${APT[@]}" install -y -qq --no-install-recommends iproute2 >&2; then
    log "apt-get install iproute2 failed: not installing ($skip)"
    exit 0
fi
log "installed: $(command -v ip) $(command -v tc)"
exit 0
