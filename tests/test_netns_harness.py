"""The namespace host harness cleans up after itself, also after its process was killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import netns

pytestmark = pytest.mark.netns

_MAKER = """
import json, sys, time
from tests.netns import start_hosts
hosts = start_hosts(2, 0)
print(json.dumps({"tag": hosts.tag, "namespaces": [h.namespace for h in hosts.hosts], "bridge": hosts.bridge,
                  "veths": [h.veth for h in hosts.hosts], "pids": [h.anchor.pid for h in hosts.hosts],
                  "log_dir": str(hosts.log_dir)}), flush=True)
time.sleep(600)
"""


def _exists(kind: str, name: str) -> bool:
    args = ["ip", "netns", "list"] if kind == "netns" else ["ip", "-o", "link", "show", name]
    out = subprocess.run(args, check=False, capture_output=True, text=True)
    return name in out.stdout.split() if kind == "netns" else out.returncode == 0


def test_a_run_killed_with_sigkill_is_cleaned_up_by_the_next_one():
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    maker = subprocess.Popen([sys.executable, "-c", _MAKER], stdout=subprocess.PIPE, text=True,
                             cwd=netns.REPO_ROOT, env=netns._environment())
    try:
        made = json.loads(maker.stdout.readline())
    finally:
        maker.send_signal(signal.SIGKILL)
        maker.wait(10)
    assert all(_exists("netns", ns) for ns in made["namespaces"]) and _exists("link", made["bridge"])
    deadline = time.monotonic() + 10  # its children die with it (setpriv --pdeathsig)
    while any(netns._alive(pid) for pid in made["pids"]):
        assert time.monotonic() < deadline, "the killed run's processes outlived it"
        time.sleep(0.05)
    removed = netns.remove_stale()  # named here, unless a concurrent start_hosts (another test process) was first
    assert made["tag"] in removed or not (netns.STATE_DIR / f"{made['tag']}.json").exists()
    assert not any(_exists("netns", ns) for ns in made["namespaces"])
    assert not any(_exists("link", name) for name in [made["bridge"], *made["veths"]])
    assert not (netns.STATE_DIR / f"{made['tag']}.json").exists()
    assert not os.path.exists(made["log_dir"])  # its logs and TLS files too
