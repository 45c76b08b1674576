"""Headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`:
JSON messages separated by NUL on fds 3 and 4), so no websocket or driver package is needed.

    with Browser() as b:
        page = b.open("http://127.0.0.1:8000/status")   # waits for the load event
        page.errors, page.links, page.screenshot          # console errors, hrefs, PNG bytes

Blocking: call it from a thread (asyncio.to_thread) when the server runs on this loop.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time


def chromium() -> str | None:
    """The Chromium binary (Debian's `chromium`), or None."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Page:
    def __init__(self, url: str) -> None:
        self.url = url
        self.status: int | None = None  # the HTTP status of the document
        self.errors: list[str] = []     # console errors, exceptions, failed loads (Log entries of level error)
        self.links: list[str] = []
        self.text = ""
        self.screenshot = b""


class Browser:
    def __init__(self, timeout: float = 30.0) -> None:
        self.timeout = timeout
        self._id = 0
        self._buf = b""

    def __enter__(self) -> Browser:
        binary = chromium()
        if binary is None:
            raise FileNotFoundError("chromium is not installed")
        self._profile = tempfile.mkdtemp(prefix="aiobrpc-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        log = os.environ.get("BROWSER_LOG")  # where Chromium's own log goes, to debug it
        self._log = open(log, "wb") if log else subprocess.DEVNULL
        # The browser reads fd 3 and writes fd 4: dup ours there in the child.
        log = os.environ.get("BROWSER_LOG")  # where Chromium's own log goes, to debug it
        self._log = open(log, "wb") if log else subprocess.DEVNULL
        # The browser reads fd 3 and writes fd 4: bash puts our pipe ends there (dash takes one-digit fds only).
        r, w = (_above_4(fd) for fd in (to_browser_r, from_browser_w))
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$@" 3<&{r} 4>&{w} {r}<&- {w}>&-', "bash", binary,
             "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--hide-scrollbars",
             "--remote-debugging-pipe", f"--user-data-dir={self._profile}", "--window-size=1280,1000",
             "about:blank"],
            pass_fds=(r, w), stdout=subprocess.DEVNULL, stderr=self._log, start_new_session=True)
        for fd in (to_browser_r, from_browser_w, r, w):
            os.close(fd)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._send("Browser.close")
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)
        shutil.rmtree(self._profile, ignore_errors=True)
        if self._log is not subprocess.DEVNULL:
            self._log.close()

    # -- the protocol -----------------------------------------------------------------------------
    def _send(self, method: str, params: dict | None = None, session: str | None = None) -> int:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_browser, json.dumps(msg).encode() + b"\0")
        return self._id

    def _next(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            if time.monotonic() > deadline:
                raise TimeoutError("chromium did not answer in time")
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                raise EOFError("chromium closed its pipe")
            self._buf += chunk
        raw, _, self._buf = self._buf.partition(b"\0")
        return json.loads(raw)

    def call(self, method: str, params: dict | None = None, session: str | None = None,
             events: list | None = None) -> dict:
        """Send a command and wait for its result; events that come meanwhile go to `events`."""
        want = self._send(method, params, session)
        deadline = time.monotonic() + self.timeout
        while True:
            msg = self._next(deadline)
            if msg.get("id") == want:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            if events is not None and "method" in msg:
                events.append(msg)

    def wait_event(self, name: str, session: str, events: list) -> dict:
        deadline = time.monotonic() + self.timeout
        for e in events:
            if e["method"] == name and e.get("sessionId") == session:
                return e
        while True:
            msg = self._next(deadline)
            if "method" in msg:
                events.append(msg)
                if msg["method"] == name and msg.get("sessionId") == session:
                    return msg

    # -- a page ---------------------------------------------------------------------------------
    def open(self, url: str) -> Page:
        """Load `url` in a new tab: its console errors, links, text and a screenshot."""
        page = Page(url)
        events: list = []
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=session, events=events)
        self.call("Page.navigate", {"url": url}, session=session, events=events)
        self.wait_event("Page.loadEventFired", session, events)
        result = self.call("Runtime.evaluate", {
            "expression": "JSON.stringify({links: [...document.links].map(a => a.href), "
                          "text: document.body ? document.body.innerText : ''})",
            "returnByValue": True}, session=session, events=events)
        got = json.loads(result["result"]["value"])
        page.links, page.text = got["links"], got["text"]
        shot = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True},
                         session=session, events=events)
        page.screenshot = base64.b64decode(shot["data"])
        for e in events:
            if e.get("sessionId") != session:
                continue
            p = e.get("params", {})
            if e["method"] == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                page.errors.append("console: " + " ".join(str(a.get("value", a.get("description", "")))
                                                          for a in p.get("args", [])))
            elif e["method"] == "Runtime.exceptionThrown":
                page.errors.append("exception: " + p.get("exceptionDetails", {}).get("text", ""))
            elif e["method"] == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                entry = p["entry"]
                page.errors.append(f"log: {entry.get('text')} ({entry.get('url', '')})")
            elif e["method"] == "Network.responseReceived" and p.get("type") == "Document" and page.status is None:
                page.status = p["response"]["status"]
        self.call("Target.closeTarget", {"targetId": target})
        return page


def _above_4(fd: int) -> int:
    """A copy of `fd` numbered 10 or more, so that the redirections to 3 and 4 cannot hit it."""
    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
