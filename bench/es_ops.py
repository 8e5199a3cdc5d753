"""ES operations at full size: Qwen3-30B-A3B's layout (load_format="dummy"), TP=2 on 2 GPUs.

Per rank: parameter count and bytes; per member: perturb, restore and prefix-cache reset (median of repeats);
one update with N=16; one digest; the memory the exact-restore copy takes; and plain generation throughput at 16
concurrent sequences, from which the ES-ops share of a member's rollout is bounded. Prints a table and one JSON
line (also written to --out).

    python bench/es_ops.py --out=$OUT/es_ops.json
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[0]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import plain_generation  # noqa: E402
import qwen3_30b  # noqa: E402
from agentic_es import cli, worker_memory  # noqa: E402
from agentic_es.engine import Engine  # noqa: E402
from report import emit, print_until_reader_gone  # noqa: E402


def timed(fn, repeats):
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds), seconds


def generate_tokens_per_s(engine, gen_tokens: int, sequences: int = 16) -> float:
    prompts = [[1000 + i + j for j in range(128)] for i in range(sequences)]
    plain_generation.generate(engine, prompts[:2], 16)  # warm-up
    seconds, _ = timed(lambda: plain_generation.generate(engine, prompts, gen_tokens, greedy=True), 2)
    return sequences * gen_tokens / seconds


def generation_only(engine, cfg, opts, start_s) -> dict:
    result = {"bench": "es_ops/generate", "date": time.strftime("%Y-%m-%d"), "cuda_graphs": cfg.cuda_graphs,
              "engine_start_s": round(start_s, 1),
              "generate_16_seqs_tokens_per_s": round(generate_tokens_per_s(engine, opts["gen_tokens"]), 1)}
    return emit(result, opts["out"])


def main(argv):
    opts, overrides = cli.parse_args(argv, {"out": "", "repeats": 5, "gen_tokens": 256, "folder": "/tmp/qwen3-30b-a3b",
                                          "ops": True})  # --ops=false: generation speed only (eager vs graphs)
    cfg = cli.parse_config(["--max_model_len=8192", *overrides])
    folder = qwen3_30b.write_config(opts["folder"])
    t0 = time.perf_counter()
    with Engine(cfg, folder, load_format="dummy", skip_tokenizer_init=True) as engine:
        start_s = time.perf_counter() - t0
        if not opts["ops"]:
            return generation_only(engine, cfg, opts, start_s)
        seeds = common.member_seeds(cfg.run_seed, 0, 16)
        sigma = cfg.sigma_start
        perturb, restore, reset = [], [], []
        for seed in seeds[: opts["repeats"]]:
            t = time.perf_counter(); engine.rpc(common.ESWorker.es_perturb, seed=seed, sigma=sigma); perturb.append(time.perf_counter() - t)
            t = time.perf_counter(); engine.reset_prefix_cache(); reset.append(time.perf_counter() - t)
            t = time.perf_counter(); engine.rpc(common.ESWorker.es_restore); restore.append(time.perf_counter() - t)
            engine.reset_prefix_cache()
        memory = engine.rpc(worker_memory.es_memory)
        coeffs = common.update_coefficients(common.zscore(list(range(16))), cfg.alpha)
        update_s, update_runs = timed(lambda: engine.update(seeds, coeffs), 2)
        digest_s, _ = timed(engine.digests, 1)

        tokens_per_s = generate_tokens_per_s(engine, opts["gen_tokens"])

    member_es_s = statistics.median(perturb) + statistics.median(restore) + statistics.median(reset)
    # A member's rollout is 16 episodes of >= 1 turn of up to 4096 tokens; one full-length turn each is a floor.
    floor_rollout_s = 16 * cfg.max_new_tokens / tokens_per_s
    result = {
        "bench": "es_ops", "date": time.strftime("%Y-%m-%d"), "device": engine.device,
        "vllm_version": __import__("vllm").__version__, "torch_version": torch.__version__,
        "cuda_graphs": cfg.cuda_graphs, "restore": cfg.restore, "noise_chunk": cfg.noise_chunk,
        "engine_start_s": round(start_s, 1),
        "params_per_rank": [m["params"] for m in memory], "param_bytes_per_rank": [m["param_bytes"] for m in memory],
        "copy_bytes_per_rank": [m["copy_bytes"] for m in memory], "copy_device": memory[0]["copy_device"],
        "device_free_bytes_after_copy": [m["device_free_bytes"] for m in memory],
        "perturb_s": perturb, "restore_s": restore, "reset_prefix_cache_s": reset,
        "perturb_median_s": statistics.median(perturb), "restore_median_s": statistics.median(restore),
        "reset_median_s": statistics.median(reset), "update_n16_s": update_runs, "digest_s": digest_s,
        "generate_16_seqs_tokens_per_s": round(tokens_per_s, 1),
        "member_es_ops_s": member_es_s, "member_rollout_floor_s": floor_rollout_s,
        "es_ops_fraction_upper_bound": member_es_s / floor_rollout_s,
    }
    gib = 1024**3
    print(f"params per rank      {result['params_per_rank']}  ({result['param_bytes_per_rank'][0] / gib:.1f} GiB bf16)")
    print(f"exact-restore copy   {result['copy_bytes_per_rank'][0] / gib:.1f} GiB on {result['copy_device']}; "
          f"free after: {[round(f / gib, 1) for f in result['device_free_bytes_after_copy'] if f]} GiB")
    print(f"perturb / restore / reset (median of {len(perturb)})  {result['perturb_median_s']:.3f} / "
          f"{result['restore_median_s']:.3f} / {result['reset_median_s']:.4f} s")
    print(f"update N=16          {update_s:.2f} s;  digest {digest_s:.1f} s")
    print(f"generate, 16 seqs    {tokens_per_s:.0f} tok/s  (cuda_graphs={cfg.cuda_graphs})")
    print(f"ES ops per member    {member_es_s:.3f} s = {100 * result['es_ops_fraction_upper_bound']:.2f}% of a "
          f"{floor_rollout_s:.0f} s rollout floor (16 episodes x one {cfg.max_new_tokens}-token turn)")
    return emit(result, opts["out"])


if __name__ == "__main__":
    print_until_reader_gone()
    main(sys.argv[1:])
