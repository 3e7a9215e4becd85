"""Schema migrations: numbered SQL files applied in order, once, under an advisory lock.

Files live in ``localai_tw/db/migrations`` and are named ``NNNN_description.sql``.  All pending
files are applied inside ONE transaction that first takes the transaction-level advisory lock
``LOCK_SCHEMA_MIGRATE``, so two replicas starting at once serialise: the second waits, then finds
nothing left to do.  A database whose recorded version is newer than the newest file this code
knows is refused: running old code against a newer schema would silently misread it.

Never edit a file that has shipped; add a new number instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources

from twisted.logger import Logger

from .pool import LOCK_SCHEMA_MIGRATE, Database

log = Logger()

_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


class SchemaTooNew(Exception):
    """The database was migrated by a newer version of localai-tw."""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def load_migrations(package: str = "localai_tw.db.migrations") -> list[Migration]:
    """The known migrations in version order; refuses gaps, duplicates and odd names."""
    found: dict[int, Migration] = {}
    for entry in resources.files(package).iterdir():
        if not entry.name.endswith(".sql"):
            continue
        m = _NAME.match(entry.name)
        if m is None:
            raise ValueError(f"migration file {entry.name!r} is not named NNNN_description.sql")
        version = int(m.group(1))
        if version in found:
            raise ValueError(f"two migration files claim version {version}")
        found[version] = Migration(version, m.group(2), entry.read_text(encoding="utf-8"))
    ordered = [found[v] for v in sorted(found)]
    for expected, mig in enumerate(ordered, start=1):
        if mig.version != expected:
            raise ValueError(f"migration versions must be 1..N without gaps; missing {expected}")
    return ordered


async def migrate(db: Database, migrations: list[Migration] | None = None) -> int:
    """Apply every pending migration; return the schema version afterwards."""
    if migrations is None:
        migrations = load_migrations()
    newest_known = migrations[-1].version if migrations else 0

    async def apply(cursor) -> int:
        await cursor.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_SCHEMA_MIGRATE,))
        await cursor.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations ("
            " version integer PRIMARY KEY,"
            " name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        await cursor.execute("SELECT coalesce(max(version), 0) FROM schema_migrations")
        current = (cursor.fetchall())[0][0]
        if current > newest_known:
            raise SchemaTooNew(
                f"the database schema is at version {current}, newer than this localai-tw "
                f"knows (up to {newest_known}); upgrade this replica instead of running it "
                "against a newer schema"
            )
        for mig in migrations:
            if mig.version <= current:
                continue
            log.info("applying schema migration {version} ({name})",
                     version=mig.version, name=mig.name)
            await cursor.execute(mig.sql)
            await cursor.execute(
                "INSERT INTO schema_migrations (version, name) VALUES (%s, %s)",
                (mig.version, mig.name),
            )
            current = mig.version
        return current

    return await db.runInteraction(apply)
