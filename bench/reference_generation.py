"""One ES generation at the reference shape: N members, each perturbed, running E agent episodes, restored; then
the update and the digests. How long one generation of the reference run takes, and how much of the engine's
plain generation throughput the rollouts reach.

A random (dummy) model never stops or calls tools, so a scripted policy drives the lengths: every episode draws its
number of turns, each turn its token budget and each tool call its duration from the distribution below, and sends
real requests through the engine with those budgets (ignore_eos). Turns continue the previous turn's token ids
plus a drawn observation, as the agent does, and end the episode when the context is full.

    WORKLOAD (per episode, seeded by (seed, member, episode)):
      turns:            85%: uniform 2..8;  15% (the tail): uniform 9..50
      tokens per turn:  85%: uniform 200..1500;  15%: uniform 1500..4096
      observation:      uniform 20..400 tokens appended after every turn but the last
      tool call:        uniform 0.05..2.0 s in a thread (off the event loop), after every turn but the last

Reports wall time per generation (and x20 for the reference run), generated tokens/s, the fraction of plain
64-sequence throughput it reaches (64 distinct sequences), and the straggler share: per member, the time from the
median episode's end to the last episode's end, as a share of the member's rollout time. The straggler floor: per
member, the last episode's tokens at the measured speed of one sequence decoding alone, plus its tool calls; a
member cannot end sooner on one engine. "floor_share" (the floors over the rollout times) near 1 says that only a
faster lone sequence or several engines at once can shorten the generation.

    python bench/reference_generation.py --qwen3_30b=true --out=$OUT/reference_generation.json      # 2 GPUs
    python bench/reference_generation.py --qwen3_30b=true --layers=12 --tensor_parallel_size=1 --engines=4 \
        --gpu_memory_utilization=0.18 --token_scale=0.25 --tool_scale=0.25 --members=16  # 4 co-located, one GPU
    bash run_cpu.sh python bench/reference_generation.py --preset=smoke --token_scale=0.02 --members=2 --episodes=4
"""

import asyncio
import concurrent.futures
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[0]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import plain_generation  # noqa: E402
import qwen3_30b  # noqa: E402
from agentic_es import cli, models, worker_memory  # noqa: E402
from agentic_es.pool import EnginePool, mps_running  # noqa: E402
from report import emit, print_until_reader_gone  # noqa: E402

TAIL_SHARE = 0.15
TURNS, TAIL_TURNS = (2, 8), (9, 50)
TOKENS, TAIL_TOKENS = (200, 1500), (1500, 4096)
OBSERVATION_TOKENS = (20, 400)
TOOL_SECONDS = (0.05, 2.0)
FIRST_PROMPT_TOKENS = 400  # system prompt + problem
PLAIN_SEQUENCES, PLAIN_TOKENS = 64, 1024
REFERENCE_GENERATIONS = 20  # the reference run's generations


def draw_episode(seed: int, member: int, episode: int, token_scale: float) -> dict:
    """Turns, token budgets, observations and tool seconds of one scripted episode."""
    rng = np.random.default_rng([seed, member, episode])
    tail = rng.random() < TAIL_SHARE
    turns = int(rng.integers(*(TAIL_TURNS if tail else TURNS), endpoint=True))
    budgets = []
    for _ in range(turns):
        low, high = TAIL_TOKENS if rng.random() < TAIL_SHARE else TOKENS
        budgets.append(max(1, int(int(rng.integers(low, high, endpoint=True)) * token_scale)))
    return {"budgets": budgets,
            "observations": [max(1, int(int(rng.integers(*OBSERVATION_TOKENS, endpoint=True)) * token_scale))
                             for _ in range(turns)],
            "tool_seconds": [float(rng.uniform(*TOOL_SECONDS)) for _ in range(turns)]}


async def scripted_episode(engine, plan: dict, seed: int, vocab: int, tools) -> dict:
    """Real requests with the drawn budgets; each turn continues the previous prompt + output + observation."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    rng = np.random.default_rng(seed)
    ids = [int(x) for x in rng.integers(10, vocab, FIRST_PROMPT_TOKENS)]
    generated, turns, finish, tool_total = 0, 0, "turns_done", 0.0
    loop = asyncio.get_running_loop()
    for turn, (budget, obs, tool_s) in enumerate(zip(plan["budgets"], plan["observations"], plan["tool_seconds"])):
        room = engine.cfg.max_model_len - len(ids)
        if room <= 0:
            finish = "context_full"
            break
        params = SamplingParams(max_tokens=min(budget, room), ignore_eos=True, temperature=1.0, top_k=40,
                                seed=seed + turn, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        out = await engine._complete(ids, params, f"ref-{seed}-{turn}-{time.time_ns()}")
        generated += len(out.token_ids)
        turns += 1
        if turn < len(plan["budgets"]) - 1:
            await loop.run_in_executor(tools, time.sleep, tool_s)
            tool_total += tool_s
            ids = ids + list(out.token_ids) + [int(x) for x in rng.integers(10, vocab, obs)]
    return {"tokens": generated, "turns": turns, "finish": finish, "tool_s": tool_total, "end": time.perf_counter()}


def run_member(engine, plans: list[dict], seed: int, vocab: int) -> tuple[list[dict], float]:
    async def all_episodes():
        with concurrent.futures.ThreadPoolExecutor(max_workers=common.SANDBOX_MAX_PARALLEL) as tools:
            return await asyncio.gather(*(scripted_episode(engine, p, seed * 1000 + i, vocab, tools)
                                          for i, p in enumerate(plans)))

    t0 = time.perf_counter()
    episodes = engine._run(all_episodes())
    for e in episodes:
        e["end"] -= t0
    return episodes, time.perf_counter() - t0


def plain_tokens_per_s(engine, vocab: int, sequences: int = PLAIN_SEQUENCES) -> float:
    """Plain sampled generation of `sequences` distinct sequences of PLAIN_TOKENS tokens each."""
    prompts = [[int(x) for x in np.random.default_rng(i).integers(10, vocab, 64)] for i in range(sequences)]
    plain_generation.generate(engine, prompts[:2], 16)  # warm-up
    t0 = time.perf_counter()
    plain_generation.generate(engine, prompts, PLAIN_TOKENS, greedy=False, seed=1)
    return sequences * PLAIN_TOKENS / (time.perf_counter() - t0)


def straggler_floor_s(episodes: list[dict], single_tokens_per_s: float) -> float:
    """A member cannot end before its last episode does: that episode's tokens at the speed of one sequence decoding
    alone, plus its tool calls. A lower bound (its long contexts decode a little slower than the measured speed)."""
    last = max(episodes, key=lambda e: e["end"])
    return last["tokens"] / single_tokens_per_s + last["tool_s"]


def run_members(pool, plans, seeds, sigma, vocab) -> list[dict]:
    """Every member on the pool's work queue (K engines at once): perturb, its scripted episodes, restore."""
    def member(engine, m, on_record):
        t0 = time.perf_counter()
        engine.perturb(seeds[m], sigma)
        perturb_s = time.perf_counter() - t0
        episodes, rollout_s = run_member(engine, plans[m], m, vocab)
        t0 = time.perf_counter()
        engine.restore()
        restore_s = time.perf_counter() - t0
        ends = sorted(e["end"] for e in episodes)
        row = {"member": m, "rollout_s": round(rollout_s, 2), "perturb_s": round(perturb_s, 3),
               "restore_s": round(restore_s, 3), "tokens": sum(e["tokens"] for e in episodes),
               "turns": [e["turns"] for e in episodes],
               "context_full": sum(e["finish"] == "context_full" for e in episodes),
               "median_end_s": round(statistics.median(ends), 2), "last_end_s": round(ends[-1], 2),
               "straggler_share": round((ends[-1] - statistics.median(ends)) / rollout_s, 3), "episodes": episodes,
               "engine": pool.engines.index(engine)}
        print(f"member {m:>2}: {row['tokens']:>8} tokens in {rollout_s:8.1f} s  ({row['tokens'] / rollout_s:7.1f} "
              f"tok/s), straggler share {row['straggler_share']:.2f}", flush=True)
        return row

    return pool.work(len(seeds), "members", "member", member)


def main(argv):
    opts, overrides = cli.parse_args(argv, {"members": 16, "episodes": 16, "token_scale": 1.0, "tool_scale": 1.0,
                                            "seed": 0, "qwen3_30b": False, "layers": 0, "normal_weights": False,
                                            "plain": True, "out": ""})
    cfg = cli.parse_config(overrides)
    if opts["qwen3_30b"]:  # the real layout with random weights: only its config.json is needed
        model, load_format = qwen3_30b.write_config("/tmp/qwen3-30b-a3b-ref", layers=opts["layers"]), "dummy"
    else:
        model, load_format = models.resolve_model(cfg.model), "auto"
    if opts["normal_weights"]:
        qwen3_30b.allow_normal_weights()
    plans = [[draw_episode(opts["seed"], m, e, opts["token_scale"]) for e in range(opts["episodes"])]
             for m in range(opts["members"])]
    for member_plans in plans:
        for plan in member_plans:
            plan["tool_seconds"] = [t * opts["tool_scale"] for t in plan["tool_seconds"]]
    t_start = time.perf_counter()
    with EnginePool(cfg, model, load_format=load_format, skip_tokenizer_init=opts["qwen3_30b"]) as pool:
        start_s = time.perf_counter() - t_start
        if opts["normal_weights"]:  # restore="patch" on weights shaped like trained ones, not dummy ones
            for e in pool.engines:
                e.rpc(qwen3_30b.normal_weights, std=qwen3_30b.NORMAL_STD, seed=opts["seed"])
                e.reset_prefix_cache()
        engine = pool.engines[0]
        memory = [e.rpc(worker_memory.es_memory)[0] for e in pool.engines]
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        plain = plain_tokens_per_s(engine, vocab) if opts["plain"] else None
        single = plain_tokens_per_s(engine, vocab, sequences=1)  # the speed of a straggler decoding alone
        t_gen = time.perf_counter()
        seeds = common.member_seeds(cfg.run_seed, 0, opts["members"])
        members = run_members(pool, plans, seeds, cfg.sigma_start, vocab)
        rollouts_s = time.perf_counter() - t_gen
        t0 = time.perf_counter()
        pool.update(seeds, common.update_coefficients(common.zscore(range(len(seeds))), cfg.alpha))
        update_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        pool.digests()  # every engine's, checked to agree
        digest_s = time.perf_counter() - t0
        generation_s = time.perf_counter() - t_gen
        placement = pool.placement
    for m in members:
        m["straggler_floor_s"] = round(straggler_floor_s(m.pop("episodes"), single), 2)

    tokens = sum(m["tokens"] for m in members)
    rollout = sum(m["rollout_s"] for m in members)
    cut = f" cut to {opts['layers']} layers" if opts["layers"] else ""
    weights = "weights N(0, 0.02), norms 1" if opts["normal_weights"] else "dummy weights"
    model_name = (f"Qwen3-30B-A3B layout{cut}, {weights}"
                  if opts["qwen3_30b"] else cfg.model)
    result = {"bench": "reference_generation", "date": time.strftime("%Y-%m-%d"), "device": pool.device,
              "vllm_version": __import__("vllm").__version__, "cuda_graphs": cfg.cuda_graphs,
              "cudagraph_mode": cfg.cudagraph_mode, "max_num_batched_tokens": cfg.max_num_batched_tokens,
              "model": model_name, "tensor_parallel_size": cfg.tensor_parallel_size, "engines": pool.size,
              "mps": mps_running() if pool.device == "cuda" else None,
              "gpu_memory_utilization": cfg.gpu_memory_utilization, "restore": cfg.restore, "placement": placement,
              "memory_per_engine": memory,
              "members": opts["members"], "episodes": opts["episodes"], "token_scale": opts["token_scale"],
              "tool_scale": opts["tool_scale"], "max_model_len": cfg.max_model_len,
              "engines_start_s": round(start_s, 1), "engine_start_s": round(start_s / pool.size, 1),
              "generation_s": round(generation_s, 1), "rollouts_wall_s": round(rollouts_s, 1),
              # the whole population on the pool, then the update and the digests (every engine's)
              "projected_reference_run_h": round(generation_s * REFERENCE_GENERATIONS / 3600, 2),
              "generated_tokens": tokens, "tokens_per_s": round(tokens / rollouts_s, 1),
              "plain_64_tokens_per_s": round(plain, 1) if plain else None,
              # the pool's rollout throughput against one engine's plain 64-sequence generation
              "fraction_of_plain": round(tokens / rollouts_s / plain, 3) if plain else None,
              "straggler_share_mean": round(statistics.mean(m["straggler_share"] for m in members), 3),
              "single_sequence_tokens_per_s": round(single, 1),
              "floor_share": round(sum(m["straggler_floor_s"] for m in members) / rollout, 3),
              "update_s": round(update_s, 2), "digest_s": round(digest_s, 2), "members_detail": members}
    print(f"generation: {result['generation_s']} s for {opts['members']} members x {opts['episodes']} episodes on "
          f"{pool.size} engine(s); {result['tokens_per_s']} tok/s in rollouts"
          + (f" = {result['fraction_of_plain']:.2f} of one engine's plain {PLAIN_SEQUENCES}-sequence generation"
             if plain else "")
          + f"; straggler share {result['straggler_share_mean']:.2f} (one sequence alone: {single:.1f} tok/s); "
          f"update {update_s:.2f} s, digest {digest_s:.2f} s")
    return emit(result, opts["out"])


if __name__ == "__main__":
    print_until_reader_gone()
    main(sys.argv[1:])
