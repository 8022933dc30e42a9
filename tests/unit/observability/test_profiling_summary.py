"""Profile summaries: interval unions and overlap (communication hidden under compute), the merge across ranks
(slowest rank per step, straggler, achieved vs peak FLOP/s), window parsing.

Run: .venv/bin/python -m pytest tests/unit/observability -q
"""

from __future__ import annotations

import json

import pytest

from trainforge.trainer.profiling import (
    merge_folder,
    merge_summaries,
    overlap_length,
    parse_window,
    summarize_intervals,
    union_length,
)


def test_union_and_overlap():
    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4
    assert union_length([]) == 0
    assert overlap_length([(0, 2), (4, 6)], [(1, 5)]) == 2
    s = summarize_intervals(comm=[(1, 3), (5, 6)], compute=[(0, 2), (2.5, 4)])
    assert s["comm_s"] == 3 and s["comm_hidden_s"] == 1.5 and s["comm_exposed_s"] == 1.5
    assert s["overlap_fraction"] == pytest.approx(0.5)


@pytest.mark.parametrize(("text", "window"), [("3:5", (3, 5)), ("7:7", (7, 7)), ("", None), (None, None)])
def test_parse_window(text, window):
    assert parse_window(text) == window


@pytest.mark.parametrize("text", ["5", "a:b", "5:3", "0:2"])
def test_parse_window_rejects(text):
    with pytest.raises(ValueError, match="profile window"):
        parse_window(text)


def summary(rank, times, overlap=0.5, achieved=1e9):
    return {"rank": rank, "window": [3, 4], "step_times": times, "overlap_fraction": overlap, "comm_exposed_s": 0.1,
            "achieved_flops": achieved, "peak_flops": 4e9}


def test_merge_names_the_straggler(tmp_path):
    merged = merge_summaries([summary(0, {"3": 1.0, "4": 1.0}), summary(1, {"3": 1.5, "4": 1.2}, 0.3, 3e9)])
    assert merged["slowest_rank_per_step"]["3"]["rank"] == 1
    assert merged["straggler_rank"] == 1
    assert merged["overlap_fraction_mean"] == pytest.approx(0.4)
    assert merged["achieved_fraction_of_peak"] == pytest.approx(0.5)
    for r, s in enumerate([summary(0, {"3": 1.0}), summary(1, {"3": 2.0})]):
        (tmp_path / f"rank{r}.summary.json").write_text(json.dumps(s))
    assert merge_folder(tmp_path)["straggler_rank"] == 1
    assert json.loads((tmp_path / "summary.json").read_text())["ranks"] == [0, 1]
    assert merge_summaries([]) == {}
