"""What the browser tests share: Debian's chromium launched by playwright (never a browser playwright downloads),
a context that aborts and records every request leaving this machine, and a page whose console and page errors
are collected (``Watched``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

CHROMIUM = Path("/usr/bin/chromium")
LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}


def launch_chromium(playwright_api: Any) -> Iterator[Any]:
    """The browser, for a module fixture to yield from."""
    assert CHROMIUM.exists(), "Debian's chromium is needed (apt-get install chromium)"
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def guarded_context(browser: Any, width: int) -> Iterator[Any]:
    """A browser context whose requests to anything but this machine are aborted and listed in ``.blocked``."""
    ctx = browser.new_context(viewport={"width": width, "height": 1000})
    ctx.blocked = []

    def guard(route: Any) -> None:
        url = route.request.url
        host = urlparse(url).hostname or ""
        if url.startswith(("data:", "blob:")) or host in LOOPBACK:
            route.continue_()
        else:
            ctx.blocked.append(url)
            route.abort()

    ctx.route("**/*", guard)
    yield ctx
    ctx.close()


class Watched:
    """A browser page whose console errors, page errors and off-machine requests are collected."""

    def __init__(self, context: Any) -> None:
        self.errors: list[str] = []
        self.blocked: list[str] = context.blocked
        self.page = context.new_page()
        self.page.on("console", lambda m: self.errors.append(f"console: {m.text}") if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))

    def clean(self, allow: str | None = None) -> None:
        """No request left the machine and no error was logged (but those containing ``allow``)."""
        assert self.blocked == [], f"requests left the machine: {self.blocked}"
        errors = [e for e in self.errors if allow is None or allow not in e]
        assert errors == [], errors


def wait_js(page: Any, expression: str, timeout: float = 60_000) -> None:
    """Poll ``expression`` with page.evaluate until it is truthy (wait_for_function evaluates strings in
    the page, which the page's Content-Security-Policy rightly refuses)."""
    deadline = time.monotonic() + timeout / 1000
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"timed out waiting for {expression}"
        time.sleep(0.05)
