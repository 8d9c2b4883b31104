"""The chat page at `/` in a real browser: the system's Chromium driven by Playwright.

The page is one static file served by the app; the test types a message, sees the answer stream in
(text appears while the request is still open), and reads the tokens/s line.
"""
from __future__ import annotations

import shutil

import pytest

from _server import API_KEY, start_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def server(request):
    return start_server(request)


@pytest.fixture(scope="module")
def page():
    from playwright.sync_api import sync_playwright

    assert CHROMIUM, "Chromium is not installed: apt-get install -y chromium (.ci/run does)"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser.new_page()
        finally:
            browser.close()


def test_the_page_streams_an_answer(server, page):
    requests_elsewhere = []
    page.on("request", lambda r: None if r.url.startswith(server.url) else requests_elsewhere.append(r.url))
    page.goto(server.url + "/")
    assert page.title() == "nanoplug chat"
    page.fill("#api-key", API_KEY)
    page.dispatch_event("#api-key", "change")
    page.wait_for_function("document.getElementById('model').textContent.includes('qwen3')")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "200")
    # note, inside the page, whether the answer had text while its request was still streaming
    page.evaluate("""() => {
        window.sawPartial = false;
        new MutationObserver(() => {
            for (const el of document.querySelectorAll('.assistant[data-streaming]'))
                if (el.textContent.length > 0) window.sawPartial = true;
        }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});
    }""")
    page.fill("#input", "Hello there, who are you?")
    page.press("#input", "Enter")
    page.wait_for_selector(".msg.user", timeout=30_000)
    answer = page.wait_for_selector(".assistant[data-done]", timeout=60_000)
    assert page.text_content(".msg.user") == "Hello there, who are you?"
    assert len(answer.text_content()) > 0
    assert page.evaluate("window.sawPartial"), "the answer only appeared once it was complete"
    stats = page.text_content("#log .stats:last-child")
    assert "200 tokens" in stats and "tok/s" in stats, stats
    assert "tok/s" in page.text_content("#speed")
    assert not page.query_selector(".msg.error")
    # a second turn sends the history: the server sees a longer prompt
    page.fill("#max-tokens", "4")
    page.fill("#input", "And again?")
    page.press("#input", "Enter")
    page.wait_for_function("document.querySelectorAll('.assistant[data-done]').length == 2", timeout=60_000)
    assert "4 tokens" in page.text_content("#log .stats:last-child")
    assert not requests_elsewhere, f"the page fetched from elsewhere: {requests_elsewhere}"
    server.wait_idle()


def test_the_page_shows_errors(server, page):
    page.goto(server.url + "/")
    page.fill("#api-key", "wrong key")
    page.dispatch_event("#api-key", "change")
    page.fill("#input", "Hi")
    page.press("#input", "Enter")
    error = page.wait_for_selector(".msg.error", timeout=30_000)
    assert "API key" in error.text_content()
