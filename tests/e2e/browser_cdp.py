"""Drive Debian's headless Chromium through the DevTools protocol (CDP) over its WebSocket, synchronously.

`with Chromium(tmp_path) as browser:` starts one browser; `browser.open(url)` navigates its page and waits
for `window.harnessReady` (or any expression); `browser.evaluate(js)` runs JavaScript (awaiting a promise)
and returns its JSON value; `browser.wait_for(js, timeout)` polls until the expression is truthy (wrap it in
`guarded(js)` to count a throw as "not yet"), `browser.until(probe, timeout)` until a Python callable is;
`browser.screenshot(path)` saves a PNG of the whole page; `browser.errors` lists the page's uncaught
exceptions. No Node, no npm: the `websockets` dependency speaks CDP.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from websockets.sync.client import ClientConnection
from websockets.sync.client import connect as ws_connect

CHROMIUM = shutil.which("chromium")
# Flags from the machine's notes: without the background-networking ones Chromium keeps dialling out.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # timers of a page must run on time although nothing looks at it
    "--disable-background-timer-throttling",
    "--disable-renderer-backgrounding",
    "--disable-backgrounding-occluded-windows",
]


class BrowserError(AssertionError):
    pass


def guarded(expression: str) -> str:
    """`expression` with a throw counting as false (while a page loads, its elements may not exist yet)."""
    return f"(() => {{ try {{ return {expression}; }} catch {{ return false; }} }})()"


class Chromium:
    def __init__(self, profile_dir: Path, *, start_timeout: float = 30.0, window: tuple[int, int] | None = None) -> None:
        """`window=(width, height)`: that window and viewport size in CSS pixels (default: Chromium's)."""
        assert CHROMIUM is not None, "chromium is not installed"
        self.profile_dir = profile_dir
        self.start_timeout = start_timeout
        self.window = window
        self.proc: subprocess.Popen | None = None
        self.ws: ClientConnection | None = None
        self._ids = itertools.count(1)
        self.console: list[str] = []
        #: the page's uncaught exceptions (also in `console`, prefixed "exception: ")
        self.errors: list[str] = []
        self._stack = contextlib.ExitStack()
        self._loaded = False

    def __enter__(self) -> Chromium:
        try:
            return self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> Chromium:
        port_file = self.profile_dir / "DevToolsActivePort"
        port_file.unlink(missing_ok=True)
        size = [f"--window-size={self.window[0]},{self.window[1]}"] if self.window else []
        assert CHROMIUM is not None, "no chromium on PATH (`make browser`)"
        self.proc = subprocess.Popen(
            [
                CHROMIUM,
                *FLAGS,
                *size,
                f"--user-data-dir={self.profile_dir}",
                "--remote-debugging-port=0",
                "--remote-debugging-address=127.0.0.1",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + self.start_timeout
        port = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BrowserError(f"chromium exited: {self.proc.stderr.read().decode()[-2000:] if self.proc.stderr else ''}")
            try:
                port = int(port_file.read_text().split()[0])
                break
            except (FileNotFoundError, IndexError, ValueError):
                time.sleep(0.1)
        if port is None:
            raise BrowserError("chromium did not open its DevTools port")
        page = None
        while time.monotonic() < deadline and page is None:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                targets = json.load(r)
            page = next((t for t in targets if t.get("type") == "page"), None)
            if page is None:
                time.sleep(0.1)
        if page is None:
            raise BrowserError("chromium has no page target")
        self.ws = self._stack.enter_context(ws_connect(page["webSocketDebuggerUrl"], max_size=64 * 2**20, open_timeout=10))
        self.call("Runtime.enable")
        self.call("Page.enable")
        if self.window:
            self.call(
                "Emulation.setDeviceMetricsOverride",
                width=self.window[0],
                height=self.window[1],
                deviceScaleFactor=1,
                mobile=False,
            )
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.ws = None
        self._stack.close()
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            if self.proc.stderr:
                self.proc.stderr.close()
            self.proc = None

    # -- CDP ---------------------------------------------------------------------------------------------

    def call(self, method: str, timeout: float = 30.0, **params: Any) -> dict:
        assert self.ws is not None
        call_id = next(self._ids)
        self.ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BrowserError(f"no answer to {method} in {timeout} s")
            message = json.loads(self.ws.recv(timeout=remaining))
            if message.get("id") == call_id:
                if "error" in message:
                    raise BrowserError(f"{method}: {message['error']}")
                return message.get("result", {})
            self._event(message)

    def _event(self, message: dict) -> None:
        method = message.get("method")
        if method == "Page.loadEventFired":
            self._loaded = True
        elif method == "Runtime.consoleAPICalled":
            args = message["params"].get("args", [])
            self.console.append(" ".join(str(a.get("value", a.get("description", ""))) for a in args))
        elif method == "Runtime.exceptionThrown":
            details = message["params"]["exceptionDetails"]
            error = str(details.get("exception", {}).get("description", details.get("text")))
            self.errors.append(error)
            self.console.append("exception: " + error)

    def evaluate(self, expression: str, timeout: float = 30.0) -> Any:
        """The JSON value of `expression` (a promise is awaited)."""
        result = self.call("Runtime.evaluate", timeout=timeout, expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise BrowserError(f"{expression[:200]!r} threw: {text}")
        return result["result"].get("value")

    def until(self, probe: Callable[[], Any], timeout: float = 30.0, *, what: str, dump: str = "") -> Any:
        """Poll until `probe()` is truthy; returns its value. On timeout, fails with `dump` evaluated."""
        deadline = time.monotonic() + timeout
        while True:
            value = probe()
            if value:
                return value
            if self.proc is not None and self.proc.poll() is not None:
                raise BrowserError(f"chromium exited while waiting for {what}; console: {self.console[-20:]}")
            if time.monotonic() > deadline:
                state = self.evaluate(dump) if dump else None
                raise BrowserError(
                    f"timed out after {timeout} s waiting for {what}; state: {state}; console: {self.console[-20:]}"
                )
            time.sleep(0.1)

    def wait_for(self, expression: str, timeout: float = 30.0, *, what: str = "", dump: str = "") -> Any:
        """Poll until `expression` is truthy; returns its value. On timeout, fails with `dump` evaluated."""
        return self.until(lambda: self.evaluate(expression), timeout, what=what or expression, dump=dump)

    def screenshot(self, path: Path) -> None:
        """A PNG of the whole page (beyond the viewport, down to the end of its content) at `path`."""
        metrics = self.call("Page.getLayoutMetrics")
        width = self.window[0] if self.window else metrics["cssLayoutViewport"]["clientWidth"]
        shot = self.call(
            "Page.captureScreenshot",
            format="png",
            captureBeyondViewport=True,
            clip={"x": 0, "y": 0, "width": width, "height": metrics["cssContentSize"]["height"], "scale": 1},
        )
        path.write_bytes(base64.b64decode(shot["data"]))

    def open(self, url: str, ready: str = "window.harnessReady === true", timeout: float = 30.0) -> None:
        """Navigate, wait for the new document's load event, then until `ready` is truthy (exceptions: not yet)."""
        self._loaded = False
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout
        assert self.ws is not None
        while not self._loaded:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BrowserError(f"{url} did not load in {timeout} s")
            self._event(json.loads(self.ws.recv(timeout=remaining)))
        self.wait_for(guarded(ready), timeout, what=f"{url} to be ready")
