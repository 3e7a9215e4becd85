"""The shared store of generated files (``frontend/api/generated.py``) on real PostgreSQL: what one
replica stores another reads; rows expire; the total stays under its bound, newest kept."""

from __future__ import annotations

import pytest
import pytest_twisted

from localai_tw.frontend.api.generated import GeneratedFiles


@pytest_twisted.ensureDeferred
async def test_stored_by_one_store_read_by_another(db):
    png = b"\x89PNG\r\n\x1a\n" + b"x" * 100
    name = await GeneratedFiles(db).put(png, "image/png", ".png")
    assert name.endswith(".png") and len(name) == 36
    content_type, data, left = await GeneratedFiles(db).get(name)
    assert (content_type, data) == ("image/png", png) and 3500 < left <= 3600
    assert await GeneratedFiles(db).get("0" * 32 + ".png") is None
    assert await GeneratedFiles(db).get("../" + name) is None


@pytest_twisted.ensureDeferred
async def test_expired_files_are_not_served_and_are_dropped(db):
    store = GeneratedFiles(db, ttl=0)
    name = await store.put(b"a", "image/png", ".png")
    assert await store.get(name) is None
    await GeneratedFiles(db).put(b"b", "image/png", ".png")
    rows = await db.runQuery("SELECT count(*) FROM generated_files WHERE name = %s", (name,))
    assert rows[0][0] == 0


@pytest_twisted.ensureDeferred
async def test_the_total_stays_under_its_bound_newest_kept(db):
    store = GeneratedFiles(db, max_total_bytes=250)
    names = [await store.put(bytes([i]) * 100, "image/png", ".png") for i in range(4)]
    rows = await db.runQuery("SELECT sum(size), count(*) FROM generated_files")
    assert rows[0] == (200, 2)
    assert await store.get(names[0]) is None and await store.get(names[1]) is None
    assert (await store.get(names[3]))[1] == bytes([3]) * 100
    with pytest.raises(ValueError):
        await store.put(b"x" * 251, "image/png", ".png")
    with pytest.raises(ValueError):
        await store.put(b"x", "text/html", ".html")
