"""The web view in headless Chromium: ask a question, watch coloured segments stream in.

Needs the Debian packages `chromium` and `chromium-driver` (/usr/bin/chromium,
/usr/bin/chromedriver). The test installs nothing; without them it is skipped
with that reason. The screenshot lands in the test's temporary directory.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helpers import live_server
from segfuse import models as catalogue

pytestmark = [pytest.mark.models, pytest.mark.timeout(600)]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
MEMBERS = list(catalogue.DEFAULT_MODELS)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("browser-server")) as running:
        yield running


@pytest.fixture()
def browser(tmp_path):
    if not (Path(CHROMIUM).is_file() and Path(CHROMEDRIVER).is_file()):
        pytest.skip("headless Chromium not found: install the Debian packages chromium and chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--window-size=1200,900",
        f"--user-data-dir={tmp_path / 'profile'}",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


def test_page_streams_coloured_segments(server, browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(server.url + "/")
    # The page keeps the API key in localStorage, as after a user typed it once.
    browser.execute_script("localStorage.setItem('segfuse-api-key', arguments[0])", server.api_key)
    browser.get_log("browser")  # drop the 401 of the first, keyless visit
    browser.refresh()
    legend = WebDriverWait(browser, 30).until(
        lambda d: [e.text for e in d.find_elements(By.CSS_SELECTOR, "#legend .member")] or None
    )
    assert legend == MEMBERS

    tokens = browser.find_element(By.ID, "max-tokens")
    tokens.clear()
    tokens.send_keys("24")
    browser.find_element(By.ID, "prompt").send_keys("Name three primary colors.")
    browser.find_element(By.ID, "send").click()

    # The per-answer chart appears once the finish chunk arrived.
    WebDriverWait(browser, 400).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".turn.assistant .summary .bar"))
    segments = browser.find_elements(By.CSS_SELECTOR, ".turn.assistant .answer .seg")
    assert segments, browser.find_element(By.CSS_SELECTOR, ".turn.assistant").text
    authors = [s.get_attribute("data-model") for s in segments]
    assert set(authors) <= set(MEMBERS)
    backgrounds = {s.value_of_css_property("background-color") for s in segments}
    assert all(b not in ("rgba(0, 0, 0, 0)", "transparent") for b in backgrounds)
    if len(set(authors)) > 1:
        assert len(backgrounds) > 1, "different authors must get different colours"
    assert len(browser.find_elements(By.CSS_SELECTOR, ".turn.assistant .summary .bar")) == len(MEMBERS)
    assert "error" not in browser.find_element(By.ID, "status").get_attribute("class")

    answer_shot = tmp_path / "segfuse-answer.png"
    assert browser.save_screenshot(str(answer_shot))

    # Hovering a segment shows its round: the leader's draft alone (confidence gate), or every member's
    # candidate and the scores of a vote.
    ActionChains(browser).move_to_element(segments[0]).perform()
    tip = WebDriverWait(browser, 10).until(lambda d: (t := d.find_element(By.ID, "tip")).is_displayed() and t)
    assert "round 1" in tip.text and f"won by {authors[0]}" in tip.text
    rows = tip.find_elements(By.CSS_SELECTOR, "tbody tr")
    if "alone: the leader" in tip.text:  # confident, or answering alone (accept_margin 0)
        assert len(rows) == 1 and authors[0] == "qwen2.5-coder-0.5b"  # the largest member leads
    else:  # the others proposed: a vote, or the leader accepted none of their segments
        assert ("put to a vote" in tip.text or "accepted no proposal" in tip.text) and len(rows) == len(MEMBERS)

    shot = tmp_path / "segfuse-hover.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000

    # A follow-up with Hedge on: the conversation goes on and the chart adds the final weights.
    ActionChains(browser).move_by_offset(0, 300).perform()  # away from the segment: the tip hides
    browser.find_element(By.ID, "hedge").click()
    browser.find_element(By.ID, "prompt").send_keys("Which one is the warmest?")
    browser.find_element(By.ID, "send").click()
    WebDriverWait(browser, 400).until(
        lambda d: (
            len(d.find_elements(By.CSS_SELECTOR, ".turn.assistant .summary")) == 2
            and d.find_elements(By.CSS_SELECTOR, ".turn.assistant:nth-of-type(4) .bar")
        )
    )
    second = browser.find_elements(By.CSS_SELECTOR, ".turn.assistant")[1]
    assert "Hedge weights" in second.find_element(By.CLASS_NAME, "summary").text
    assert len(second.find_elements(By.CSS_SELECTOR, ".bar")) == 2 * len(MEMBERS)
    conversation = tmp_path / "segfuse-conversation.png"
    assert browser.save_screenshot(str(conversation))
    print(f"screenshots: {answer_shot} {shot} {conversation}")
    problems = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not problems, problems


def test_a_json_answer_is_shown_formatted(server, browser, tmp_path):
    import json

    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(server.url + "/")
    browser.execute_script("localStorage.setItem('segfuse-api-key', arguments[0])", server.api_key)
    browser.refresh()
    WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#legend .member"))
    tokens = browser.find_element(By.ID, "max-tokens")
    tokens.clear()
    tokens.send_keys("64")
    browser.find_element(By.ID, "json").click()  # response_format json_object
    browser.find_element(By.ID, "prompt").send_keys("Describe a cat as JSON with its name and age.")
    browser.find_element(By.ID, "send").click()
    block = WebDriverWait(browser, 400).until(
        lambda d: (found := d.find_elements(By.CSS_SELECTOR, ".turn.assistant .summary pre.json")) and found[0]
    )
    value = json.loads(block.text)
    assert isinstance(value, dict) and value
    assert "\n  " in block.text  # indented, one key per line
    text = browser.execute_script(
        "return Array.from(document.querySelectorAll('.turn.assistant .answer .seg'))"
        ".map((s) => s.textContent).join('')"
    )
    assert json.loads(text) == value  # the coloured segments still show who wrote what
    assert browser.save_screenshot(str(tmp_path / "segfuse-json.png"))
