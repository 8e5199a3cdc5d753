"""Where a generation's time went (agentic_es/generation_time.py): the straggler tail of a member, the share of the
members' wall time the pool ran with fewer members than engines, the generation record's time breakdown, its
console words and TensorBoard scalars, and bad inputs refused with a clear error. No engine: the smoke run's record
is checked in test_engine_pool.py."""

import pytest

from agentic_es import generation_time


def episodes(*ends_and_seconds, tokens=10):
    return [{"ended_s": end, "seconds": seconds, "completion_tokens": tokens} for end, seconds in ends_and_seconds]


def test_the_tail_share_runs_from_the_median_episode_s_end_to_the_last_over_the_rollout():
    assert generation_time.tail_share([1.0, 2.0, 10.0], 10.0) == pytest.approx(0.8)  # median 2, last 10
    assert generation_time.tail_share([1.0, 3.0, 5.0, 9.0], 10.0) == pytest.approx(0.5)  # median 4, last 9
    assert generation_time.tail_share([4.0, 4.0], 5.0) == 0.0  # no straggler
    assert generation_time.tail_share([0.0], 0.0) == 0.0  # a rollout too short to time waited on nothing


@pytest.mark.parametrize("ends, rollout, says", [
    ([], 1.0, "needs the end of at least one episode"),
    ([1.0, 3.0], 2.0, "episodes end within their rollout"),
    ([-1.0], 2.0, "episodes end within their rollout"),
])
def test_a_tail_share_of_impossible_ends_is_refused(ends, rollout, says):
    with pytest.raises(ValueError, match=says):
        generation_time.tail_share(ends, rollout)


def test_the_underfilled_share_counts_the_time_with_fewer_members_in_flight_than_engines():
    # two engines: members 0 and 1 together for 0..4, then member 1 alone until 10, then members 2 (and nothing)
    spans = [(0.0, 4.0), (0.0, 10.0), (4.0, 6.0)]
    assert generation_time.underfilled_share(spans, engines=2) == pytest.approx(4 / 10)  # 6..10: one in flight
    assert generation_time.underfilled_share(spans, engines=1) == 0.0  # one engine is never short of a member
    assert generation_time.underfilled_share(spans, engines=3) == pytest.approx(1.0)  # three never ran at once
    assert generation_time.underfilled_share([(0.0, 1.0), (2.0, 3.0)], engines=1) == pytest.approx(1 / 3)  # a gap
    assert generation_time.underfilled_share([(5.0, 5.0)], engines=1) == 0.0  # no time at all


@pytest.mark.parametrize("spans, engines, says", [
    ([(0.0, 1.0)], 0, "at least one engine"),
    ([], 1, "at least one member's span"),
    ([(2.0, 1.0)], 1, "ends before it starts"),
])
def test_an_underfilled_share_of_impossible_spans_is_refused(spans, engines, says):
    with pytest.raises(ValueError, match=says):
        generation_time.underfilled_share(spans, engines)


def test_the_time_breakdown_adds_up():
    spans = [(100.0, 104.0), (100.0, 110.0), (104.0, 106.0)]  # on one clock; the members' wall is 10 s
    rollouts = [3.5, 9.0, 1.5]
    members = [episodes((1.0, 1.0), (3.0, 3.0)), episodes((1.0, 1.0), (2.0, 2.0), (9.0, 8.5)),
               episodes((1.5, 1.4), tokens=7)]
    breakdown = generation_time.time_breakdown(spans, rollouts, members, engines=2, gpus=0, update_s=0.5,
                                               digest_s=0.25)
    assert breakdown["members_wall_s"] == 10.0 and breakdown["wall_s"] == 10.75
    assert breakdown["member_s"] == [4.0, 10.0, 2.0]
    assert breakdown["longest_episode_s"] == [3.0, 8.5, 1.4]
    assert breakdown["tail_share"] == [pytest.approx(1 / 3.5, abs=1e-4), pytest.approx(7 / 9, abs=1e-4), 0.0]
    assert breakdown["tail_share_mean"] == pytest.approx((1 / 3.5 + 7 / 9) / 3, abs=1e-4)
    assert breakdown["underfilled_share"] == pytest.approx(0.4)
    assert breakdown["generated_tokens"] == 57 and breakdown["tokens_per_s"] == 5.7
    assert breakdown["tokens_per_s_per_engine"] == 2.85 and "tokens_per_s_per_gpu" not in breakdown
    on_gpus = generation_time.time_breakdown(spans, rollouts, members, engines=2, gpus=4, update_s=0, digest_s=0)
    assert on_gpus["gpus"] == 4 and on_gpus["tokens_per_s_per_gpu"] == pytest.approx(5.7 / 4, abs=0.01)
    assert "tokens_per_s_per_engine" not in on_gpus


def test_a_breakdown_needs_one_span_rollout_and_episode_list_per_member():
    with pytest.raises(ValueError, match="2 spans, 1 rollout times and 2 episode lists: one of each per member"):
        generation_time.time_breakdown([(0, 1), (0, 1)], [1.0], [episodes((1, 1)), episodes((1, 1))], engines=1,
                                       gpus=0, update_s=0, digest_s=0)


def test_the_console_and_tensorboard_show_the_slowest_member_and_the_shares():
    breakdown = generation_time.time_breakdown([(0.0, 2.0), (0.0, 6.0)], [1.5, 5.5],
                                               [episodes((1.0, 1.0)), episodes((1.0, 1.0), (5.0, 4.75))], engines=2,
                                               gpus=1, update_s=0.5, digest_s=0.5)
    text = generation_time.summary_text(breakdown)
    assert text.startswith("wall 7.0s; slowest member 1 6.0s (longest episode 4.8s); tail share ")
    assert "under 2 in flight 0.67" in text and text.endswith("30 tokens, 5 tok/s per GPU")
    scalars = generation_time.scalars(breakdown)
    assert scalars["time/slowest_member_s"] == 6.0 and scalars["time/longest_episode_s"] == 4.75
    assert scalars["time/underfilled_share"] == pytest.approx(0.6667) and scalars["time/tokens_per_s_per_gpu"] == 5.0
    assert all(isinstance(v, float) for v in scalars.values())



def test_a_record_written_before_the_breakdown_still_reads_prints_and_tracks(tmp_path):
    """A history written before issue 70 has no time_breakdown: it reads, and its console line and TensorBoard
    scalars are those it had, nothing of where the time went."""
    import importlib

    from agentic_es import cli, data, tracking
    from agentic_es.history import read_history
    from test_es_math import OLD_HISTORY, ScoringPool

    assert all("time_breakdown" not in g for g in read_history(OLD_HISTORY)["generations"])
    train = importlib.import_module("01_train")
    cfg = cli.parse_config(["--preset=smoke"])
    record = train.run_generation(ScoringPool(), cfg, data.training_problems(cfg), 0, train.member_fitness(cfg),
                                  tmp_path / "rollouts")
    assert "tail share" in train.summary_line(record, cfg) and "time/wall_s" in tracking.generation_scalars(record)
    older = {k: v for k, v in record.items() if k != "time_breakdown"}
    assert train.summary_line(older, cfg) == train.summary_line(record, cfg).split("  |  wall ")[0]
    assert not any(name.startswith("time/") for name in tracking.generation_scalars(older))
