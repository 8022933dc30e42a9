"""The lineage store on a real PostgreSQL (the production backend): the same queries, withdrawal and quarantine
as the SQLite unit suite, plus concurrent writers recording the same nodes and edges (retried tasks, parallel
commit tasks) without duplicates or errors.

Run: .venv/bin/python -m pytest tests/integration/test_lineage_postgres.py   (~5 s; skipped without PostgreSQL)
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import func, select

from tests.unit.registry.test_lineage import check_queries, ds
from trainforge.registry.lineage import LineageStore, edges

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_queries_postgres(postgres_url):
    check_queries(LineageStore(postgres_url))


def test_concurrent_writers_postgres(postgres_url):
    store = LineageStore(postgres_url)
    store.record_job("J", team="t", dataset=ds("d", "v1", "MIT", ["s0.arrow", "s1.arrow"]))

    def write(i: int) -> None:
        s = LineageStore(postgres_url)
        s.record_checkpoint("J", i % 4, team="t")
        s.record_resume("J", i % 4)
        s.record_promotion("J", i % 4, "t.m", 1 + i % 2, team="t")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(write, range(32)))
    with store.engine.connect() as conn:
        n_edges = conn.execute(select(func.count()).select_from(edges)).scalar_one()
    # trained-on + 4 steps x (produced-by, resumed-from) + one promoted-as per step (step s -> version 1 + s % 2)
    assert n_edges == 1 + 4 * 2 + 4
    assert len(store.trained_on("d")["affected"]) == 4 + 2
