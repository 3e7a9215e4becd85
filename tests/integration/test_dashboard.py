"""The dashboard (``/dashboard/``, and ``/`` for a browser) driven in headless Chromium against
a real in-process frontend and a real worker with the ``echo`` backend: the operator types the
API key once, sees the node and its presence, approves a pending node with the button, and runs
a chat in the playground that streams the echo reply into the page."""

from __future__ import annotations

import json
import os

import pytest
import pytest_twisted
import treq
from twisted.internet import defer

from localai_tw.cluster.nodes import NodeStatus
from localai_tw.config import PortRange
from localai_tw.worker.service import makeWorkerService

from .harness_dashboard import browser, click, open_with_key, text_of  # noqa: F401 (fixture)
from .harness_echo import WEIGHTS, echo_model
from .inference_harness import ADMIN, TOKEN, _ports, sha256_hex
from .support import eventually

ECHO_MODEL = echo_model("echo-chat")


@pytest_twisted.ensureDeferred
async def test_root_is_the_page_for_a_browser_and_json_for_api_clients(cluster):
    frontend = await cluster.frontend("replica-r")
    base = cluster.base_url(frontend)
    page = await treq.get(base + "/", headers={
        "Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"})
    html = await page.text()
    assert page.code == 200 and page.headers.getRawHeaders("content-type")[0].startswith(
        "text/html")
    assert "<title>localai-tw dashboard</title>" in html
    assert ADMIN not in html  # the page is static: no secret in it
    assert "frame-ancestors 'none'" in page.headers.getRawHeaders("content-security-policy")[0]
    for accept in (None, "*/*", "application/json"):
        answer = await treq.get(base + "/", headers={"Accept": accept} if accept else {})
        assert answer.code == 200
        assert json.loads(await answer.content())["admin_api"] == "/api/nodes"
    script = await treq.get(base + "/dashboard/app.js")
    assert script.code == 200 and "getReader" in (await script.text())
    listing = await treq.get(base + "/dashboard/../")
    assert listing.code in (200, 404)  # normalised to / or refused, never a file listing
    missing = await treq.get(base + "/dashboard/nope.js")
    assert missing.code == 404


@pytest.mark.browser
@pytest_twisted.ensureDeferred
async def test_dashboard_shows_the_node_and_streams_a_chat(cluster, browser):
    cluster.write_file("echo.bin", WEIGHTS)
    # 150 ms per word: slow enough to see the reply arrive word by word.
    cluster.write_model("echo.yaml", ECHO_MODEL.replace(
        "options: ['echo.dim:6']", "options: ['echo.dim:6', 'echo.delay_ms:150']"))
    cluster.write_model("broken.yaml", "name: [unclosed\n")
    frontend = await cluster.frontend("replica-d")
    await cluster.worker("w-dash", frontend)
    await open_with_key(browser, cluster.base_url(frontend) + "/")

    presence = await browser.wait_for(
        lambda d: "connected" in text_of('tr[data-node="w-dash"] .presence')(d) and
        text_of('tr[data-node="w-dash"] .presence')(d), what="the node, connected")
    assert presence == "connected"
    # Admitted by registration alone (no --require-approval): the page says nobody approved it.
    approval = await browser.wait_for(text_of('tr[data-node="w-dash"] .approval'),
                                      what="the node's approval")
    assert "new, unapproved" in approval
    replica = await browser.wait_for(text_of('tr[data-replica="replica-d"]'),
                                     what="the replica row")
    assert "w-dash" in replica  # the worker it holds
    await browser.wait_for(text_of('tr[data-model="echo-chat"]'), what="the model")
    errors = await browser.wait_for(text_of("#model-errors"), what="the failed config")
    assert "broken.yaml" in errors

    def ask(driver):
        driver.find_element("css selector", "#play-input").send_keys(
            "one two three four five six")
        driver.find_element("css selector", "#play-send").click()
    await browser.call(ask)
    # Streamed: part of the reply is on the page while the rest is still coming.
    partial = await browser.wait_for(
        lambda d: not text_of("#play-status")(d).startswith(("finished", "done")) and
        text_of("#play-output")(d), timeout=60, what="the first words of the reply")
    assert "one two three four five six".startswith(partial) and partial != \
        "one two three four five six"
    reply = await browser.wait_for(
        lambda d: text_of("#play-status")(d).startswith(("finished", "done")) and
        text_of("#play-output")(d), timeout=60, what="the streamed reply")
    assert reply == "one two three four five six"
    # The chat cold-loaded the model on the worker: the page says where it is loaded.
    loaded = await browser.wait_for(
        lambda d: "w-dash" in text_of('tr[data-model="echo-chat"]')(d) and
        text_of('tr[data-model="echo-chat"]')(d), what="where the model is loaded")
    assert "not loaded" not in loaded
    # The streamed chat is among the recent requests (/api/traces), without its prompt.  Not
    # necessarily the newest: the page's own /v1/models poll is traced too, and one that lands
    # after the chat comes first (seen under load).
    def chat_trace(driver):
        from selenium.common.exceptions import StaleElementReferenceException
        try:
            for row in driver.find_elements("css selector", "#traces-body tr"):
                if "echo-chat" in row.text:
                    return row.get_attribute("data-trace"), row.text
        except StaleElementReferenceException:
            return None  # re-rendered meanwhile: the next poll looks again
        return None

    trace_id, trace = await browser.wait_for(chat_trace, what="the chat among the recent requests")
    assert "chat" in trace and "w-dash" in trace and "owner" in trace and "200" in trace
    assert "one two" not in await browser.call(text_of("#traces-body"))
    # Its time in each hop: it drove the cold load (with its phases), then streamed.
    hops = await browser.call(text_of(f'#traces-body tr[data-trace="{trace_id}"] .hops'))
    assert "cold load" in hops and "staging" in hops and "backend" in hops, hops
    assert "1st token" in hops, hops


@pytest.mark.browser
@pytest_twisted.ensureDeferred
async def test_pending_node_is_approved_with_the_button(cluster, browser):
    frontend = await cluster.frontend("replica-p", **{"require-approval": True})
    first = next(_ports)
    worker = makeWorkerService(
        {"register-to": cluster.base_url(frontend), "registration-token": TOKEN,
         "node-name": "w-pending", "node-type": "backend",
         "backend-port-range": PortRange(first, first + 15), "labels": {},
         "data-dir": os.path.join(cluster.base_dir, "w-pending")}, frontend._reactor)
    worker.startService()
    cluster.workers.append(worker)
    node_id = await eventually(lambda: worker.registrar.registration
                               and worker.registrar.registration.node_id,
                               timeout=20, what="w-pending registered")
    # Without the key the page shows nothing of the cluster, and says why.
    await browser.call(lambda d: d.get(cluster.base_url(frontend) + "/dashboard/"))
    status = await browser.wait_for(
        lambda d: "API key" in text_of("#status")(d) and text_of("#status")(d),
        what="the request for the key")
    assert "enter the admin API key" in status
    assert "w-pending" not in await browser.call(text_of("#nodes-body"))
    await open_with_key(browser, cluster.base_url(frontend) + "/dashboard/")

    approval = await browser.wait_for(text_of('tr[data-node="w-pending"] .approval'),
                                      what="the pending node")
    assert approval == "pending"
    await browser.wait_for(click('button.approve[data-node="w-pending"]'), what="the click")
    nodes = frontend.replica.nodes

    async def healthy():
        node = await nodes.get_node(node_id)
        return node if node.status is NodeStatus.HEALTHY else None
    node = await eventually(healthy, timeout=20, what="w-pending healthy in the database")
    assert node.approved
    await browser.wait_for(lambda d: text_of('tr[data-node="w-pending"] .approval')(d)
                           == "healthy", what="the page showing it healthy")
    # Drain: no new work for it, in the database too.
    await browser.wait_for(click('button.drain[data-node="w-pending"]'), what="the drain click")

    async def draining():
        return (await nodes.get_node(node_id)).status is NodeStatus.DRAINING
    await eventually(draining, timeout=20, what="w-pending draining in the database")
    await browser.wait_for(lambda d: text_of('tr[data-node="w-pending"] .approval')(d)
                           == "draining", what="the page showing it draining")


@pytest.mark.browser
@pytest_twisted.ensureDeferred
async def test_a_departed_worker_is_reconnecting_with_the_grace_left_never_failed(
        cluster, browser):
    frontend = await cluster.frontend("replica-g")
    worker = await cluster.worker("w-away", frontend)
    await open_with_key(browser, cluster.base_url(frontend) + "/dashboard/")
    await browser.wait_for(lambda d: text_of('tr[data-node="w-away"] .presence')(d)
                           == "connected", what="the node, connected")
    await worker.stopService()  # its tunnel leaves; the grace (90 s) starts
    presence = await browser.wait_for(
        lambda d: "reconnecting" in text_of('tr[data-node="w-away"] .presence')(d) and
        text_of('tr[data-node="w-away"] .presence')(d), what="the node, reconnecting")
    left = int(presence.split("(")[1].split(" s ")[0])
    assert 60 < left <= 90, presence
    row = await browser.call(text_of('tr[data-node="w-away"]'))
    assert "fail" not in row.lower()  # away within the grace is not a failure


@pytest.mark.browser
@pytest_twisted.ensureDeferred
async def test_a_worker_away_longer_than_the_grace_is_gone_never_failed(cluster, browser):
    """A tiny grace on purpose (0.5 s): the departed node passes reconnecting and ends gone."""
    frontend = await cluster.frontend("replica-gone", **{"reconnect-grace": 0.5})
    worker = await cluster.worker("w-gone", frontend)
    await open_with_key(browser, cluster.base_url(frontend) + "/dashboard/")
    await browser.wait_for(lambda d: text_of('tr[data-node="w-gone"] .presence')(d)
                           == "connected", what="the node, connected")
    await worker.stopService()  # its tunnel leaves and never comes back
    presence = await browser.wait_for(
        lambda d: text_of('tr[data-node="w-gone"] .presence')(d).startswith("gone") and
        text_of('tr[data-node="w-gone"] .presence')(d), what="the node, gone")
    assert presence == "gone (away longer than the grace)"
    badge = await browser.call(lambda d: d.execute_script(
        "return document.querySelector('tr[data-node=\"w-gone\"] .presence .badge')"
        ".className"))
    assert "gone" in badge.split() and "reconnecting" not in badge
    row = await browser.call(text_of('tr[data-node="w-gone"]'))
    assert "fail" not in row.lower() and "reconnecting" not in row.lower()


@pytest.mark.browser
@pytest_twisted.ensureDeferred
async def test_a_cold_load_shows_its_progress_until_the_model_is_loaded(cluster, browser):
    cluster.write_file("echo.bin", WEIGHTS)
    cluster.write_model("slow.yaml", ECHO_MODEL.replace("echo-chat", "echo-slow").replace(
        "options: ['echo.dim:6']", "options: ['echo.dim:6', 'echo.load_delay_ms:6000']"))
    frontend = await cluster.frontend("replica-c")
    await cluster.worker("w-cold", frontend)
    await open_with_key(browser, cluster.base_url(frontend) + "/dashboard/")
    await browser.wait_for(text_of('tr[data-model="echo-slow"]'), what="the model listed")

    def ask(driver):
        driver.find_element("css selector", "#play-input").send_keys("warm up")
        driver.find_element("css selector", "#play-send").click()
    await browser.call(ask)  # the first request cold-loads the model
    load = await browser.wait_for(
        lambda d: "loading" in text_of('[data-load="echo-slow"]')(d) and
        text_of('[data-load="echo-slow"]')(d), what="the cold load in progress")
    assert "w-cold" in load and "phase 4 of 4" in load
    bar = await browser.call(lambda d: d.execute_script(
        "return document.querySelector('[data-load=\"echo-slow\"] progress').value"))
    assert bar == 3  # three phases done: full only once loaded
    reply = await browser.wait_for(
        lambda d: text_of("#play-status")(d).startswith(("finished", "done")) and
        text_of("#play-output")(d), timeout=60, what="the reply after the load")
    assert reply == "warm up"
    await browser.wait_for(lambda d: text_of("#loads")(d) == "none", what="the load gone")


@pytest.mark.browser
@pytest_twisted.ensureDeferred
async def test_a_staging_load_shows_the_bytes_staged_as_a_bar(cluster, browser):
    """The load is held where its staging ends (before ``loading`` is recorded), so the page
    is read while the load is still in its ``staging`` phase with every byte moved."""
    big = bytes(range(256)) * (8 * 1024)  # 2 MiB
    cluster.write_file("big.bin", big)
    cluster.write_model("big.yaml", ECHO_MODEL.replace("echo-chat", "echo-big")
                        .replace("echo.bin", "big.bin")
                        .replace(sha256_hex(WEIGHTS), sha256_hex(big)))
    frontend = await cluster.frontend("replica-s")
    await cluster.worker("w-stage", frontend)
    loads = frontend.replica.inference.loads
    staged, release = defer.Deferred(), defer.Deferred()
    progress = loads._progress

    async def held(model_name, attempt, phase=None, node_id=None):
        if phase == "loading":
            staged.callback(None)
            await release
        await progress(model_name, attempt, phase, node_id)
    loads._progress = held
    asking = treq.post(cluster.base_url(frontend) + "/v1/embeddings",
                       json.dumps({"model": "echo-big", "input": "x"}).encode(),
                       headers={"Authorization": f"Bearer {ADMIN}",
                                "Content-Type": "application/json"})
    try:
        await staged
        await open_with_key(browser, cluster.base_url(frontend) + "/dashboard/")
        text = await browser.wait_for(text_of('[data-load="echo-big"] .staging'),
                                      what="the staging bar")
        assert text == "2.0 of 2.0 MiB staged at " + text.split(" at ")[1]
        value, top = await browser.call(lambda d: d.execute_script(
            "const p = document.querySelector('[data-load=\"echo-big\"] .staging progress');"
            " return [p.value, p.max];"))
        assert value == top == len(big)
    finally:
        if not release.called:
            release.callback(None)
    answer = await asking
    assert answer.code == 200
    await treq.content(answer)
    await browser.wait_for(lambda d: text_of("#loads")(d) == "none", what="the load gone")


@pytest_twisted.ensureDeferred
async def test_the_loads_route_the_page_polls_needs_the_admin_key(cluster):
    frontend = await cluster.frontend("replica-k")
    url = cluster.base_url(frontend) + "/api/cluster/loads"
    refused = await treq.get(url)
    assert refused.code == 401
    answer = await treq.get(url, headers={"Authorization": f"Bearer {ADMIN}"})
    assert answer.code == 200
    assert json.loads(await answer.content()) == {"loads": [], "downloads": []}


@pytest.mark.browser
@pytest_twisted.ensureDeferred
async def test_the_unload_button_stops_a_loaded_model_and_the_page_sees_it_go(cluster, browser):
    """Break: make the button call a route that answers 200 without asking the worker (or
    drop the button): the row, the backend and the page assertions go red."""
    from localai_tw.backends import backend_pb2

    from .inference_harness import supervisor_of

    cluster.write_file("echo.bin", WEIGHTS)
    cluster.write_model("echo.yaml", ECHO_MODEL)
    frontend = await cluster.frontend("replica-u")
    worker = await cluster.worker("w-unload", frontend)
    await frontend.replica.inference.predict("echo-chat",
                                             backend_pb2.PredictOptions(Prompt="warm"))
    assert [b["model"] for b in supervisor_of(worker).list()] == ["echo-chat"]
    await open_with_key(browser, cluster.base_url(frontend) + "/dashboard/")
    await browser.wait_for(click('button.unload[data-node="w-unload"][data-model="echo-chat"]'),
                           what="the unload click")
    where = await browser.wait_for(
        lambda d: "not loaded" in text_of('tr[data-model="echo-chat"]')(d) and
        text_of('tr[data-model="echo-chat"]')(d), what="the model gone from the page")
    assert "w-unload" not in where
    assert await cluster.rows("echo-chat") == []
    assert supervisor_of(worker).list() == []  # the worker stopped its backend
    assert "error" not in (await browser.call(
        lambda d: d.find_element("css selector", "#status").get_attribute("class")) or "")


@pytest.mark.browser
@pytest_twisted.ensureDeferred
async def test_a_model_download_shows_its_bytes_until_it_is_done(cluster, browser):
    """issue 11 §4: a download_files entry being fetched (held half-way by the test's server)
    is shown with its file and bytes, and goes when it is done."""
    from twisted.internet import reactor
    from twisted.web import server

    from localai_tw.backends import backend_pb2

    from .harness_downloads import WEIGHTS as FILE
    from .harness_downloads import FileServer, download_model

    site = server.Site(FileServer())
    port = reactor.listenTCP(0, site, interface="127.0.0.1")
    served = site.resource
    served.files["weights.bin"] = FILE
    base = f"http://127.0.0.1:{port.getHost().port}"
    try:
        cluster.write_model("dl.yaml", download_model(f"{base}/held/weights.bin",
                                                      sha256_hex(FILE)))
        frontend = await cluster.frontend("replica-d")
        await cluster.worker("w-dl", frontend)
        await open_with_key(browser, cluster.base_url(frontend) + "/dashboard/")
        asked = frontend.replica.inference.predict("dl", backend_pb2.PredictOptions(Prompt="x"))
        row = text_of('[data-download="dl/dl/weights.bin"]')
        shown = await browser.wait_for(lambda d: "0.5 MiB of 1.0 MiB" in (row(d) or "") and
                                       row(d), what="the download shown, half-way")
        assert "downloading dl/weights.bin" in shown
        served.release.callback(None)
        await asked
        await browser.wait_for(lambda d: text_of("#loads")(d) == "none", what="the download gone")
    finally:
        if not served.release.called:
            served.release.callback(None)
        await port.stopListening()
