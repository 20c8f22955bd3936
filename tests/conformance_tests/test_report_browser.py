"""The HTML report in a real browser: headless Chromium (Debian's `chromium` package) loads the
page from disk and is asked, over the DevTools protocol on a pipe (no port, no network, no
package beyond the browser), what a person would see: the legend laid out, a failed cell's link
scrolling to its failure, the divergence timeline drawn with the first divergence on top.
Without Chromium the test skips, naming the package to install."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from conformance.report.html import render_html
from tests.conformance_tests.report_samples import diverging_traces, sample_matrix

BROWSERS = ("chromium", "chromium-browser")
_TIMEOUT_S = 60.0


def _browser() -> str:
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("no Chromium here: install Debian's `chromium` package (apt-get install -y chromium)")


class DevTools:
    """A Chromium started with --remote-debugging-pipe: JSON messages, NUL-separated, written
    to its fd 3 and read from its fd 4."""

    def __init__(self, browser: str, profile: Path) -> None:
        to_browser, self._to_browser = os.pipe()
        self._from_browser, from_browser = os.pipe()
        # The child gets its ends as fds 3 and 4: dup2 makes inheritable copies there, and
        # close_fds=False keeps them (our pipe fds themselves are close-on-exec).

        def child_fds() -> None:
            # Copies above 9 first: a pipe end may itself be fd 3 or 4 (dup2 onto itself would
            # keep close-on-exec; onto the other end would close that).
            reading, writing = (fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_browser, from_browser))
            os.dup2(reading, 3)
            os.dup2(writing, 4)

        self.process = subprocess.Popen(
            [
                browser,
                "--headless",
                "--no-sandbox",  # root in a container has no user namespaces for the sandbox
                "--disable-gpu",
                "--no-first-run",
                "--remote-debugging-pipe",
                f"--user-data-dir={profile}",
                "--window-size=1280,900",
                "about:blank",
            ],
            close_fds=False,
            preexec_fn=child_fds,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_browser)
        os.close(from_browser)
        self._buffer = b""
        self._next_id = 0
        self.session: str | None = None

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if self.session is not None and not method.startswith("Target."):
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + _TIMEOUT_S
        while time.monotonic() < deadline:
            while b"\0" not in self._buffer:
                chunk = os.read(self._from_browser, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"Chromium closed the DevTools pipe during {method}")
                self._buffer += chunk
            line, _, self._buffer = self._buffer.partition(b"\0")
            reply = json.loads(line)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
        raise TimeoutError(f"Chromium gave no answer to {method} in {_TIMEOUT_S} s")

    def open(self, url: str) -> None:
        target = self.call("Target.createTarget", url=url)["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        deadline = time.monotonic() + _TIMEOUT_S
        # The new tab shows about:blank (also "complete") until the navigation commits.
        loaded = f"location.href === {json.dumps(url)} && document.readyState === 'complete'"
        while not self.evaluate(loaded):
            assert time.monotonic() < deadline, f"{url} did not finish loading in {_TIMEOUT_S} s"
            time.sleep(0.1)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)


@pytest.fixture
def page(tmp_path: Path) -> Path:
    """A report with a split cell, an expected failure and a divergence failure with its trace."""
    (tmp_path / "traces").mkdir()
    matrix = sample_matrix(tmp_path / "traces", trace=diverging_traces())
    path = tmp_path / "conformance.html"
    path.write_text(render_html(matrix, str(tmp_path)), encoding="utf-8")
    return path


def test_a_person_sees_the_legend_the_failure_and_the_timeline(page: Path, tmp_path: Path) -> None:
    browser = DevTools(_browser(), tmp_path / "profile")
    try:
        browser.open(page.as_uri())
        # The legend is laid out on screen, one key per outcome, each with its colour.
        legend = browser.evaluate(
            "[...document.querySelectorAll('#legend > div')].map(d => {const r = d.getBoundingClientRect();"
            " return [d.textContent.split(':')[0], r.width > 0 && r.height > 0,"
            " getComputedStyle(d.querySelector('.key')).backgroundImage !== 'none'"
            " || getComputedStyle(d.querySelector('.key')).backgroundColor]})"
        )
        assert [key for key, _, _ in legend] == ["pass", "fail", "expected-fail", "unsupported", "skip", "not run"]
        assert all(shown for _, shown, _ in legend), legend
        # A split cell shows both outcomes side by side, in equal widths (2 pass, 2 unsupported).
        widths = browser.evaluate(
            "[...document.querySelector('td[title=\"2 pass / 2 unsupported\"] .bar').children]"
            ".map(s => Math.round(s.getBoundingClientRect().width))"
        )
        assert len(widths) == 2 and widths[0] == widths[1] > 10, widths
        # Clicking the failed cell scrolls its failure section to the top of the window.
        before = browser.evaluate("window.scrollY")
        target = browser.evaluate(
            "(() => {const a = document.querySelector('td.cellfail a'); a.click();"
            " return a.getAttribute('href').slice(1)})()"
        )
        time.sleep(0.2)
        top = browser.evaluate(f"document.getElementById({json.dumps(target)}).getBoundingClientRect().top")
        assert browser.evaluate("window.scrollY") > before and abs(top) < 5, (target, top)
        assert browser.evaluate("location.hash") == f"#{target}"
        # The timeline is drawn: both ranks' lanes, and the first divergence frame is what a
        # person sees at its place (nothing covers it).
        timeline = browser.evaluate(
            "(() => {const svg = document.querySelector('svg.timeline'); const b = svg.getBoundingClientRect();"
            " const marks = [...svg.querySelectorAll('rect.divergence')].map(m => {"
            "   m.scrollIntoView({block: 'center'}); const r = m.getBoundingClientRect();"
            "   return document.elementFromPoint(r.left + 1, r.top + r.height / 2) === m});"
            " return [b.width, b.height, svg.querySelectorAll('rect > title').length, marks]})()"
        )
        width, height, boxes, marks_on_top = timeline
        assert width > 300 and height > 50 and boxes == 8, timeline
        assert marks_on_top == [True, True], timeline
        # The trace link points at the trace file beside the page.
        href = browser.evaluate("document.querySelector('a.trace-link').href")
        assert href.startswith("file://") and Path(href.removeprefix("file://")).exists(), href
    finally:
        browser.close()
