"""Per-rank digest at Qwen3-30B-A3B size (GPU only): one process per GPU, each holding one TP=2 rank's parameters
(vLLM's fused layout, random bytes, 15.27e9 bf16 elements = 30.5 GB), both hashing at once as the two TP workers do.

    before: every tensor copied whole to pageable host memory, then hashed; 8 threads per rank (the old es_digest)
    after:  digests.tensor_digests: chunks streamed through pinned buffers (copy of chunk k+1 overlapping the hash
            of chunk k), DIGEST_THREADS_PER_RANK threads, largest tensors first, buffers pinned once

Both must give the same per-tensor digests (the history's digests keep their definition). Prints a table and one
JSON line (also written to --out).

    python bench/digest.py --out=$OUT/digest.json
"""

import concurrent.futures
import hashlib
import os
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[0]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import qwen3_30b  # noqa: E402
from agentic_es import cli, digests  # noqa: E402
from report import emit, print_until_reader_gone  # noqa: E402

BEFORE_THREADS = 8


def rank_layout(tp: int = 2) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of one rank's parameters in vLLM's Qwen3-MoE layout (fused qkv and expert weights)."""
    c = qwen3_30b.QWEN3_30B_A3B
    h, d, e, m = c["hidden_size"], c["head_dim"], c["num_experts"], c["moe_intermediate_size"]
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * d // tp
    shapes = [("model.embed_tokens.weight", (c["vocab_size"] // tp, h))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [(p + "self_attn.qkv_proj.weight", (qkv, h)),
                   (p + "self_attn.o_proj.weight", (h, c["num_attention_heads"] * d // tp)),
                   (p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,)),
                   (p + "mlp.gate.weight", (e, h)),
                   (p + "mlp.experts.w13_weight", (e, 2 * m // tp, h)),
                   (p + "mlp.experts.w2_weight", (e, h, m // tp)),
                   (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    return shapes + [("model.norm.weight", (h,)), ("lm_head.weight", (c["vocab_size"] // tp, h))]


def digests_before(named):
    """The old es_digest: whole tensors to pageable host memory, then sha256, in BEFORE_THREADS threads."""
    def one(name_and_tensor):
        name, t = name_and_tensor
        return digests.tensor_digest(name, t.cpu())

    with concurrent.futures.ThreadPoolExecutor(max_workers=BEFORE_THREADS) as pool:
        return [(n, d) for (n, _), d in zip(named, pool.map(one, named))]


def rank_main(rank, results, repeats):
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    g = torch.Generator(device=device).manual_seed(rank)
    named = []
    for name, shape in rank_layout():
        t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        t.view(torch.int16).random_(-2**15, 2**15, generator=g)
        named.append((name, t))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    staging = [digests.DigestStaging(device) for _ in range(digests.DIGEST_THREADS_PER_RANK)]
    pin_s = time.perf_counter() - t0
    after_s, after = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        after = digests.tensor_digests(named, threads=digests.DIGEST_THREADS_PER_RANK, staging=staging)
        after_s.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    before = digests_before(named)
    before_s = time.perf_counter() - t0
    results[rank] = {"rank": rank, "tensors": len(named), "elements": sum(t.numel() for _, t in named),
                     "bytes": sum(t.numel() * 2 for _, t in named), "pin_staging_s": round(pin_s, 3),
                     "after_s": [round(s, 2) for s in after_s], "before_s": round(before_s, 2),
                     "same_digests": before == after, "digest": digests.combine_digests(after)}


def sha256_gb_per_s(size=1 << 30) -> float:
    data = os.urandom(1 << 24) * (size >> 24)
    t0 = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    return size / (time.perf_counter() - t0) / 1e9


def main(argv):
    opts, _ = cli.parse_args(argv, {"out": "", "repeats": 2})
    ranks = min(2, torch.cuda.device_count())
    if ranks == 0:
        sys.exit("bench/digest.py needs CUDA GPUs (CPU tensors are hashed in place, without staging)")
    with mp.Manager() as manager:
        results = manager.dict()
        procs = [mp.get_context("spawn").Process(target=rank_main, args=(r, results, opts["repeats"]))
                 for r in range(ranks)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        per_rank = [dict(results[r]) for r in range(ranks) if r in results]
    if len(per_rank) != ranks:
        sys.exit(f"a rank process failed (exit codes {[p.exitcode for p in procs]})")
    result = {"bench": "digest", "date": time.strftime("%Y-%m-%d"), "torch_version": torch.__version__,
              "gpu": torch.cuda.get_device_name(0), "cpu_cores": len(os.sched_getaffinity(0)), "ranks": ranks,
              "threads_per_rank": {"before": BEFORE_THREADS, "after": digests.DIGEST_THREADS_PER_RANK},
              "chunk_bytes": digests.DIGEST_CHUNK_BYTES, "sha256_one_core_gb_per_s": round(sha256_gb_per_s(), 2),
              "before_s": max(r["before_s"] for r in per_rank),
              "after_s": max(min(r["after_s"]) for r in per_rank),
              "same_digests": all(r["same_digests"] for r in per_rank), "per_rank": per_rank}
    print(f"{'rank':>4} {'GB':>6} {'before s':>9} {'after s':>14} {'same digests':>13}")
    for r in per_rank:
        print(f"{r['rank']:>4} {r['bytes'] / 1e9:>6.1f} {r['before_s']:>9.2f} {str(r['after_s']):>14} "
              f"{str(r['same_digests']):>13}")
    print(f"per-rank digest, both ranks at once: {result['before_s']:.1f} s before -> {result['after_s']:.2f} s after "
          f"({digests.DIGEST_THREADS_PER_RANK} threads, sha256 {result['sha256_one_core_gb_per_s']} GB/s on one core)")
    emit(result, opts["out"])
    if not result["same_digests"]:
        sys.exit("the streamed digests differ from the whole-tensor ones")


if __name__ == "__main__":
    print_until_reader_gone()
    main(sys.argv[1:])
