"""bench/speculative_ngram.py's arithmetic, without an engine: the acceptance rate from vLLM's counters, the
episodes both modes sampled alike, and its table of a mode vLLM failed. (The script itself ran end to end on the
CPU: bench/README.md, "Speculative decoding".)"""

import sys

import pytest

import common

sys.path.insert(0, str(common.REPO / "bench"))
import speculative_ngram  # noqa: E402


def test_the_acceptance_rate_is_accepted_over_drafted_tokens_between_two_readings():
    before = {"vllm:spec_decode_num_drafts": 2.0, "vllm:spec_decode_num_draft_tokens": 8.0,
              "vllm:spec_decode_num_accepted_tokens": 1.0}
    after = {"vllm:spec_decode_num_drafts": 12.0, "vllm:spec_decode_num_draft_tokens": 48.0,
             "vllm:spec_decode_num_accepted_tokens": 21.0}
    assert speculative_ngram.acceptance(before, after) == {"drafts": 10.0, "draft_tokens": 40.0,
                                                            "accepted_tokens": 20.0, "acceptance_rate": 0.5,
                                                            "accepted_per_draft": 2.0}
    assert speculative_ngram.acceptance(before, before)["acceptance_rate"] is None  # nothing drafted
    assert speculative_ngram.acceptance(None, after) is None  # a vLLM without a metrics reader


def test_same_episodes_pairs_member_and_problem():
    off = [{"member": 0, "problem_id": "a", "messages": [1]}, {"member": 1, "problem_id": "a", "messages": [2]}]
    ngram = [{"member": 1, "problem_id": "a", "messages": [3]}, {"member": 0, "problem_id": "a", "messages": [1]}]
    assert speculative_ngram.same_episodes(off, ngram) == {"episodes": 2, "identical": 1}


def test_the_table_shows_a_failed_mode_as_dashes_and_leaves_out_rows_no_mode_has():
    off = {"mode": "off", "single_sequence_tokens_per_s": 100.0,
           "generation": {"member_s": [1.0, 3.0], "tokens_per_s_per_gpu": 50.0}}
    ngram = {"mode": "ngram", "error": "EngineFailure: vLLM failed"}
    text = speculative_ngram.table([off, ngram])
    assert "| one sequence alone, tok/s | 100.0 | - |" in text
    assert "| generation: slowest member s | 3.0 | - |" in text  # the slowest of the members
    assert "per engine" not in text


@pytest.fixture
def kept_counters(monkeypatch):
    """keep_draft_counters on this test's own registry and list."""
    import prometheus_client

    registry = prometheus_client.CollectorRegistry()
    monkeypatch.setattr(prometheus_client, "REGISTRY", registry)
    monkeypatch.setattr(speculative_ngram, "DRAFT_COUNTERS", [])
    speculative_ngram.keep_draft_counters()
    return registry


def test_the_draft_counters_of_every_engine_are_summed_though_each_start_unregisters_the_last(kept_counters):
    """vLLM's Prometheus logger of each new engine unregisters the collectors before it: the counters the earlier
    engines still count into are read all the same."""
    import prometheus_client

    counters = []
    for engine in range(2):
        for collector in list(kept_counters._collector_to_names):  # as vLLM's unregister_vllm_metrics does
            kept_counters.unregister(collector)
        counter = prometheus_client.Counter("vllm:spec_decode_num_drafts", "drafts", ["engine"],
                                            registry=kept_counters)
        counters.append(counter.labels(engine=str(engine)))
    prometheus_client.Counter("vllm:other", "not a draft counter", registry=kept_counters).inc(9)
    counters[0].inc(3)
    counters[1].inc(4)
    assert speculative_ngram.draft_counters() == {"vllm:spec_decode_num_drafts": 7.0}
