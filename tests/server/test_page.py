"""The chat page at GET /, in headless Chromium against a real `kvflow serve` on 127.0.0.1.

The default model answers (the fast mode, as `kvflow serve` runs it: the agent server); that server reads a
probe written by the fixture (KVFLOW_PROBE), so each answer is set against known machine limits. The API key and --no-metrics cases run
on the tiny random model. Set KVFLOW_UI_SCREENSHOT=path to keep the two-turn screenshot (docs/ui.png).
"""

from __future__ import annotations

import os
import re
import shutil
import time

import httpx
import pytest
from playwright.sync_api import Page, expect, sync_playwright

from server.browser import launch_chromium
from server.conftest import PROBE_BANDWIDTH_GB_S
from server.server_process import KeyedServerProcess

ANSWER_TIMEOUT_MS = 120_000


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as playwright:
        chromium = launch_chromium(playwright)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def page_server(agent_server):
    return agent_server  # the default model in the fast mode, its page set against PROBE_BANDWIDTH_GB_S


@pytest.fixture
def page(browser, page_server) -> Page:
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    page.dialogs = []  # any alert() would be script injection
    page.on("dialog", lambda d: (page.dialogs.append(d.message), d.dismiss()))
    page.goto(page_server.base_url + "/")
    expect(page.locator("#model-name")).to_contain_text("smollm2-135m")
    page.fill("#temperature", "0")
    yield page
    context.close()


def send(page: Page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def answer(page: Page, n: int):
    """The n-th answer (from 0), once its timing line is there."""
    message = page.locator(".message.assistant").nth(n)
    expect(message.locator(".timing")).to_be_visible(timeout=ANSWER_TIMEOUT_MS)
    return message


def test_a_two_turn_chat_streams_answers_with_where_their_time_went(page, page_server, tmp_path):
    # Count the answer's text updates as they arrive: a streamed answer grows in several steps.
    page.evaluate("""() => {
        window.updates = 0;
        new MutationObserver(() => { window.updates += 1; })
            .observe(document.getElementById('messages'), {subtree: true, characterData: true, childList: true});
    }""")
    send(page, "What is the capital of France?")
    first = answer(page, 0)
    assert "Paris" in first.locator(".text").inner_text()
    assert page.evaluate("window.updates") >= 4
    timing = first.locator(".timing")
    text = timing.inner_text()
    for part in ("queue", "TTFT", "prefill", "tok/s", "decode", "TPOT"):
        assert part in text, text
    prompt_tokens = int(timing.get_attribute("data-prompt-tokens"))
    completion = int(timing.get_attribute("data-completion-tokens"))
    assert prompt_tokens > 10 and completion > 1
    expect(first.locator(".timebar .decode")).to_have_count(1)

    # The decode ceiling the page states is the probe's bandwidth over the weights and K/V a step reads.
    limits = httpx.get(page_server.base_url + "/kvflow/live", timeout=10).json()["limits"]["model"]
    step_bytes = limits["weight_bytes_per_step"] + limits["kv_bytes_per_token"] * (prompt_tokens + completion / 2)
    ceiling = PROBE_BANDWIDTH_GB_S * 1e9 / step_bytes
    stated = re.search(r"decode at (\d+)% of what memory bandwidth allows \(([\d,]+) tok/s\)", text)
    assert stated, text
    assert int(stated.group(2).replace(",", "")) == round(ceiling)

    send(page, "And the capital of Germany?")
    second = answer(page, 1)
    cached = int(second.locator(".timing").get_attribute("data-cached-tokens"))
    assert cached >= 16  # the first turn's full blocks came from the prefix cache
    assert f"({cached} from the prefix cache)" in second.locator(".timing").inner_text()

    # The live panel: the engine's gauges and the steps it ran, prompt tokens against decode tokens.
    expect(page.locator("#running")).to_have_text("0", timeout=10_000)
    page.wait_for_function(  # the panel has polled since the second answer: its prefix hits counted
        "n => /\\(([\\d,]+) of/.test(document.getElementById('prefix-hits').textContent) && "
        "Number(/\\(([\\d,]+) of/.exec(document.getElementById('prefix-hits').textContent)[1].replace(/,/g, '')) >= n",
        arg=cached, timeout=10_000)
    steps = page.evaluate("state.steps")
    assert any(s["prefill_tokens"] > 0 for s in steps) and any(s["decode_tokens"] > 0 for s in steps)
    expect(page.locator("#machine")).to_contain_text(f"{PROBE_BANDWIDTH_GB_S:.1f} GB/s")

    shot = tmp_path / "ui.png"
    page.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000
    if os.environ.get("KVFLOW_UI_SCREENSHOT"):
        shutil.copy(shot, os.environ["KVFLOW_UI_SCREENSHOT"])


def _running(server) -> float:
    return server.metric("kvflow:num_requests_running")


def test_stop_mid_answer_frees_the_request(page, page_server):
    aborted = page_server.metric("kvflow:request_success_total", 'finished_reason="abort"')
    page.fill("#max_tokens", "2000")
    send(page, "Write a very long story about a dragon who learns to cook, with many chapters.")
    message = page.locator(".message.assistant").nth(0)
    expect(message.locator(".text")).to_have_text(re.compile(r"\S{3,}.*\S{3,}", re.S), timeout=ANSWER_TIMEOUT_MS)
    assert _running(page_server) == 1
    page.click("#stop")
    expect(message).to_have_attribute("data-finish", "stopped", timeout=10_000)
    expect(page.locator("#send")).to_be_visible()
    deadline = time.monotonic() + 10
    while _running(page_server) != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running(page_server) == 0
    assert page_server.metric("kvflow:request_success_total", 'finished_reason="abort"') == aborted + 1
    expect(page.locator("#running")).to_have_text("0", timeout=10_000)
    length = len(message.locator(".text").inner_text())
    time.sleep(0.5)
    assert len(message.locator(".text").inner_text()) == length  # nothing arrives after the stop


def test_what_the_model_and_the_user_write_is_shown_as_text(page):
    trap = "<img src=x onerror=\"alert('user')\"> and <b>bold</b>"
    send(page, f"Write a minimal HTML page with a <script> tag that calls alert('hi'). Only the code. {trap}")
    message = answer(page, 0)
    assert "<script>" in message.locator(".text").inner_text()  # the model wrote a script tag...
    assert page.locator(".message.user .text").inner_text().endswith(trap)
    assert page.evaluate("document.scripts.length") == 1  # ...and only the page's own script exists
    assert page.locator("#messages img, #messages b, #messages script").count() == 0
    assert page.dialogs == []


def test_regenerate_replaces_the_last_answer_and_copy_copies_it(page):
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    send(page, "Name a primary colour.")
    first = answer(page, 0).locator(".text").inner_text()
    page.click(".regenerate")
    expect(page.locator(".message.assistant")).to_have_count(1)
    again = answer(page, 0)
    assert again.locator(".text").inner_text() == first  # greedy: the same answer again
    again.locator(".copy").click()
    expect(again.locator(".copy")).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == first
    page.click("#new-chat")
    expect(page.locator(".message")).to_have_count(0)


@pytest.fixture(scope="module")
def keyed_plain_server(tiny_model_dir):
    server = KeyedServerProcess("page-key", "--model", str(tiny_model_dir), "--kv-cache-memory", "64MiB",
                                "--no-metrics", "--root-path", "/kv")
    yield server
    server.stop()


def test_the_page_asks_for_the_key_and_without_metrics_is_a_plain_chat(browser, keyed_plain_server):
    base = keyed_plain_server.base_url
    assert httpx.get(base + "/metrics", headers=keyed_plain_server.auth_headers()).status_code == 404
    # The page and its files are open under the root path; the data behind them is not.
    page_html = httpx.get(base + "/kv/", headers={"Accept": "text/html"}, timeout=10)
    assert page_html.status_code == 200 and '<base href="/kv/">' in page_html.text
    assert httpx.get(base + "/kv/ui/app.js", timeout=10).status_code == 200
    assert httpx.get(base + "/kv/kvflow/live", timeout=10).status_code == 401
    assert httpx.post(base + "/kv/kvflow/probe", timeout=10).status_code == 401
    context = browser.new_context()
    page = context.new_page()
    page.goto(base + "/kv/")  # under --root-path: the page's requests go there too
    dialog = page.locator("#key-dialog")  # the page's first request was refused: it asks for the key
    expect(dialog).to_be_visible(timeout=10_000)
    page.fill("#api-key", "page-key")
    dialog.locator("button").click()
    expect(page.locator("#model-name")).to_contain_text("tiny-llama")  # from /v1/models, with the key
    expect(page.locator("#live")).to_be_hidden()  # metrics off: no live panel
    page.fill("#max_tokens", "8")
    send(page, "hello")
    message = answer(page, 0)
    assert message.locator(".text").inner_text() != ""
    assert "decode 8 tokens" in message.locator(".timing").inner_text()
    assert page.evaluate("sessionStorage.getItem('kvflow-api-key')") == "page-key"
    assert page.locator("#key-dialog").is_hidden()
    context.close()
