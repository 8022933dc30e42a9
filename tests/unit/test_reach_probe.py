"""A node agent's reach probes (trainforge/infra/backends/reach_probe.py) on this host's loopback: a listener is
reached, a closed port is not, and the prober reports a peer only after FAILED_ROUNDS failed rounds, once."""

from __future__ import annotations

import socket
import threading
import time

from trainforge.infra.backends.reach_probe import (
    ProbeListener,
    Prober,
    format_peers,
    parse_peers,
    probe_round,
)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_listener_is_reached_and_a_closed_port_is_not():
    listener = ProbeListener()
    try:
        peers = {"up": ("127.0.0.1", listener.port), "down": ("127.0.0.1", _closed_port())}
        assert probe_round(peers, timeout_s=1.0) == {"down"}
        assert probe_round({f"up{i}": ("127.0.0.1", listener.port) for i in range(200)}, timeout_s=2.0) == set()
    finally:
        listener.close()


def test_the_go_lines_peers_round_trip_and_a_malformed_entry_is_skipped():
    peers = {"h1": ("10.200.3.1", 4100), "h2": ("10.200.3.2", 4200)}
    assert parse_peers(format_peers(peers)) == peers
    assert parse_peers("h1=10.0.0.1:80,bad,h3=:1,h4=1.2.3.4:x") == {"h1": ("10.0.0.1", 80)}


def test_the_prober_reports_a_peer_after_consecutive_failed_rounds_and_again_when_it_is_back():
    listener = ProbeListener()
    down_port = _closed_port()
    reports: list[tuple[list[str], dict[str, float]]] = []
    seen = threading.Event()

    def report(down: list[str], failing_s: dict[str, float]) -> None:
        reports.append((down, failing_s))
        seen.set()

    prober = Prober({"up": ("127.0.0.1", listener.port), "down": ("127.0.0.1", down_port)}, report,
                    interval_s=0.05, timeout_s=0.5, rounds=3).start()
    try:
        assert seen.wait(5.0)
        down, failing_s = reports[0]
        assert down == ["down"] and failing_s["down"] >= 0.1  # three rounds: two intervals at least
        time.sleep(0.3)
        assert len(reports) == 1  # reported when the set changes, not every round
        assert prober.sent >= 6
    finally:
        prober.stop()
        listener.close()
