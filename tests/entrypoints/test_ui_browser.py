"""The web page in a real browser: Debian's chromium, headless, driven by Selenium through the
system's chromedriver, against `tokenwise serve` on the built-in model behind an API key.

One walk through the page, in order: a wrong key is refused and the right one accepted; a chat
message streams an answer (with its token counts, time to first token and tok/s); the stop
button aborts a long answer and the server's running count returns to 0 with one abort
counted; the completions tab streams a continuation; the engine view's timeline and table show
the steps of a request sent meanwhile (its exact prompt length as a prefill step). Screenshots
of each view go to `test-artifacts/ui/` (git-ignored; printed at the end) or $UI_ARTIFACTS.

`make setup` installs chromium and chromium-driver when they are missing (root with apt-get).
Without them the test fails under CI (CI=true), so a CI machine never passes by skipping it,
and is skipped elsewhere with the reason.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.entrypoints._server import RemoteServer, metric_value
from tokenwise.default_model import DEFAULT_MODEL_DIR

KEY = "browser-test-key"
NAME = "tokenwise-default"
ARTIFACTS = Path(os.environ.get("UI_ARTIFACTS", Path(__file__).parents[2] / "test-artifacts/ui"))
# The built-in model has no chat template: this one writes the conversation as Python comments
# (the model writes Python) and opens a function for the answer.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}\n"
    "{% else %}# {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}def {% endif %}"
)
WAIT_S = 30.0


def _missing() -> str | None:
    """Why the browser test cannot run here, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "the selenium package is not installed (pip install -e '.[dev]')"
    for tool, package in (("chromium", "chromium"), ("chromedriver", "chromium-driver")):
        if shutil.which(tool) is None:
            return (
                f"{tool} is not on PATH (apt-get install {package}; `make setup` does it as root)"
            )
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    reason = _missing()
    if reason is not None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"the browser test must run in CI, but {reason}")
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument("--window-size=1400,1000")
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    model_dir = tmp_path_factory.mktemp("ui-browser") / "default-chat"
    shutil.copytree(DEFAULT_MODEL_DIR, model_dir)
    (model_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    with RemoteServer(str(model_dir), "--api-key", KEY, "--served-model-name", NAME) as srv:
        yield srv


def wait_for(condition: Any, what: str, timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def screenshot(browser: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def set_field(browser: Any, element_id: str, value: str) -> None:
    field = browser.find_element("id", element_id)
    field.clear()
    field.send_keys(value)


def test_the_page_in_a_browser(server: RemoteServer, browser: Any) -> None:
    by_id = lambda element_id: browser.find_element("id", element_id)  # noqa: E731
    browser.get(server.url("/"))

    # The key: asked for, a wrong one refused (the page says so), the right one accepted.
    wait_for(lambda: by_id("key-dialog").is_displayed(), "the API key dialog")
    set_field(browser, "key-input", "not-the-key")
    by_id("key-submit").click()
    wait_for(lambda: "refused" in by_id("key-message").text, "the page to report a refused key")
    assert by_id("key-dialog").is_displayed()
    screenshot(browser, "api-key")
    set_field(browser, "key-input", KEY)
    by_id("key-submit").click()
    wait_for(lambda: by_id("model").get_attribute("value") == NAME, "the model list")
    assert not by_id("key-dialog").is_displayed()

    # A chat message streams an answer, with its figures.
    by_id("ignore-eos").click()  # the built-in model may end a file at once otherwise
    set_field(browser, "max-tokens", "40")
    set_field(browser, "chat-input", "print the first ten fibonacci numbers")
    by_id("chat-send").click()
    stats = wait_for(
        lambda: browser.find_elements("css selector", "#chat-log .msg.assistant .stats"),
        "the answer's statistics",
    )
    answer = browser.find_element("css selector", "#chat-log .msg.assistant .content").text
    assert answer.strip(), "the assistant's answer is empty"
    assert re.search(
        r"\d+ prompt \+ 40 output tokens · time to first token [\d.]+ s · [\d.]+ tok/s · "
        r"finish: length",
        stats[0].text,
    ), stats[0].text
    screenshot(browser, "chat")

    # Stop aborts a long answer: the server's running count returns to 0, one abort counted.
    set_field(browser, "max-tokens", "1000")
    set_field(browser, "chat-input", "write a long module")
    by_id("chat-send").click()
    contents = lambda: browser.find_elements("css selector", "#chat-log .msg.assistant .content")  # noqa: E731
    wait_for(lambda: len(contents()) == 2 and len(contents()[1].text) > 20, "a streaming answer")
    assert metric_value(server.metrics(), "tokenwise:num_requests_running") == 1
    by_id("chat-stop").click()
    stats = wait_for(
        lambda: browser.find_elements("css selector", "#chat-log .msg.assistant .stats")[1:],
        "the stopped answer's statistics",
    )
    assert "stopped" in stats[0].text, stats[0].text
    wait_for(
        lambda: metric_value(server.metrics(), "tokenwise:num_requests_running") == 0,
        "the server's running count to return to 0",
        timeout=10,
    )
    aborts = metric_value(
        server.metrics(), "tokenwise:request_success_total", finished_reason="abort"
    )
    assert aborts == 1

    # The completions tab streams a continuation of its prompt.
    by_id("tab-button-completions").click()
    set_field(browser, "max-tokens", "32")
    by_id("completion-send").click()
    wait_for(lambda: "finish: length" in by_id("completion-stats").text, "the completion")
    generated = browser.find_element("css selector", "#completion-output .generated").text
    assert generated, "the completion's text is empty"
    screenshot(browser, "completions")

    # The engine view shows the steps of a request sent while it is open.
    by_id("tab-button-engine").click()
    prompt = "class Stack:\n    def push(self, item):"
    usage = httpx.post(
        server.url("/v1/completions"),
        json={"prompt": prompt, "max_tokens": 12, "ignore_eos": True, "temperature": 0},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    ).json()["usage"]
    prefill = str(usage["prompt_tokens"])
    rows = wait_for(
        lambda: browser.find_elements("css selector", f'#steps-table tr[data-prefill="{prefill}"]'),
        f"a step row with the request's {prefill}-token prefill",
    )
    assert rows[0].find_elements("tag name", "td")[2].text == "1"  # one request in that step
    bars = browser.find_elements("css selector", f'#timeline g.step[data-prefill="{prefill}"]')
    assert bars, "the timeline has no bar for the request's prefill step"
    decodes = browser.find_elements("css selector", '#timeline g.step[data-decode="1"]')
    assert len(decodes) >= 11  # its 11 decode steps (and the chat's before them)
    wait_for(lambda: by_id("summary-num-running").text == "0", "the summary's running count")
    grid = browser.find_elements("css selector", "#kv-grids rect")
    assert len(grid) > 0 and len(grid) == int(
        httpx.get(server.url("/ui/api/engine"), headers={"Authorization": f"Bearer {KEY}"}).json()[
            "ranks"
        ][0]["num_total_blocks"]
    )
    screenshot(browser, "engine")
    print(f"\nbrowser screenshots: {ARTIFACTS}")
