"""Headless Chromium for the tests: render a page and read it back (the report, the serving playground).

:func:`chromium` finds the browser or skips the test with the reason; :func:`run_page` opens a URL through the
DevTools protocol, waits until ``document.body.dataset.state`` leaves ``idle``/``running`` (or, for a static
page, until it has loaded), and returns the evaluated expressions and the console messages.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest


def chromium() -> str:
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("no headless Chromium here (.ci/run installs Debian's chromium package; apt-get install chromium)")
    return browser


def run_page(url: str, expressions: list[str], wait_for_state: bool = True, timeout: float = 60.0
             ) -> tuple[list[object], list[str]]:
    """Values of ``expressions`` evaluated in the page at ``url`` once it is done, and its console messages
    (console.* calls, uncaught exceptions, and browser log entries such as failed loads)."""
    pytest.importorskip("websockets", reason="the serve-test extra (websockets) is not installed")
    from websockets.sync.client import connect

    browser = chromium()
    # Chromium's helper processes may still write into the profile while they exit: clean up leniently
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        process = subprocess.Popen([browser, "--headless=new", "--no-sandbox", "--disable-gpu",
                                    "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            port_file = Path(profile) / "DevToolsActivePort"
            deadline = time.monotonic() + 30
            while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
                if time.monotonic() > deadline:
                    raise RuntimeError("Chromium did not open its DevTools port")
                time.sleep(0.05)
            port = int(port_file.read_text().splitlines()[0])
            import urllib.request

            targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
            page = next(t for t in targets if t.get("type") == "page")
            messages: list[str] = []
            with connect(page["webSocketDebuggerUrl"], max_size=None) as ws:
                counter = [0]

                def call(method: str, **params) -> dict:
                    counter[0] += 1
                    ws.send(json.dumps({"id": counter[0], "method": method, "params": params}))
                    while True:
                        reply = json.loads(ws.recv(timeout=timeout))
                        if reply.get("id") == counter[0]:
                            return reply.get("result", {})
                        note(reply)

                def note(event: dict) -> None:
                    method, params = event.get("method"), event.get("params", {})
                    if method == "Runtime.consoleAPICalled":
                        messages.append(" ".join(str(a.get("value", a.get("description", ""))) for a in
                                                 params.get("args", [])))
                    elif method == "Runtime.exceptionThrown":
                        messages.append(params["exceptionDetails"].get("exception", {}).get("description", "error"))
                    elif method == "Log.entryAdded":
                        messages.append(params["entry"].get("text", ""))

                def evaluate(expression: str) -> object:
                    result = call("Runtime.evaluate", expression=expression, returnByValue=True)
                    return result.get("result", {}).get("value")

                call("Runtime.enable")
                call("Log.enable")
                call("Page.enable")
                call("Page.navigate", url=url)
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    ready = evaluate("document.readyState") == "complete"
                    state = evaluate("document.body ? (document.body.dataset.state || '') : ''")
                    if ready and (not wait_for_state or state not in ("idle", "running")):
                        break
                    time.sleep(0.1)
                else:
                    raise TimeoutError(f"the page did not finish within {timeout} s")
                time.sleep(0.2)  # late console messages
                values = [evaluate(e) for e in expressions]
                try:  # drain queued events
                    while True:
                        note(json.loads(ws.recv(timeout=0.2)))
                except TimeoutError:
                    pass
            return values, messages
        finally:  # the browser and its helper processes (one process group)
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    process.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue
