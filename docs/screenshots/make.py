"""Regenerate the dashboard's screenshots in docs/screenshots/ (one PNG per section, and the
whole page).

It starts what the browser tests start: a real frontend and a real worker with the ``echo``
backend, in this process, on a new database of the PostgreSQL at ``$LOCALAI_TEST_DSN``
(default ``postgresql://postgres@127.0.0.1:5432/postgres``; the database is dropped at the
end), plus a model config that fails to load; then headless Chromium (``.ci/install-browser``)
opens the dashboard, types the API key, runs a chat in the playground, starts a slow cold
load (shown in progress) and one held at the end of its staging (its bytes shown) and saves the
PNGs; then it holds a two-turn conversation on the chat page (``chat.png``).

    python docs/screenshots/make.py
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the checkout: localai_tw, tests

import psycopg2  # noqa: E402
from twisted.internet import defer, task  # noqa: E402

from tests.integration.browser import Browser, missing  # noqa: E402
from tests.integration.inference_harness import ADMIN, Cluster, sha256_hex  # noqa: E402

SECTIONS = ("replicas", "nodes", "models", "playground")
WEIGHTS = b"echo weights " * 100


def admin(dsn: str, sql: str) -> None:
    connection = psycopg2.connect(dsn)
    connection.autocommit = True
    try:
        connection.cursor().execute(sql)
    finally:
        connection.close()


def hold_staging(frontend):
    """Hold the replica's cold loads where staging ends (before ``loading`` is recorded), so
    the page shows a load with its bytes staged; fire ``release`` to let them go on."""
    loads = frontend.replica.inference.loads
    staged, release = defer.Deferred(), defer.Deferred()
    progress = loads._progress

    async def held(model_name, attempt, phase=None, node_id=None):
        if phase == "loading" and model_name == "echo-stage":
            if not staged.called:
                staged.callback(None)
            await release
        await progress(model_name, attempt, phase, node_id)
    loads._progress = held
    return staged, release


async def shoot(dsn: str, base_dir: str) -> None:
    cluster = Cluster(dsn, base_dir)
    browser = None
    try:
        cluster.write_file("echo.bin", WEIGHTS)
        cluster.write_model("echo.yaml", (
            "name: echo-chat\nbackend: echo\nparameters:\n  model: echo.bin\n"
            f"files:\n  - path: echo.bin\n    sha256: '{sha256_hex(WEIGHTS)}'\n"
            "template:\n  chat_message: '{{.Content}}'\n  chat: '{{.Input}}'\n"
            "options: ['echo.dim:6']\n"))
        cluster.write_model("slow.yaml", (
            "name: echo-slow\nbackend: echo\nparameters:\n  model: echo.bin\n"
            f"files:\n  - path: echo.bin\n    sha256: '{sha256_hex(WEIGHTS)}'\n"
            "options: ['echo.load_delay_ms:8000']\n"))
        big = bytes(range(256)) * (16 * 1024)  # 4 MiB, staged while the shots are taken
        cluster.write_file("big.bin", big)
        cluster.write_model("big.yaml", (
            "name: echo-stage\nbackend: echo\nparameters:\n  model: big.bin\n"
            f"files:\n  - path: big.bin\n    sha256: '{sha256_hex(big)}'\n"))
        cluster.write_model("broken.yaml", "name: [unclosed\n")
        frontend = await cluster.frontend("replica-a")
        await cluster.worker("gpu-box-1", frontend, labels={"zone": "lab"})
        staged, release = hold_staging(frontend)
        browser = await Browser.start()

        def open_page(driver):
            driver.get(cluster.base_url(frontend) + "/")
            driver.find_element("css selector", "#api-key").send_keys(ADMIN)
            driver.find_element("css selector", "#key-save").click()
        await browser.call(open_page)
        await browser.wait_for(
            lambda d: "connected" in d.find_element("css selector", "#nodes-body").text,
            what="the node")

        def chat(driver):
            driver.find_element("css selector", "#play-input").send_keys(
                "hello from the playground")
            driver.find_element("css selector", "#play-send").click()
        await browser.call(chat)
        await browser.wait_for(
            lambda d: d.find_element("css selector", "#play-status").text.startswith(("done", "finished")),
            timeout=60, what="the chat reply")
        await browser.wait_for(
            lambda d: "gpu-box-1" in d.find_element("css selector",
                                                    'tr[data-model="echo-chat"]').text,
            what="the model loaded")

        def slow_load(driver):  # a cold load the Models section shows in progress
            driver.execute_script(
                "fetch('/v1/embeddings', {method: 'POST', headers: {'Content-Type':"
                " 'application/json', 'Authorization': 'Bearer ' +"
                " sessionStorage.getItem('localai-tw-api-key')},"
                " body: JSON.stringify({model: 'echo-slow', input: 'x'})});")
        await browser.call(slow_load)
        await browser.wait_for(
            lambda d: "loading" in d.find_element("css selector", "#loads").text,
            what="the slow load in progress")
        await browser.call(lambda d: d.execute_script(
            "fetch('/v1/embeddings', {method: 'POST', headers: {'Content-Type':"
            " 'application/json', 'Authorization': 'Bearer ' +"
            " sessionStorage.getItem('localai-tw-api-key')},"
            " body: JSON.stringify({model: 'echo-stage', input: 'x'})});"))
        await staged
        await browser.wait_for(
            lambda d: "staged" in d.find_element("css selector", "#loads").text,
            what="the staging load's bytes")

        def save(driver):
            driver.set_window_size(1400, 1500)  # every section whole, in one viewport
            for name in SECTIONS:
                element = driver.find_element("css selector", f"#{name}")
                element.screenshot(os.path.join(HERE, f"{name}.png"))
            driver.save_screenshot(os.path.join(HERE, "dashboard.png"))
        await browser.call(save)
        release.callback(None)
        await browser.wait_for(
            lambda d: d.find_element("css selector", "#loads").text == "none", timeout=60,
            what="the slow load finished")
        await shoot_chat(browser, cluster.base_url(frontend))
    finally:
        if browser is not None:
            await browser.stop()
        await cluster.close()


async def shoot_chat(browser, base: str) -> None:
    """The chat page (the key is the tab's already): a system prompt and two turns."""
    await browser.call(lambda d: (d.set_window_size(1100, 900),
                                  d.get(base + "/dashboard/chat.html")))
    await browser.wait_for(
        lambda d: d.find_elements("css selector", '#chat-model option[value="echo-chat"]'),
        what="the model in the picker")

    def system(driver):
        driver.find_element("css selector", "#chat-system-box summary").click()
        driver.find_element("css selector", "#chat-system").send_keys("You repeat what you read.")
    await browser.call(system)
    for turn, text in enumerate(("hello, what can you do?", "say it again"), start=1):
        def ask(driver, text=text):
            driver.find_element("css selector", "#chat-input").send_keys(text)
            driver.find_element("css selector", "#chat-send").click()
        await browser.call(ask)
        await browser.wait_for(
            lambda d, turn=turn: len(d.find_elements(
                "css selector", '#chat-log .msg[data-role="assistant"]')) == turn and
            d.find_element("css selector", "#chat-status").text.startswith("finished"),
            timeout=60, what=f"answer {turn}")
    await browser.call(lambda d: d.save_screenshot(os.path.join(HERE, "chat.png")))


def main(reactor) -> defer.Deferred:
    gaps = missing()
    if gaps:
        sys.exit(f"make.py needs {', '.join(gaps)}: bash .ci/install-browser")
    admin_dsn = os.environ.get("LOCALAI_TEST_DSN",
                               "postgresql://postgres@127.0.0.1:5432/postgres")
    name = "ltw_shots_" + uuid.uuid4().hex[:12]
    admin(admin_dsn, f'CREATE DATABASE "{name}"')
    dsn = psycopg2.extensions.make_dsn(admin_dsn, dbname=name)
    base_dir = tempfile.mkdtemp(prefix="localai-shots-")

    def drop(result):
        admin(admin_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        shutil.rmtree(base_dir, ignore_errors=True)
        print("saved", ", ".join(f"{s}.png" for s in SECTIONS + ("dashboard", "chat")), "in", HERE)
        return result
    return defer.ensureDeferred(shoot(dsn, base_dir)).addBoth(drop)


if __name__ == "__main__":
    task.react(main)
