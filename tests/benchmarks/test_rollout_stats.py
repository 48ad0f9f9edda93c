"""The rollout benchmark's own arithmetic: splitting trajectories into turns, the core-timeline
summary and the search-call percentiles, on hand-made inputs."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from rollout_stats import TimedSearcher, core_timeline_stats, median_run, turns_of  # noqa: E402

from search_r1.agent.loop import SearchTrajectory as Trajectory  # noqa: E402


def test_turns_of_splits_at_each_model_token_after_an_observation():
    t = Trajectory(prompt_ids=[1, 2])
    t.append([10, 11, 12], model=True)
    t.append([90, 91], model=False)
    t.append([13], model=True)
    t.append([92], model=False)
    t.append([14, 15], model=True)  # the last turn: no observation after it
    assert turns_of(t) == [(3, [90, 91]), (1, [92]), (2, [])]
    assert turns_of(Trajectory(prompt_ids=[1])) == []


def test_core_timeline_stats_finds_the_tail_and_the_idle_gap():
    steps, t = [], 0.0
    for _ in range(100):              # the bulk: 256 sequences, 5 ms a step
        t += 0.005
        steps.append((t, 256))
    t += 0.200                        # the core idle for 200 ms (waiting for requests)
    steps.append((t, 256))
    for _ in range(20):               # the tail: 10 sequences, 4 ms a step
        t += 0.004
        steps.append((t, 10))
    s = core_timeline_stats(steps)
    assert s["core_steps"] == 121 and s["core_span_s"] == pytest.approx(t - 0.005, abs=1e-3)
    assert s["tail_steps"] == 20 and s["tail_s"] == pytest.approx(0.080, abs=1e-3)
    assert s["core_gaps_s"] == pytest.approx(0.195, abs=1e-3)  # the 200 ms gap less one 5 ms median step
    assert s["core_mean_batch"] == pytest.approx((101 * 256 + 20 * 10) / 121, abs=0.05)
    assert core_timeline_stats(steps[:1]) == {}


@pytest.mark.parametrize("durations", [[0.016, 0.0247], [0.03], [0.05, 0.01, 0.02, 0.2, 0.04]])
def test_search_call_percentiles_are_ordered(durations):
    searcher = TimedSearcher(inner=None)
    searcher.intervals = [(10.0 * i, 10.0 * i + d) for i, d in enumerate(durations)]
    ms = searcher.call_ms()
    assert min(durations) * 1000 <= ms["retrieval_call_ms_p50"] <= ms["retrieval_call_ms_p90"] <= max(durations) * 1000
    assert TimedSearcher(inner=None).call_ms() == {}


def test_median_run_of_an_even_count_is_the_faster_middle_one():
    runs = [(12.5, {"run": "a"}), (11.9, {"run": "b"})]
    assert median_run(runs) == (11.9, {"run": "b"}, [12.5, 11.9])  # every wall, in the order run
    runs = [(10.0, {"run": "a"}), (13.0, {"run": "b"}), (11.0, {"run": "c"}), (12.0, {"run": "d"})]
    assert median_run(runs)[0] == 11.0
    assert median_run(runs[:3])[0] == 11.0
