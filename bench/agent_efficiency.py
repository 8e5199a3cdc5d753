"""Agent-loop efficiency: generation throughput inside the multi-turn agent loop divided by the throughput of a
plain batched `generate` of the same number of sequences with the same per-turn token budget; and the agent loop's
prefix-cache hit rate (cached prompt tokens / prompt tokens, from vLLM's RequestOutput.num_cached_tokens).

Equal concurrency: every request's time in flight is summed per run (request-seconds). Request-seconds over wall
time is the run's mean number of sequences in flight; tokens per request-second is the speed of one sequence in
flight. "ratio_per_sequence" compares that speed in the agent loop with plain generation: below 1, the engine steps
themselves are slower in the agent loop; near 1 with a low "ratio", the agent loop simply keeps fewer sequences in
flight (episodes end at different times). "agent_gap_share": the share of the episodes' time with none of their
requests in flight (tools, prompt building, scoring).

The agent loop runs E episodes concurrently for T turns (the model's replies are noise on a random model: that
still drives full multi-turn traffic, observations and corrective messages included). The plain baseline sends
the E episodes' first prompts for T rounds of exactly M new tokens each (no early end: E sequences in flight
throughout), with a barrier between rounds, every request sampled with its own seed. "plain, copies of one" is
the baseline used until 2026-12-01: one prompt E times with one seed, so E identical sequences. On a mixture of
experts that is no baseline: the copies route every token of a step to the same 8 experts, so a step reads a
fraction of the expert weights that E distinct sequences read. Prints a table and one JSON line.

What the prompts are depends on --prompt_mode (Config.prompt_mode, see prompts.choose_prompt_mode) and on the chat
template: the tiny model's own template by default; --chat_template=FILE writes the tiny model (or, with
--qwen3_30b, the tokenizer) with that template and Qwen3's tag tokens. With Qwen3-30B-A3B's published template
(tests/fixtures/qwen3_chat_template.jinja), "render" re-renders the conversation every turn (earlier replies lose
their empty think block, so each turn's previous reply is prefilled again) and "continue" appends the generated ids.

    bash run_cpu.sh python bench/agent_efficiency.py --preset=smoke --episodes=16 --max_turns=4 --max_new_tokens=64 \
        --chat_template=tests/fixtures/qwen3_chat_template.jinja --prompt_mode=render
    python bench/agent_efficiency.py --qwen3_30b=true --max_turns=4 --max_new_tokens=512 \
        --chat_template=tests/fixtures/qwen3_chat_template.jinja   # 2 GPUs, dummy weights
"""

import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[0]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import plain_generation  # noqa: E402
import qwen3_30b  # noqa: E402
from agentic_es import cli, data, models, prompts, smoke_task  # noqa: E402
from agentic_es.engine import Engine, sampling_params  # noqa: E402
from report import emit, print_until_reader_gone  # noqa: E402


def timed(engine, counts: dict, runs: list, fn):
    """Run fn from an empty prefix cache; record (generated tokens, seconds, request-seconds: the sum over its
    requests of their time in flight)."""
    engine.reset_prefix_cache()
    counts.update(prompt=0, cached=0, request_s=0.0)
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    tokens = sum(r["completion_tokens"] for r in out) if isinstance(out[0], dict) else out[0]
    runs.append((tokens, round(seconds, 3), round(counts["request_s"], 3)))
    return out


def plain_rounds(engine, prompts_per_round, max_new_tokens):
    """Batched generate, one round per turn, with a barrier between rounds; request i of round k sampled with seed
    k * len(prompts) + i. Returns [tokens]."""
    tokens = 0
    for turn, prompts in enumerate(prompts_per_round):
        if prompts:
            tokens += sum(len(o) for o in plain_generation.generate(engine, prompts, max_new_tokens, greedy=False,
                                                          seed=turn * len(prompts)))
    return [tokens]


def copies_rounds(engine, prompt, copies, rounds, max_new_tokens):
    """One prompt `copies` times with one seed per round: identical sequences (the old baseline). Returns [tokens]."""
    async def one_round(turn):
        params = sampling_params(engine.cfg, seed=turn, max_tokens=max_new_tokens, ignore_eos=True)
        return await asyncio.gather(*(engine._complete(prompt, params, f"copy-{turn}-{i}-{time.time_ns()}")
                                      for i in range(copies)))

    return [sum(len(o.token_ids) for turn in range(rounds) for o in engine._run(one_round(turn)))]


def render(engine, messages):
    return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False,
                                                tokenize=True, return_dict=False)


def count_requests(engine) -> dict:
    """Wrap the engine's AsyncLLM.generate so that every finished request adds its prompt tokens, its prefix-cache
    hits (vLLM's num_cached_tokens) and its seconds in flight (submitted to finished) to the returned counter."""
    counts = {"prompt": 0, "cached": 0, "request_s": 0.0}
    generate = engine.llm.generate

    async def counted(*args, **kwargs):
        out, t0 = None, time.perf_counter()
        async for out in generate(*args, **kwargs):
            yield out
        counts["request_s"] += time.perf_counter() - t0
        counts["prompt"] += len(out.prompt_token_ids)
        counts["cached"] += out.num_cached_tokens or 0

    engine.llm.generate = counted
    return counts


def turn_starts(record):
    """For each assistant turn of an episode, how many messages preceded it."""
    return [i for i, m in enumerate(record["messages"]) if m["role"] == "assistant"]


def main(argv):
    opts, overrides = cli.parse_args(argv, {"episodes": 16, "repeats": 2, "qwen3_30b": False, "chat_template": "",
                                          "out": ""})
    cfg = cli.parse_config(overrides)
    problems = smoke_task.smoke_problems(opts["episodes"], seed=3)
    jobs = [(p, 0) for p in problems]
    model, load_format = None, "auto"
    if opts["chat_template"]:  # the tiny model again, with this template and Qwen3's tag tokens
        model = str(models.write_tiny_model("/tmp/agent-efficiency-tiny-template", kind=cfg.model.rsplit("-", 1)[1],
                                            chat_template=Path(opts["chat_template"]).read_text()))
    if opts["qwen3_30b"]:  # Qwen3-30B-A3B's layout with dummy weights and the tiny tokenizer (see qwen3_30b.py)
        tokenizer_from = model or models.resolve_model("tiny-qwen3-dense")
        model = qwen3_30b.write_config("/tmp/qwen3-30b-a3b-tinytok", tokenizer_from=tokenizer_from)
        load_format = "dummy"
    model = model or models.resolve_model(cfg.model)
    with Engine(cfg, model, load_format=load_format) as engine:
        engine.run_agent(jobs[:2])  # warm-up
        counts = count_requests(engine)
        runs = {"agent loop": [], "plain generate": [], "plain, agent contexts": [], "plain, copies of one": []}
        hit_rates, gap_shares = [], []  # per agent-loop run, from an empty prefix cache
        for _ in range(opts["repeats"]):
            records = timed(engine, counts, runs["agent loop"], lambda: engine.run_agent(jobs))
            hit_rates.append(round(counts["cached"] / counts["prompt"], 4))
            # the share of the episodes' time with no request of theirs in flight: tools, prompts, scoring
            gap_shares.append(round(1 - counts["request_s"] / sum(r["seconds"] for r in records), 4))
            first_prompts = [render(engine, r["messages"][:2]) for r in records]
            timed(engine, counts, runs["plain generate"],
                  lambda: plain_rounds(engine, [first_prompts] * cfg.max_turns, cfg.max_new_tokens))
            timed(engine, counts, runs["plain, copies of one"],
                  lambda: copies_rounds(engine, first_prompts[0], len(jobs), cfg.max_turns, cfg.max_new_tokens))
            contexts = [[render(engine, r["messages"][:i]) for r in records for i in turn_starts(r)[k:k + 1]]
                        for k in range(cfg.max_turns)]
            timed(engine, counts, runs["plain, agent contexts"],
                  lambda: plain_rounds(engine, contexts, cfg.max_new_tokens))
        block_size = engine.llm.vllm_config.cache_config.block_size

    fastest = {name: max(r, key=lambda run: run[0] / run[1]) for name, r in runs.items()}  # by tokens/s
    best = {name: t / s for name, (t, s, _) in fastest.items()}
    # Equal concurrency: a run's mean sequences in flight is its request-seconds over its wall time, and its
    # tokens per request-second is what one sequence in flight decoded per second. The agent loop's episodes end
    # at different times, so fewer sequences are in flight on average than in the barrier-synchronised baseline.
    mean_in_flight = {name: round(rs / s, 2) for name, (_, s, rs) in fastest.items()}
    per_sequence = {name: t / rs for name, (t, _, rs) in fastest.items()}
    result = {"bench": "agent_efficiency", "date": time.strftime("%Y-%m-%d"), "device": engine.device,
              "vllm_version": __import__("vllm").__version__, "cuda_graphs": cfg.cuda_graphs,
              "cudagraph_mode": cfg.cudagraph_mode, "max_num_batched_tokens": cfg.max_num_batched_tokens,
              "tensor_parallel_size": cfg.tensor_parallel_size,
              "model": "Qwen3-30B-A3B layout, dummy weights" if opts["qwen3_30b"] else cfg.model, "episodes": len(jobs),
              "chat_template": opts["chat_template"] or "tiny", "prompt_mode": engine.prompt_mode,
              "block_size": block_size, "prefix_cache_hit_rate": hit_rates,
              "max_turns": cfg.max_turns, "max_new_tokens": cfg.max_new_tokens,
              "agent_tokens_per_s": round(best["agent loop"], 1),
              "plain_tokens_per_s": round(best["plain generate"], 1),
              "plain_agent_contexts_tokens_per_s": round(best["plain, agent contexts"], 1),
              "ratio": round(best["agent loop"] / best["plain generate"], 3),
              "ratio_same_contexts": round(best["agent loop"] / best["plain, agent contexts"], 3),
              "plain_copies_tokens_per_s": round(best["plain, copies of one"], 1),
              "ratio_vs_copies": round(best["agent loop"] / best["plain, copies of one"], 3),
              "mean_in_flight": mean_in_flight,
              "tokens_per_request_s": {name: round(v, 1) for name, v in per_sequence.items()},
              "ratio_per_sequence": round(per_sequence["agent loop"] / per_sequence["plain generate"], 3),
              "agent_gap_share": gap_shares, "runs": runs}
    print(f"{'':<24}{'tokens':>10}{'seconds':>10}{'tok/s':>10}{'in flight':>10}{'tok/s/seq':>10}")
    for name, r in runs.items():
        for tokens, seconds, request_s in r:
            print(f"{name:<24}{tokens:>10}{seconds:>10.2f}{tokens / seconds:>10.1f}{request_s / seconds:>10.2f}"
                  f"{tokens / request_s:>10.1f}")
    print(f"agent loop prefix-cache hit rate ({result['prompt_mode']}, template {result['chat_template']}, "
          f"block size {block_size}): {', '.join(f'{h:.3f}' for h in hit_rates)}")
    print(f"ratio (best agent / best plain generate): {result['ratio']:.3f};  "
          f"against plain generate of the agent's own contexts: {result['ratio_same_contexts']:.3f};  "
          f"against copies of one sequence (the old baseline): {result['ratio_vs_copies']:.3f}")
    print(f"per sequence in flight (equal concurrency): {result['ratio_per_sequence']:.3f}; mean in flight "
          f"{mean_in_flight['agent loop']} (agent) vs {mean_in_flight['plain generate']} (plain); share of the "
          f"episodes' time between requests: {', '.join(f'{g:.3f}' for g in gap_shares)}")
    return emit(result, opts["out"])


if __name__ == "__main__":
    print_until_reader_gone()
    main(sys.argv[1:])
