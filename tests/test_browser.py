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


DUO = MEMBERS[:2]  # a second ensemble, loaded only if a request names it


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    members = [arg for name in MEMBERS for arg in ("-m", name)]
    extra = (*members, "--ensemble", f"duo={','.join(DUO)}")
    with live_server(tmp_path_factory.mktemp("browser-server"), extra_args=extra) as running:
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


# Plain fusion of the three embedded members, greedy: a prompt on which more than one member wins a round.
PLAIN_PROMPT = "Write a short poem about the sea."
PLAIN_TOKENS = "56"


def open_page(browser, server, query=""):
    """The web view at `query`, with the API key in localStorage (as after a user typed it once) and the
    members listed; the browser log of the keyless first visit is dropped."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(server.url + "/")
    browser.execute_script("localStorage.setItem('segfuse-api-key', arguments[0])", server.api_key)
    browser.get_log("browser")
    browser.get(server.url + "/" + query)
    WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#legend .member input"))


def ask(browser, question, max_tokens, temperature="0"):
    """Send `question` with these settings and wait for the answer's chart: the finished answer's turn."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    before = len(browser.find_elements(By.CSS_SELECTOR, ".turn.assistant"))
    for field, value in (("max-tokens", max_tokens), ("temperature", temperature)):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    browser.find_element(By.ID, "prompt").send_keys(question)
    browser.find_element(By.ID, "send").click()
    WebDriverWait(browser, 400).until(
        lambda d: (
            len(turns := d.find_elements(By.CSS_SELECTOR, ".turn.assistant")) > before
            and turns[-1].find_elements(By.CSS_SELECTOR, ".summary .bar")
        )
    )
    assert "error" not in browser.find_element(By.ID, "status").get_attribute("class")
    return browser.find_elements(By.CSS_SELECTOR, ".turn.assistant")[-1]


def control(browser):
    """The fusion control as the page shows it: mode, margin (None while disabled), ticked members."""
    from selenium.webdriver.common.by import By

    margin = browser.find_element(By.ID, "margin")
    return {
        "mode": browser.find_element(By.CSS_SELECTOR, "input[name=mode]:checked").get_attribute("value"),
        "margin": None if not margin.is_enabled() else margin.get_attribute("value"),
        "members": [b.get_attribute("value") for b in browser.find_elements(By.CSS_SELECTOR, "#legend input:checked")],
    }


def query(browser):
    from urllib.parse import parse_qs, urlsplit

    return {k: v[0] for k, v in parse_qs(urlsplit(browser.current_url).query).items()}


def check_plain_fusion(browser, turn):
    """A plain-fusion answer: segments of at least two members, each in its member's legend colour, and
    its rounds listed, each put to a vote among every member's draft; the winners wrote the segments."""
    from selenium.webdriver.common.by import By

    assert turn.find_element(By.CLASS_NAME, "who").text == "ensemble · plain fusion"
    segments = turn.find_elements(By.CSS_SELECTOR, ".answer .seg")
    authors = [s.get_attribute("data-model") for s in segments]
    assert len(set(authors)) >= 2, f"one author only: {authors}: {turn.text}"
    legend = {
        label.text: label.find_element(By.CLASS_NAME, "swatch").value_of_css_property("background-color")
        for label in browser.find_elements(By.CSS_SELECTOR, "#legend .member")
    }
    assert len(set(legend.values())) == len(MEMBERS)
    for segment, author in zip(segments, authors):
        assert segment.value_of_css_property("border-bottom-color") == legend[author]

    rounds = turn.find_element(By.CSS_SELECTOR, "details.rounds")
    rounds.find_element(By.TAG_NAME, "summary").click()  # open the list: who drafted what, the scores
    entries = rounds.find_elements(By.CSS_SELECTOR, "ol > li")
    assert entries and entries[0].is_displayed()
    assert len(entries) >= len({s.get_attribute("data-round") for s in segments})
    assert {e.get_attribute("data-decision") for e in entries} == {"vote"}
    assert set(authors) <= {e.get_attribute("data-winner") for e in entries}
    for entry in entries:
        rows = entry.find_elements(By.CSS_SELECTOR, "tbody tr")
        assert sorted(r.find_element(By.TAG_NAME, "td").text.rstrip(" ✓") for r in rows) == sorted(MEMBERS)
        assert len(entry.find_elements(By.CSS_SELECTOR, "tr.won")) == 1
        box = entry.rect  # every row shown inside its round's entry (to a pixel: tables round their borders)
        for row in rows:
            assert box["y"] - 1 <= row.rect["y"] and row.rect["y"] + row.rect["height"] <= box["y"] + box["height"] + 1
        assert "put to a vote" in entry.find_element(By.CLASS_NAME, "caption").text
    return authors


def test_the_control_switches_to_plain_fusion_and_keeps_it_in_the_url(server, browser, tmp_path):
    from selenium.webdriver.common.by import By

    open_page(browser, server)
    assert control(browser) == {"mode": "leader", "margin": None, "members": MEMBERS}
    assert query(browser) == {}

    browser.find_element(By.CSS_SELECTOR, "input[name=mode][value=consult]").click()
    assert control(browser) == {"mode": "consult", "margin": "2", "members": MEMBERS}
    assert query(browser) == {"mode": "consult", "margin": "2"}

    # Two of three members: the API fuses every member or lets one answer alone, so Send waits.
    boxes = browser.find_elements(By.CSS_SELECTOR, "#legend input")
    boxes[0].click()
    assert query(browser) == {"mode": "consult", "margin": "2", "members": ",".join(MEMBERS[1:])}
    assert not browser.find_element(By.ID, "send").is_enabled()
    assert "error" in browser.find_element(By.ID, "fusion-note").get_attribute("class")
    boxes[0].send_keys(" ")  # the keyboard ticks it again
    assert query(browser) == {"mode": "consult", "margin": "2"}
    assert browser.find_element(By.ID, "send").is_enabled()

    browser.find_element(By.CSS_SELECTOR, "input[name=mode][value=plain]").click()
    assert control(browser) == {"mode": "plain", "margin": None, "members": MEMBERS}
    assert query(browser) == {"mode": "plain"}

    turn = ask(browser, PLAIN_PROMPT, PLAIN_TOKENS)
    authors = check_plain_fusion(browser, turn)
    assert browser.save_screenshot(str(tmp_path / "segfuse-plain-fusion.png"))
    print(f"authors: {authors}")
    problems = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not problems, problems


def test_the_url_sets_the_control(server, browser):
    from selenium.webdriver.common.by import By

    # One member ticked: that member answers alone (the request's model), whatever the mode.
    open_page(browser, server, f"?mode=consult&margin=1.5&members={MEMBERS[1]}")
    assert control(browser) == {"mode": "consult", "margin": "1.5", "members": [MEMBERS[1]]}
    turn = ask(browser, "Say hello.", "8")
    assert turn.find_element(By.CLASS_NAME, "who").text == f"{MEMBERS[1]} alone"
    assert {s.get_attribute("data-model") for s in turn.find_elements(By.CSS_SELECTOR, ".answer .seg")} == {MEMBERS[1]}

    open_page(browser, server, f"?mode=plain&members={','.join(MEMBERS)}")
    assert control(browser) == {"mode": "plain", "margin": None, "members": MEMBERS}
    assert query(browser) == {"mode": "plain", "members": ",".join(MEMBERS)}  # loading leaves the link as it was
    check_plain_fusion(browser, ask(browser, PLAIN_PROMPT, PLAIN_TOKENS))
    problems = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not problems, problems


def test_the_model_picker_shows_each_ensembles_members_and_keeps_the_choice_in_the_url(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    open_page(browser, server, "?model=duo&mode=plain")
    picker = Select(browser.find_element(By.ID, "model"))
    assert [o.get_attribute("value") for o in picker.options] == ["segfuse", "duo"]
    assert picker.first_selected_option.get_attribute("value") == "duo"
    assert control(browser) == {"mode": "plain", "margin": None, "members": DUO}
    # duo's members are the default model's too: loaded once, at start, for both.
    assert browser.find_element(By.ID, "status").text == f"{len(DUO)} members ready"
    picker.select_by_value("segfuse")
    assert control(browser)["members"] == MEMBERS
    assert query(browser) == {"mode": "plain"}  # the default model is left out of the link
    picker.select_by_value("duo")
    assert query(browser) == {"mode": "plain", "model": "duo"}
    problems = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not problems, problems


def test_the_model_picker_shows_each_models_state_and_loads_or_frees_the_picked_one(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    open_page(browser, server, "?model=duo")
    shown = lambda d: d.find_element(By.ID, "model-state").text
    WebDriverWait(browser, 30).until(lambda d: shown(d) in ("idle", "loaded"))
    assert [o.text for o in Select(browser.find_element(By.ID, "model")).options] == ["segfuse (idle)", "duo (idle)"]
    browser.find_element(By.ID, "free-model").click()
    WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, "status").text == "duo: unloaded")
    assert shown(browser) == "unloaded"
    assert server.health()["memory"][DUO[0]]["state"] == "unloaded"
    browser.find_element(By.ID, "load-model").click()
    WebDriverWait(browser, 120).until(lambda d: d.find_element(By.ID, "status").text == "duo: idle")
    assert shown(browser) == "idle" and server.health()["memory"][DUO[0]]["loads"] == 2
    problems = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not problems, problems
