"""The users' pages (issue 24 §6) in headless Chromium against a real in-process frontend and
a real worker with the ``echo`` backend (which answers the prompt it was given, so a reply
shows what the page sent): the chat page streams an answer, sends the history and the system
prompt on the next turn, and stops an answer with its button; the gallery page finds an entry
by its search box and installs it, showing the job's progress until it is done."""

from __future__ import annotations

import json
import os

import pytest
import pytest_twisted
import treq
import yaml

from .harness_dashboard import browser, by_css, click, text_of  # noqa: F401 (fixture)
from .harness_downloads import files  # noqa: F401 (fixture)
from .harness_echo import WEIGHTS, echo_model
from .harness_gallery import SMALL, entry, model_files
from .inference_harness import ADMIN, sha256_hex
from .support import eventually

#: 300 ms a word: a reply is seen part-way for seconds, however slow the machine's polls are.
SLOW_ECHO = echo_model("echo-chat").replace(
    "options: ['echo.dim:6']", "options: ['echo.dim:6', 'echo.delay_ms:300']")


async def open_page(browser, url: str, key: str = ADMIN) -> None:
    """Load the page and enter the key, as a user does once per tab."""
    await browser.call(lambda d: d.get(url))
    field = await browser.wait_for(by_css("#api-key"), what="the key field")
    await browser.call(lambda d: (field.send_keys(key), d.find_element(
        "css selector", "#key-save").click()))


def say(text: str):
    def type_and_send(driver):
        box = driver.find_element("css selector", "#chat-input")
        box.send_keys(text)
        driver.find_element("css selector", "#chat-send").click()
    return type_and_send


def status_starts(prefix: str):
    return lambda d: text_of("#chat-status")(d).startswith(prefix) and \
        text_of("#chat-status")(d)


def assistant_texts(driver) -> list[str]:
    return [e.text for e in driver.find_elements(
        "css selector", '#chat-log .msg[data-role="assistant"] .text')]


@pytest.mark.browser
@pytest_twisted.ensureDeferred
async def test_a_chat_streams_and_its_second_turn_carries_the_history(cluster, browser):
    """Red when the page sends only the last message (the second reply lacks the first
    turn), drops the system prompt, or waits for the whole answer (no partial text).  The
    first turn's cold load is shown from the replica's ``: loading model`` comments."""
    cluster.write_file("echo.bin", WEIGHTS)
    # A cold load longer than the replica's loading-notice interval (3 s): the page says so.
    cluster.write_model("echo.yaml", SLOW_ECHO.replace(
        "'echo.delay_ms:300'", "'echo.delay_ms:300', 'echo.load_delay_ms:4500'"))
    frontend = await cluster.frontend("replica-chat")
    await cluster.worker("w-chat", frontend)
    await open_page(browser, cluster.base_url(frontend) + "/dashboard/chat.html")
    stored = await browser.call(lambda d: d.execute_script(
        "return [sessionStorage.getItem('localai-tw-api-key'),"
        " localStorage.getItem('localai-tw-api-key')]"))
    assert stored == [ADMIN, None]  # this tab only: "remember" was not ticked
    await browser.wait_for(lambda d: d.execute_script(
        "return [...document.querySelectorAll('#chat-model option')].map(o => o.value)"
        ".includes('echo-chat')"), what="the model in the picker")

    def system_prompt(driver):
        driver.find_element("css selector", "#chat-system-box summary").click()
        driver.find_element("css selector", "#chat-system").send_keys("be brief")
    await browser.call(system_prompt)
    await browser.call(say("one two three four five six"))
    loading = await browser.wait_for(status_starts("loading model echo-chat"), timeout=60,
                                     what="the cold load's notice")
    assert loading.endswith(" s)"), loading
    # Streamed: part of the answer is on the page while the rest is still coming.
    partial = await browser.wait_for(
        lambda d: text_of("#chat-status")(d) == "streaming" and
        (assistant_texts(d) or [""])[-1], timeout=60, what="the first words")
    await browser.wait_for(status_starts("finished"), timeout=60, what="the first answer")
    [first] = await browser.call(assistant_texts)
    assert first.startswith(partial) and first != partial
    assert "be brief" in first and "one two three four five six" in first

    await browser.call(say("seven eight"))
    await browser.wait_for(lambda d: len(assistant_texts(d)) == 2 and
                           status_starts("finished")(d), timeout=60, what="the second answer")
    second = (await browser.call(assistant_texts))[1]
    # The second request held the system prompt, the first turn (both sides) and the new one.
    assert "be brief" in second and "one two three four five six" in second
    assert second.rstrip().endswith("seven eight")
    roles = await browser.call(lambda d: [e.get_attribute("data-role") for e in
                                          d.find_elements("css selector", "#chat-log .msg")])
    assert roles == ["user", "assistant", "user", "assistant"]


@pytest.mark.browser
@pytest_twisted.ensureDeferred
async def test_stop_ends_the_answer_and_keeps_what_arrived(cluster, browser):
    """Red when Stop does not abort the fetch (the answer runs to its end: status
    ``finished``, trace 200) or the page loses the partial answer."""
    words = " ".join(f"w{i}" for i in range(40))
    cluster.write_file("echo.bin", WEIGHTS)
    # 1 s a word: the Stop click lands long before the 40 words are out, even under load.
    cluster.write_model("echo.yaml", SLOW_ECHO.replace("delay_ms:300", "delay_ms:1000"))
    frontend = await cluster.frontend("replica-stop")
    await cluster.worker("w-stop", frontend)
    await open_page(browser, cluster.base_url(frontend) + "/dashboard/chat.html")
    await browser.wait_for(text_of("#chat-model"), what="the model in the picker")
    await browser.call(say(words))
    await browser.wait_for(lambda d: (assistant_texts(d) or [""])[-1].startswith("w0 w1"),
                           timeout=60, what="the first words")
    assert await browser.call(lambda d: d.find_element(
        "css selector", "#chat-send").get_attribute("disabled")) is not None
    await browser.wait_for(click("#chat-stop"), what="the stop click")
    await browser.wait_for(lambda d: text_of("#chat-status")(d) == "stopped",
                           what="the answer stopped")
    [kept] = await browser.call(assistant_texts)
    assert words.startswith(kept) and kept != words
    stopped = await browser.call(lambda d: d.find_element(
        "css selector", '#chat-log .msg[data-role="assistant"]').get_attribute("class"))
    assert "stopped" in stopped.split()
    enabled = await browser.call(lambda d: [d.find_element("css selector", s).get_attribute(
        "disabled") for s in ("#chat-send", "#chat-stop")])
    assert enabled[0] is None and enabled[1] is not None
    # The replica saw the client leave (status 499 in its trace), not an answer run to its end.
    async def chat_trace():
        answer = await treq.get(cluster.base_url(frontend) + "/api/traces",
                                headers={"Authorization": f"Bearer {ADMIN}"})
        traces = json.loads(await answer.content())["traces"]
        return next((t for t in traces if t["endpoint"] == "chat"), None)
    trace = await eventually(chat_trace, timeout=20, what="the chat's trace")
    assert trace["status"] == "499" and trace["model"] == "echo-chat"
    use = frontend.replica.inference.use
    await eventually(lambda: not any(use.in_flight_counts().values()), timeout=20,
                     what="no request in flight any more")


@pytest.mark.browser
@pytest_twisted.ensureDeferred
async def test_the_gallery_page_searches_and_installs_with_progress(cluster, browser, files,
                                                                    tmp_path):
    """Red when the page stops polling the job (the row never reads ``done``) or installs
    without the key (401 shown in the row)."""
    weights = bytes(range(256)) * 4096  # 1 MiB, sent half then held
    files.files["a.bin"] = weights
    files.files["b.bin"] = SMALL
    index = tmp_path / "index.yaml"
    index.write_text(yaml.safe_dump([
        entry("alpha-chat", [("alpha/a.bin", f"{files.base}/held/a.bin", sha256_hex(weights))],
              description="a model that greets"),
        entry("beta-embed", [("beta/b.bin", f"{files.base}/files/b.bin", sha256_hex(SMALL))],
              description="vectors")]))
    frontend = await cluster.frontend("replica-gallery", galleries=[f"test=file://{index}"])
    await eventually(lambda: frontend.replica.gallery._subscription is not None, timeout=20,
                     what="the gallery listening")
    await open_page(browser, cluster.base_url(frontend) + "/dashboard/gallery.html")
    await browser.wait_for(text_of('tr[data-entry="beta-embed"]'), what="the entries")
    await browser.call(lambda d: d.find_element("css selector", "#gallery-search")
                       .send_keys("greets"))
    shown = await browser.wait_for(
        lambda d: [r.get_attribute("data-entry") for r in d.find_elements(
            "css selector", "#gallery-body tr")] == ["alpha-chat"] and "alpha-chat",
        what="the search leaving alpha-chat alone")
    assert shown == "alpha-chat"

    await browser.wait_for(click('button.install[data-id="test@alpha-chat"]'), what="install")
    progress = await browser.wait_for(
        lambda d: "downloading" in text_of('tr[data-entry="alpha-chat"] .state')(d) and
        "alpha/a.bin" in text_of('tr[data-entry="alpha-chat"] .state')(d) and
        text_of('tr[data-entry="alpha-chat"] .state')(d), timeout=30,
        what="the download's progress")
    assert "0.5 MiB of 1.0 MiB" in progress, progress
    bar = await browser.call(lambda d: d.execute_script(
        "return document.querySelector('tr[data-entry=\"alpha-chat\"] progress') !== null"))
    assert bar
    files.release.callback(None)
    await browser.wait_for(
        lambda d: text_of('tr[data-entry="alpha-chat"] .state')(d).startswith("done"),
        timeout=30, what="the install done")
    assert "alpha/a.bin" in model_files(cluster.models_dir)
    assert os.path.exists(os.path.join(cluster.models_dir, "alpha-chat.yaml"))
    await browser.call(lambda d: d.find_element("css selector", "#gallery-search").clear())
    button = await browser.wait_for(
        lambda d: text_of('button.install[data-id="test@alpha-chat"]')(d) == "Reinstall" and
        "Reinstall", what="the entry marked installed")
    assert button == "Reinstall"
