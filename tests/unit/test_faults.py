"""Fault-injection parsing and the object-store outage window (the chaos suite's instrument must be exact)."""

from __future__ import annotations

import pytest

from trainforge.infra.storage.local import LocalObjectStore
from trainforge.trainer import faults
from trainforge.trainer.faults import Fault, FaultInjector, StoreOutage, parse_faults


def test_parse_faults_reads_every_parameter():
    assert parse_faults("kill:rank=1:step=25, storeout:rank=0:step=7:until=12,slow:step=3:ms=40") == [
        Fault("kill", 1, 25), Fault("storeout", 0, 7, until=12), Fault("slow", 0, 3, ms=40)]


@pytest.mark.parametrize("text", ["boom:step=1", "storeout:rank=0:step=7"])
def test_parse_faults_rejects_unknown_kinds_and_windowless_outages(text):
    with pytest.raises(ValueError):
        parse_faults(text)


def test_outage_opens_at_the_first_write_and_closes_at_the_until_step(tmp_path):
    store = LocalObjectStore(tmp_path / "store")
    injector = FaultInjector(parse_faults("storeout:rank=0:step=2:until=5"), str(tmp_path / "run"), rank=0)
    try:
        injector.maybe_fire(1)
        store.put_bytes("a", b"1")  # before the fault: writes work
        injector.maybe_fire(2)
        with pytest.raises(StoreOutage):
            store.put_bytes("b", b"2")
        assert store.get_bytes("a") == b"1"  # reads work during the outage
        injector.maybe_fire(3)
        with pytest.raises(StoreOutage):
            store.put_bytes("b", b"2")
        injector.maybe_fire(5)
        store.put_bytes("b", b"2")
        assert store.get_bytes("b") == b"2"
    finally:
        faults.end_store_outage()
