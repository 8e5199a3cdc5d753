"""Where a generation's time went: its wall time, each member's time and its longest episode's, the tokens it
generated and their rate per GPU, each member's straggler tail, and how much of the members' wall time the pool ran
with fewer members in flight than it has engines. Pure functions of what 01_train.py's run_generation measured; the
history's generation record keeps their result ("time_breakdown"), the console line and TensorBoard show it. Each
field in one line: bench/README.md, "Where a generation's time went"."""

from __future__ import annotations

import statistics


def tail_share(episode_ends_s: list[float], rollout_s: float) -> float:
    """One member's straggler tail, as bench/reference_generation.py defines it: from its median episode's end to its
    last episode's end, over its rollout's seconds (episode ends counted from the rollout's start). Near 1: the member
    waited on one long episode, its engine mostly idle."""
    if not episode_ends_s:
        raise ValueError("a member's tail share needs the end of at least one episode")
    if rollout_s < 0 or any(end < 0 or end > rollout_s for end in episode_ends_s):
        raise ValueError(f"episodes end within their rollout: ends {sorted(episode_ends_s)} s, rollout {rollout_s} s")
    ends = sorted(episode_ends_s)
    return (ends[-1] - statistics.median(ends)) / rollout_s if rollout_s else 0.0


def underfilled_share(spans: list[tuple[float, float]], engines: int) -> float:
    """The share of the time from the first member's start to the last member's end during which fewer than
    `engines` members were in flight (spans: each member's (start, end) on one clock): an engine idle for want of a
    member, the pool's straggler cost. 0 where every engine was busy throughout."""
    if engines < 1:
        raise ValueError(f"a pool has at least one engine, got {engines}")
    if not spans:
        raise ValueError("the underfilled share needs at least one member's span")
    if any(end < start for start, end in spans):
        raise ValueError(f"a member's span ends before it starts: {[s for s in spans if s[1] < s[0]]}")
    first, last = min(s for s, _ in spans), max(e for _, e in spans)
    if last <= first:
        return 0.0
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda ev: (ev[0], ev[1]))
    underfilled, in_flight, previous = 0.0, 0, first
    for moment, change in events:
        if in_flight < engines:
            underfilled += moment - previous
        in_flight, previous = in_flight + change, moment
    return underfilled / (last - first)


def time_breakdown(member_spans: list[tuple[float, float]], member_rollout_s: list[float],
                   member_episodes: list[list[dict]], engines: int, gpus: int, update_s: float,
                   digest_s: float) -> dict:
    """What a generation record keeps of where the generation's time went. member_spans: each member's (start, end)
    on one clock (perturb, its episodes, restore); member_rollout_s: its episodes' wall time; member_episodes: its
    episode records (each with "seconds", its own time, "ended_s", its end from the rollout's start, and
    "completion_tokens", the ids it generated); engines: the pool's K; gpus: the distinct GPUs its engines run on
    (0 on CPU: the rate is then per engine)."""
    if not len(member_spans) == len(member_rollout_s) == len(member_episodes):
        raise ValueError(f"{len(member_spans)} spans, {len(member_rollout_s)} rollout times and "
                         f"{len(member_episodes)} episode lists: one of each per member")
    members_wall_s = max(e for _, e in member_spans) - min(s for s, _ in member_spans)
    tokens = sum(int(r["completion_tokens"]) for records in member_episodes for r in records)
    tails = [tail_share([r["ended_s"] for r in records], rollout)
             for records, rollout in zip(member_episodes, member_rollout_s)]
    per_second = tokens / members_wall_s if members_wall_s > 0 else 0.0
    rate = ({"gpus": gpus, "tokens_per_s_per_gpu": round(per_second / gpus, 2)} if gpus
            else {"tokens_per_s_per_engine": round(per_second / engines, 2)})
    return {
        "wall_s": round(members_wall_s + update_s + digest_s, 4), "members_wall_s": round(members_wall_s, 4),
        "engines": engines,
        "member_s": [round(end - start, 4) for start, end in member_spans],
        "longest_episode_s": [round(max(r["seconds"] for r in records), 4) for records in member_episodes],
        "tail_share": [round(t, 4) for t in tails], "tail_share_mean": round(statistics.mean(tails), 4),
        "underfilled_share": round(underfilled_share(member_spans, engines), 4),
        "generated_tokens": tokens, "tokens_per_s": round(per_second, 2), **rate,
    }


def summary_text(breakdown: dict) -> str:
    """The console's words for a time breakdown: wall, the slowest member and its longest episode, the straggler
    tail, the underfilled share and the token rate."""
    slowest = max(range(len(breakdown["member_s"])), key=breakdown["member_s"].__getitem__)
    rate = (f"{breakdown['tokens_per_s_per_gpu']:.0f} tok/s per GPU" if "tokens_per_s_per_gpu" in breakdown
            else f"{breakdown['tokens_per_s_per_engine']:.0f} tok/s per engine")
    return (f"wall {breakdown['wall_s']:.1f}s; slowest member {slowest} {breakdown['member_s'][slowest]:.1f}s "
            f"(longest episode {breakdown['longest_episode_s'][slowest]:.1f}s); tail share "
            f"{breakdown['tail_share_mean']:.2f}; under {breakdown['engines']} in flight "
            f"{breakdown['underfilled_share']:.2f}; {breakdown['generated_tokens']} tokens, {rate}")


def scalars(breakdown: dict) -> dict[str, float]:
    """The time breakdown as TensorBoard scalars (time/...): the generation's and the slowest member's, not every
    member's."""
    values = {"time/wall_s": breakdown["wall_s"], "time/members_wall_s": breakdown["members_wall_s"],
              "time/slowest_member_s": max(breakdown["member_s"]),
              "time/longest_episode_s": max(breakdown["longest_episode_s"]),
              "time/tail_share_mean": breakdown["tail_share_mean"],
              "time/underfilled_share": breakdown["underfilled_share"],
              "time/generated_tokens": breakdown["generated_tokens"], "time/tokens_per_s": breakdown["tokens_per_s"]}
    for key in ("tokens_per_s_per_gpu", "tokens_per_s_per_engine"):
        if key in breakdown:
            values[f"time/{key}"] = breakdown[key]
    return {k: float(v) for k, v in values.items()}
