"""The chat page at `/` in a real browser: the system's Chromium driven by Playwright.

The page is one static file served by the app; the test types a message, sees the answer stream in
(text appears while the request is still open), and reads the tokens/s line. Then: markdown and code are
rendered (a fence still open mid-stream is code so far) and never as raw HTML, each answer shows its time to
first token and tokens/s, conversations survive a reload (localStorage) and can be switched and deleted, the
model picker lists the served LoRA adapters, and the sampling settings and system prompt go into the request.
"""
from __future__ import annotations

import json
import shutil

import pytest

from _checkpoints import checkpoint
from _peft_loras import peft_lora
from _server import API_KEY, start_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def server(request):
    return start_server(request, "--lora", f"one={peft_lora('qwen3', seed=1)}")


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


def fresh(server, page) -> None:
    """The page with nothing stored but the right API key."""
    page.goto(server.url + "/")
    page.evaluate(f"localStorage.clear(); localStorage.setItem('nanoplug-api-key', {json.dumps(API_KEY)})")
    page.reload()
    page.wait_for_function("document.querySelectorAll('#model option').length == 2")


def test_markdown_and_code_render_as_dom_never_as_html(server, page):
    fresh(server, page)
    got = page.evaluate("""() => {
        const div = document.createElement('div');
        renderMarkdown('## Title\\n\\nSome **bold**, *it*, `x < y` and [a link](https://example.org).\\n' +
                       '- one\\n- two\\n\\n<img src=x onerror="window.pwned=1"><script>window.pwned=1</script>\\n' +
                       '[bad](javascript:alert(1))\\n```python\\nif a < b:\\n    print("<b>")', div);  // the fence still open
        return {h: div.querySelector('h3').textContent, strong: div.querySelector('strong').textContent,
                em: div.querySelector('em').textContent, code: div.querySelector('p code').textContent,
                href: div.querySelector('a').href, links: div.querySelectorAll('a').length,
                items: [...div.querySelectorAll('ul li')].map(li => li.textContent),
                pre: div.querySelector('pre code').textContent, lang: div.querySelector('pre code').dataset.lang,
                unsafe: div.querySelectorAll('img, script').length, text: div.textContent, pwned: window.pwned || 0};
    }""")
    assert got["h"] == "Title" and got["strong"] == "bold" and got["em"] == "it" and got["code"] == "x < y"
    assert got["href"] == "https://example.org/" and got["links"] == 1 and got["items"] == ["one", "two"]
    assert got["pre"] == 'if a < b:\n    print("<b>")' and got["lang"] == "python"
    assert got["unsafe"] == 0 and got["pwned"] == 0 and "<script>" in got["text"] and "javascript:" in got["text"]


def test_streamed_markdown_is_rendered_with_its_ttft_and_rate(server, page):
    fresh(server, page)
    chunks = ["Here:\n```py\nprint(1)", "\n```\nand **done**"]
    events = "".join(f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': c}}]})}\n\n" for c in chunks)
    events += f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': 9, 'prompt_tokens': 3}})}\n\ndata: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(status=200, body=events,
                                                                     headers={"content-type": "text/event-stream"}))
    try:
        page.fill("#input", "Show code")
        page.press("#input", "Enter")
        answer = page.wait_for_selector(".assistant[data-done]", timeout=30_000)
        assert answer.query_selector("pre code").text_content() == "print(1)"
        assert answer.query_selector("strong").text_content() == "done"
        stats = page.text_content("#log .stats:last-child")
        assert "9 tokens" in stats and "TTFT" in stats and "tok/s" in stats, stats
    finally:
        page.unroute("**/v1/chat/completions")


def test_picker_settings_and_conversations_kept_in_the_browser(server, page):
    fresh(server, page)
    options = page.eval_on_selector_all("#model option", "os => os.map(o => [o.value, o.textContent])")
    assert options == [[checkpoint("qwen3"), checkpoint("qwen3")], ["one", f"one (LoRA on {checkpoint('qwen3')})"]]
    page.select_option("#model", "one")
    page.fill("#temperature", "0")
    page.fill("#top-p", "0.9")
    page.fill("#max-tokens", "3")
    page.fill("#system", "Answer briefly.")
    for field in ("#temperature", "#top-p", "#max-tokens", "#system"):
        page.dispatch_event(field, "change")
    sent = []
    page.on("request", lambda r: sent.append(json.loads(r.post_data)) if r.url.endswith("/chat/completions") else None)
    page.fill("#input", "Hi")
    page.press("#input", "Enter")
    page.wait_for_selector(".assistant[data-done]", timeout=60_000)
    body = sent[-1]
    assert body["model"] == "one" and body["temperature"] == 0 and body["top_p"] == 0.9 and body["max_tokens"] == 3
    assert body["messages"] == [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"}]
    stats = page.text_content("#log .stats:last-child")
    assert "3 tokens" in stats and "TTFT" in stats and "tok/s" in stats, stats
    answer = page.text_content(".assistant[data-done]")

    page.reload()  # everything comes back from localStorage
    page.wait_for_function("document.querySelectorAll('#model option').length == 2")
    assert page.text_content("#side .conv span") == "Hi"
    assert page.text_content(".msg.user") == "Hi" and page.text_content(".assistant") == answer
    assert page.input_value("#model") == "one" and page.input_value("#system") == "Answer briefly."
    assert page.input_value("#top-p") == "0.9" and page.input_value("#max-tokens") == "3"
    page.click("#clear")  # a second conversation
    page.fill("#input", "Second")
    page.press("#input", "Enter")
    page.wait_for_selector(".assistant[data-done]", timeout=60_000)
    assert page.eval_on_selector_all("#side .conv span", "s => s.map(x => x.textContent)") == ["Second", "Hi"]
    page.click("#side .conv:nth-child(2)")
    assert page.text_content(".msg.user") == "Hi"
    page.click("#side .conv:nth-child(2) button.delete")
    assert page.eval_on_selector_all("#side .conv span", "s => s.map(x => x.textContent)") == ["Second"]
    assert len(json.loads(page.evaluate("localStorage.getItem('nanoplug-conversations')"))) == 1
    server.wait_idle()
