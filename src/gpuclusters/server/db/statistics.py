"""Keep PostgreSQL's planner statistics up to date with the fleet.

PostgreSQL plans each query from per-table statistics that ANALYZE
gathers; autovacuum refreshes them once a table has changed by 10 % (plus
50 rows), looking at most once a minute. A fleet grows faster than that: a
burst of cluster creates takes ``nodes`` from empty to thousands of rows in
seconds, and until the statistics catch up the planner believes the table
is as small as it was. Placement's "which hosts are free" query then runs as
a nested loop over every node for every host: measured on 10,000 hosts and
9,000 nodes, **9.2 s** a query with the statistics of an empty table, 6 ms
after ANALYZE. The creates queue behind it (it runs under the placement
guard), which is what made them take half a minute each at 10,000 nodes.

So every server checks ``pg_stat_user_tables`` every few seconds and
analyzes the tables that changed by autovacuum's own measure
(``n_mod_since_analyze`` over 50 rows + 10 % of the table) since their last
analysis, by itself or by autovacuum. ANALYZE samples at most 30,000 rows,
so it costs milliseconds at this scale; a table nobody writes is never
analyzed again. Replicas may both analyze a table once; that is harmless.
SQLite plans without statistics (it prefers indexes), so nothing is done
there.
"""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

log = logging.getLogger(__name__)

# autovacuum_analyze_threshold and autovacuum_analyze_scale_factor's defaults.
BASE_ROWS = 50
SCALE = 0.1

_STALE = text(
    "SELECT relname FROM pg_stat_user_tables "
    "WHERE n_mod_since_analyze > :base + :scale * n_live_tup ORDER BY relname"
)


async def analyze_stale(engine: AsyncEngine) -> list[str]:
    """ANALYZE the tables whose statistics are stale; their names."""
    if engine.dialect.name != "postgresql":
        return []
    async with engine.connect() as conn:
        names = list((await conn.execute(_STALE, {"base": BASE_ROWS, "scale": SCALE})).scalars())
        for name in names:
            # A name from the catalogue, quoted as an identifier.
            await conn.execute(text(f'ANALYZE "{name.replace(chr(34), chr(34) * 2)}"'))
        await conn.commit()
    return names


async def keep_statistics(engine: AsyncEngine, interval_s: float) -> None:
    """Run ``analyze_stale`` every ``interval_s`` until cancelled."""
    if engine.dialect.name != "postgresql":
        return
    while True:
        try:
            tables = await analyze_stale(engine)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the database is away: try again later
            log.warning("could not refresh planner statistics: %s", exc)
        else:
            if tables:
                log.debug("analyzed %s", ", ".join(tables))
        await asyncio.sleep(interval_s)
