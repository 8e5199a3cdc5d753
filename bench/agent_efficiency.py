"""Agent-loop efficiency: generation throughput inside the multi-turn agent loop divided by the throughput of a
plain batched `generate` of the same number of sequences with the same per-turn token budget.

The agent loop runs E episodes concurrently for T turns (the model's replies are noise on a random model: that
still drives full multi-turn traffic, observations and corrective messages included). The plain baseline sends
E prompts of the same first-turn length for T rounds of M new tokens each, with a barrier between rounds.
Prints a table and one JSON line.

    bash run_cpu.sh python bench/agent_efficiency.py --preset=smoke --episodes=16 --max_turns=4 --max_new_tokens=64
    python bench/agent_efficiency.py --qwen3_30b=true --max_turns=4 --max_new_tokens=512   # 2 GPUs, dummy weights
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[0]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common as C  # noqa: E402
import qwen3_30b  # noqa: E402


def main(argv):
    opts, overrides = C.parse_args(argv, {"episodes": 16, "repeats": 2, "qwen3_30b": False, "out": ""})
    cfg = C.parse_config(overrides)
    problems = C.smoke_problems(opts["episodes"], seed=3)
    jobs = [(p, 0) for p in problems]
    model, load_format = C.resolve_model(cfg.model), "auto"
    if opts["qwen3_30b"]:  # Qwen3-30B-A3B's layout with dummy weights and the tiny tokenizer (see qwen3_30b.py)
        model = qwen3_30b.write_config("/tmp/qwen3-30b-a3b-tinytok", tokenizer_from=C.resolve_model("tiny-qwen3-dense"))
        load_format = "dummy"
    with C.Engine(cfg, model, load_format=load_format) as engine:
        engine.run_agent(jobs[:2])  # warm-up
        agent, plain = [], []
        for _ in range(opts["repeats"]):
            engine.reset_prefix_cache()
            t0 = time.perf_counter()
            records = engine.run_agent(jobs)
            agent.append((sum(r["completion_tokens"] for r in records), time.perf_counter() - t0,
                          sum(r["turns"] for r in records)))

            first = engine.tokenizer.apply_chat_template(
                records[0]["messages"][:2], add_generation_prompt=True, enable_thinking=False, tokenize=True,
                return_dict=False)
            prompts = [list(first) for _ in jobs]
            engine.reset_prefix_cache()
            t0, tokens = time.perf_counter(), 0
            for turn in range(cfg.max_turns):  # the same per-turn budget, with a barrier between turns
                outs = engine.generate(prompts, cfg.max_new_tokens, greedy=False, seed=turn)
                tokens += sum(len(o) for o in outs)
            plain.append((tokens, time.perf_counter() - t0, cfg.max_turns * len(jobs)))

    agent_tps = max(t / s for t, s, _ in agent)
    plain_tps = max(t / s for t, s, _ in plain)
    result = {"bench": "agent_efficiency", "date": time.strftime("%Y-%m-%d"), "device": engine.device,
              "vllm_version": __import__("vllm").__version__, "cuda_graphs": cfg.cuda_graphs,
              "model": "Qwen3-30B-A3B layout, dummy weights" if opts["qwen3_30b"] else cfg.model, "episodes": len(jobs),
              "max_turns": cfg.max_turns, "max_new_tokens": cfg.max_new_tokens,
              "agent_tokens_per_s": round(agent_tps, 1), "plain_tokens_per_s": round(plain_tps, 1),
              "ratio": round(agent_tps / plain_tps, 3), "agent_runs": agent, "plain_runs": plain}
    print(f"{'':<22}{'tokens':>10}{'seconds':>10}{'tok/s':>10}")
    for name, runs in (("agent loop", agent), ("plain generate", plain)):
        for tokens, seconds, _ in runs:
            print(f"{name:<22}{tokens:>10}{seconds:>10.2f}{tokens / seconds:>10.1f}")
    print(f"ratio (best agent / best plain): {result['ratio']:.3f}")
    print(json.dumps(result))
    if opts["out"]:
        Path(opts["out"]).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
