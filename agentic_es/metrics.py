"""The evaluation metrics of 03_eval.py: Mean4 and Pass4 per group of four samples of each problem, mean@16,
the unbiased pass@4, the mean reward of a set's episodes and how many of their replies were cut at the token limit
(cut_replies, which each training generation's record counts too), from the eval16 records (one per problem and
sample)."""

from __future__ import annotations

import math

import numpy as np

from agentic_es import stage, upgrade
from common import fitness

EVAL_SAMPLES = 16     # samples per problem in eval16
GROUP_SIZE = 4        # samples per Mean4/Pass4 group
REPORTED_SAMPLES = (12, 13, 14, 15)  # the reported Mean4/Pass4 group: the last four samples, as the reference
REPORTED_GROUP = f"{REPORTED_SAMPLES[0]}-{REPORTED_SAMPLES[-1]}"
EVAL_METRICS = "metrics.json"  # 03_eval.py's last file: the metrics of every set it evaluated, by set name
# what the replay reads from 03_eval.py's files (check_shape)
EVAL_METRICS_SHAPE = {"datasets": {}}
EPISODE_RECORD_KEYS = ("problem_id", "sample_index", "seed", "score")
EVAL16_SHAPE = {"data": None, "checkpoint": ("per_rank_digests",), "config": {}, "records": [EPISODE_RECORD_KEYS]}


def group_label(indices):
    return f"{indices[0]}-{indices[-1]}"


def scores_by_problem(records, samples=EVAL_SAMPLES):
    """{problem_id: [score of sample 0, ..., score of sample samples-1]}, checking every problem has each
    sample index exactly once and every score is 0/1 (a missing or doubled sample would bias every metric)."""
    if not records:
        raise stage.DataError("no eval records")
    table = {}
    for r in records:
        for key in ("problem_id", "sample_index", "score"):
            if key not in r:
                raise stage.DataError(f"eval record missing {key!r}: {r!r}")
        pid, idx, score = r["problem_id"], r["sample_index"], r["score"]
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < samples:
            raise stage.DataError(f"problem {pid!r}: sample_index {idx!r} outside 0..{samples - 1}")
        if isinstance(score, bool):
            score = int(score)
        if score not in (0, 1):
            raise stage.DataError(f"problem {pid!r} sample {idx}: score must be 0 or 1, got {score!r}")
        row = table.setdefault(pid, [None] * samples)
        if row[idx] is not None:
            raise stage.DataError(f"problem {pid!r}: sample_index {idx} appears more than once")
        row[idx] = int(score)
    for pid, row in table.items():
        missing = [i for i, s in enumerate(row) if s is None]
        if missing:
            raise stage.DataError(f"problem {pid!r}: missing sample indices {missing} (need each of 0..{samples - 1} "
                                  "once)")
    return table


def group_metrics(records, samples=EVAL_SAMPLES, group_size=GROUP_SIZE):
    """Mean4 and Pass4 for each consecutive group of sample indices (0-3, 4-7, 8-11, 12-15)."""
    if samples % group_size:
        raise ValueError(f"samples ({samples}) must be a multiple of group_size ({group_size})")
    scores = np.array(list(scores_by_problem(records, samples).values()), dtype=np.float64)  # (problems, samples)
    groups = []
    for start in range(0, samples, group_size):
        indices = list(range(start, start + group_size))
        mean4, pass4 = mean4_pass4(scores[:, indices])
        groups.append({"group": group_label(indices), "sample_indices": indices, "mean4": mean4, "pass4": pass4})
    return groups


def mean4_pass4(scores) -> tuple[float, float]:
    """For a (problems x 4 samples) table of 0/1 scores: Mean4 = mean over every problem and sample, Pass4 = mean
    over problems of the best of the four."""
    g = np.asarray(scores, dtype=np.float64)
    return float(g.mean()), float(g.max(axis=1).mean())


def pass_at_k_unbiased(n, c, k):
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k).
    Exact integer binomials, one correctly rounded division: no overflow or cancellation."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0  # every k-subset contains a correct sample
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


CUT_REPLY = "length"  # vLLM's finish reason of a reply cut at its max_tokens (max_new_tokens, or the context left)


def cut_replies(records) -> dict:
    """How many of the episodes' replies were cut at the token limit ("cut") of how many ("replies"), from each
    record's reply_finish_reasons; episodes recorded before records kept them count in neither ("unrecorded": an
    evaluation resumed from an older episode log)."""
    recorded = [upgrade.upgraded(r, upgrade.EPISODE_KEYS_ADDED)["reply_finish_reasons"] for r in records]
    kept = [reasons for reasons in recorded if reasons is not None]
    return {"replies": sum(len(reasons) for reasons in kept),
            "cut": sum(reasons.count(CUT_REPLY) for reasons in kept), "unrecorded": len(records) - len(kept)}


def dataset_metrics(records, fitness_kind="agent"):
    """metrics.json entry for one dataset's eval16 records; "reward": their mean reward under fitness_kind (the
    run's Config.fitness: with "agent" it is mean@16); "scorer_failures": the episodes the scorer gave no score
    for (scored 0), by score method."""
    groups = group_metrics(records, EVAL_SAMPLES, GROUP_SIZE)
    scores = scores_by_problem(records, EVAL_SAMPLES)
    correct = [sum(row) for row in scores.values()]
    return {
        "groups": groups,
        "reported": next(g for g in groups if g["group"] == REPORTED_GROUP),
        "mean_at_16": sum(correct) / (EVAL_SAMPLES * len(correct)),
        "pass_at_4_unbiased": sum(pass_at_k_unbiased(EVAL_SAMPLES, c, GROUP_SIZE) for c in correct) / len(correct),
        "reward": {"fitness": fitness_kind, "mean_at_16": fitness(records, fitness_kind)},
        "replies": cut_replies(records),
        "n_problems": len(scores),
        "n_records": len(records),
        "scorer_failures": stage.scorer_failures(records),
    }
