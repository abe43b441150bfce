"""The dashboard's ``/daskdist`` page in a real browser, while a model trains.

A strategy on a LocalCluster of two worker processes runs a custom training
loop (softmax regression on scikit-learn's digits: a distributed dataset,
``strategy.run`` per step, the gradient all-reduced through a mirrored
variable) in a background thread. Meanwhile headless Chromium (Debian's
``chromium``; ``scripts/ensure_chromium.sh`` installs it, ``make test`` runs
that first) loads ``<dashboard>/daskdist``. The browser is driven over the
DevTools protocol on a pipe (``--remote-debugging-pipe``: standard library
only, no port), which also reports every uncaught exception, console error and
failed load of the page. The test waits until BokehJS shows the replicas' steps,
then takes a screenshot.

Artifacts (gitignored): ``test-artifacts/dashboard.png`` (the screenshot),
``test-artifacts/dashboard-console.json`` (what the page logged) and
``test-artifacts/chromium.log`` (the browser's stderr).
"""

from __future__ import annotations

import base64
import io
import itertools
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

import daskdist as dd

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
WIDTH, HEIGHT = 1400, 1000
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--mute-audio", f"--window-size={WIDTH},{HEIGHT}"]
#: the phase colours of daskdist/dashboard/page.py (input wait, compute, all-reduce, apply)
PHASE_COLORS = {"input wait": (0xF2, 0x8E, 0x2B), "compute": (0x4E, 0x79, 0xA7),
                "all-reduce": (0xE1, 0x57, 0x59), "apply": (0x59, 0xA1, 0x4F)}


def find_chromium() -> str | None:
    for candidate in (os.environ.get("CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


_TRAMPOLINE = """
import os, sys
read_end, write_end = int(sys.argv[1]), int(sys.argv[2])
os.dup2(read_end, 3)
os.dup2(write_end, 4)
for fd in {read_end, write_end} - {3, 4}:
    os.close(fd)
os.execv(sys.argv[3], sys.argv[3:])
"""


class DevToolsError(RuntimeError):
    pass


class Browser:
    """Headless Chromium driven through the DevTools protocol over ``--remote-debugging-pipe``.

    Chromium reads commands from its fd 3 and writes replies and events to fd 4,
    as JSON messages each ended by a NUL byte.
    """

    def __init__(self, executable: str, user_data_dir: pathlib.Path, log_path: pathlib.Path):
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        argv = [executable, *FLAGS, f"--user-data-dir={user_data_dir}", "--remote-debugging-pipe", "about:blank"]
        # a small Python puts the pipe ends on fds 3 and 4, then execs the browser (no preexec_fn: we have threads)
        self._log = open(log_path, "wb")  # noqa: SIM115 - open for the browser's lifetime, closed in close()
        self.process = subprocess.Popen([sys.executable, "-c", _TRAMPOLINE, str(to_browser_r), str(from_browser_w),
                                         *argv], pass_fds=(to_browser_r, from_browser_w),
                                        stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._ids = itertools.count(1)
        self._lock = threading.Condition()
        self._replies: dict[int, dict] = {}
        self.events: list[dict] = []
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="devtools-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        buffer = b""
        while True:
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                break
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            with self._lock:
                for raw in messages:
                    message = json.loads(raw)
                    if "id" in message:
                        self._replies[message["id"]] = message
                    else:
                        self.events.append(message)
                self._lock.notify_all()
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30) -> dict:
        """Send one command and return its result (raises on a protocol error or a timeout)."""
        message_id = next(self._ids)
        message: dict[str, Any] = {"id": message_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        with self._lock:
            while message_id not in self._replies:
                remaining = deadline - time.monotonic()
                if self._closed or remaining <= 0:
                    raise DevToolsError(f"no reply to {method} ({'browser gone' if self._closed else 'timeout'})")
                self._lock.wait(remaining)
            reply = self._replies.pop(message_id)
        if "error" in reply:
            raise DevToolsError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def wait_for_event(self, method: str, session: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                for event in self.events:
                    if event.get("method") == method and event.get("sessionId") == session:
                        return event
                remaining = deadline - time.monotonic()
                if self._closed or remaining <= 0:
                    raise DevToolsError(f"no {method} event")
                self._lock.wait(remaining)

    def page_events(self, session: str) -> list[dict]:
        with self._lock:
            return [e for e in self.events if e.get("sessionId") == session]

    def close(self) -> None:
        try:
            if self.process.poll() is None and not self._closed:
                self.send("Browser.close", timeout=5)
            self.process.wait(10)
        except (DevToolsError, OSError, subprocess.TimeoutExpired):
            pass
        finally:
            if self.process.poll() is None:  # the browser and its helpers: the session this test started
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
            for fd in (self._to_browser, self._from_browser):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._log.close()


def page_errors(events: list[dict]) -> list[str]:
    """Uncaught exceptions, console errors and failed loads reported by the page."""
    errors = []
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            description = details.get("exception", {}).get("description") or details.get("text")
            errors.append(f"uncaught: {description} at {details.get('url')}:{details.get('lineNumber')}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            errors.append(f"console.{params['type']}: {text}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            errors.append(f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}")
    return errors


# what BokehJS shows: the step source's rows and the summary text (null until the document is there)
PAGE_STATE = """(() => {
  const docs = (window.Bokeh && window.Bokeh.documents) || [];
  for (const doc of docs) {
    const steps = doc.get_model_by_name("daskdist-steps"), summary = doc.get_model_by_name("daskdist-summary");
    if (steps && summary) {
      return {rows: steps.get_length() || 0, replicas: Array.from(steps.data.get ? steps.data.get("replica")
              : steps.data.replica).filter((v, i, a) => a.indexOf(v) === i).length, summary: summary.text,
              title: document.title};
    }
  }
  return null;
})()"""


# the straggler table of collectives: its newest row in the model, and whether a drawn row shows it
STRAGGLER_TABLE = """(() => {
  for (const doc of (window.Bokeh && window.Bokeh.documents) || []) {
    const source = doc.get_model_by_name("daskdist-collectives");
    if (!source || !source.get_length()) continue;
    const col = (k) => source.data.get ? source.data.get(k) : source.data[k];
    const newest = `${col("run_id")[0]}|${col("seq")[0]}|${col("kind")[0]}|${col("replica")[0]}`;
    const drawn = [];
    const walk = (root) => {
      for (const e of root.querySelectorAll("*")) {
        if (e.classList && e.classList.contains("slick-row")) {
          drawn.push(Array.from(e.querySelectorAll(".slick-cell")).slice(0, 4).map(c => c.textContent).join("|"));
        }
        if (e.shadowRoot) walk(e.shadowRoot);
      }
    };
    walk(document);
    return {newest: newest, shown: drawn.includes(newest)};
  }
  return null;
})()"""


# -- the training run -----------------------------------------------------------------------


class Training(threading.Thread):
    """A custom training loop (TF's "custom training with tf.distribute") until ``stop`` is set."""

    def __init__(self, strategy: Any):
        super().__init__(name="training", daemon=True)
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = (digits.data / 16.0).astype(np.float32)
        y = digits.target.astype(np.int64)
        self.strategy = strategy
        self.dataset = strategy.experimental_distribute_dataset(
            dd.data.Dataset.from_tensor_slices((x, y)).shuffle(2048, seed=0).batch(64 * strategy.num_replicas_in_sync))
        with strategy.scope():
            self.weights = dd.Variable(np.zeros((64, 10), np.float32), aggregation=dd.VariableAggregation.SUM)
        self.stop = threading.Event()
        self.steps = 0
        self.losses: list[float] = []
        self.error: Exception | None = None

    def run(self) -> None:
        weights = self.weights

        def train_step(batch):
            x, y = batch
            logits = x @ np.asarray(weights.value())
            logits -= logits.max(axis=1, keepdims=True)
            p = np.exp(logits)
            p /= p.sum(axis=1, keepdims=True)
            per_example = -np.log(p[np.arange(len(y)), y] + 1e-9)
            p[np.arange(len(y)), y] -= 1.0
            global_batch = len(y) * dd.get_replica_context().num_replicas_in_sync
            weights.assign_sub(0.5 * (x.T @ p) / global_batch)  # summed over the replicas: the global mean
            return dd.nn.compute_average_loss(per_example, global_batch_size=global_batch)

        try:
            while not self.stop.is_set():
                for batch in self.dataset:
                    loss = self.strategy.reduce("SUM", self.strategy.run(train_step, args=(batch,)), axis=None)
                    self.losses.append(float(loss))
                    self.steps += 1
                    if self.stop.is_set():
                        break
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = e


def _probe_error_capture(browser: Browser) -> list[str]:
    """The errors ``page_errors`` finds on a page that logs one console error and throws one uncaught error."""
    page = "<script>console.error('daskdist-probe'); setTimeout(() => { throw new Error('daskdist-probe'); });</script>"
    target = browser.send("Target.createTarget", {"url": "about:blank"})
    session = browser.send("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True})["sessionId"]
    for domain in ("Page", "Runtime", "Log"):
        browser.send(f"{domain}.enable", session=session)
    browser.send("Page.navigate", {"url": "data:text/html," + page}, session=session)
    browser.wait_for_event("Runtime.exceptionThrown", session, timeout=30)
    return page_errors(browser.page_events(session))


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def chromium() -> str:
    executable = find_chromium()
    if executable is None:
        pytest.skip("headless Chromium not found (/usr/bin/chromium): run `bash scripts/ensure_chromium.sh` "
                    "(make test does) or set CHROMIUM=/path/to/chromium")
    return executable


@pytest.mark.timeout(240)
def test_dashboard_page_renders_training_in_chromium(chromium, make_cluster, tmp_path):
    pytest.importorskip("sklearn")
    from PIL import Image

    ARTIFACTS.mkdir(exist_ok=True)
    client = make_cluster(2, processes=True)
    strategy = dd.MirroredStrategy(client=client)
    training = Training(strategy)
    browser = None
    try:
        training.start()
        _wait(lambda: training.steps >= 5 or training.error, 60, "the first training steps")
        assert training.error is None, training.error

        url = strategy.dashboard_link.rsplit("/", 1)[0] + "/daskdist"
        browser = Browser(chromium, tmp_path / "profile", ARTIFACTS / "chromium.log")
        browser.send("Target.getTargets", timeout=60)  # the browser is up
        target = browser.send("Target.createTarget", {"url": "about:blank"})
        session = browser.send("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            browser.send(f"{domain}.enable", session=session)
        browser.send("Emulation.setDeviceMetricsOverride",
                     {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False}, session=session)
        navigation = browser.send("Page.navigate", {"url": url}, session=session)
        assert "errorText" not in navigation, navigation
        browser.wait_for_event("Page.loadEventFired", session, timeout=60)

        def rendered() -> dict | None:
            assert training.error is None, training.error
            result = browser.send("Runtime.evaluate", {"expression": PAGE_STATE, "returnByValue": True},
                                  session=session)
            state = result.get("result", {}).get("value")
            # steps of both replicas have reached the page (the bars are drawn a frame later)
            # the summary line is redrawn apart from the table: it may still read "0 replicas" a moment longer
            if (state and state["rows"] >= 10 and state["replicas"] == 2 and "steps/s" in state["summary"]
                    and "2 replicas" in state["summary"]):
                return state
            return None

        state = _wait(rendered, 60, "the page to show the replicas' steps")

        def straggler_row_drawn() -> str | None:
            result = browser.send("Runtime.evaluate", {"expression": STRAGGLER_TABLE, "returnByValue": True},
                                  session=session)
            table = result.get("result", {}).get("value")
            return table["newest"] if table and table["shown"] else None

        # the stragglers table is drawn, and redrawn as new collectives arrive (same number of rows)
        first = _wait(straggler_row_drawn, 30, "the stragglers table to show the newest collective")
        _wait(lambda: (newest := straggler_row_drawn()) and newest != first, 30,
              "the stragglers table to show a newer collective")
        time.sleep(1.0)  # a few more updates (every 500 ms) and paints
        assert strategy.extended.token in state["summary"] and "2 replicas" in state["summary"]
        assert state["title"] == "Dask: daskdist"

        shot = browser.send("Page.captureScreenshot", {"format": "png"}, session=session, timeout=60)
        png = base64.b64decode(shot["data"])
        (ARTIFACTS / "dashboard.png").write_bytes(png)
        events = browser.page_events(session)
        (ARTIFACTS / "dashboard-console.json").write_text(json.dumps(
            [e for e in events if e.get("method") in ("Runtime.exceptionThrown", "Runtime.consoleAPICalled",
                                                     "Log.entryAdded")], indent=1))
        probe_errors = _probe_error_capture(browser)
    finally:
        training.stop.set()
        training.join(60)
        if browser is not None:
            browser.close()
        strategy.close()

    assert training.error is None, training.error
    assert training.steps >= 10 and training.losses[-1] < training.losses[0]  # it trains

    # no JavaScript errors, no console errors, no failed loads (and the capture does see them where they are)
    assert page_errors(events) == []
    assert any("uncaught" in e and "daskdist-probe" in e for e in probe_errors), probe_errors
    assert any(e.startswith("console.error") and "daskdist-probe" in e for e in probe_errors), probe_errors

    # a real, non-blank PNG of the requested size, with the phase bars drawn in their colours
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    image = Image.open(io.BytesIO(png)).convert("RGB")
    assert image.size == (WIDTH, HEIGHT)
    pixels = np.asarray(image).reshape(-1, 3).astype(int)
    colors, counts = np.unique(pixels, axis=0, return_counts=True)
    assert len(colors) > 50 and counts.max() < 0.97 * len(pixels), "the screenshot is (nearly) blank"
    drawn = {name: int((np.abs(pixels - rgb).sum(axis=1) < 24).sum()) for name, rgb in PHASE_COLORS.items()}
    assert drawn["all-reduce"] > 100 or drawn["compute"] > 100, drawn
