"""What one decode step costs: generation speed of 1, 16 and 64 sequences under the run's sampling settings,
without the presence penalty, and greedy; identical sequences against distinct ones; a short context against a
long one. The reference generation spends most of its time in one long episode decoding alone (its straggler),
so the one-sequence rows are its speed limit.

Every row starts from an empty prefix cache, prefills its prompts (one token each, so the timed run finds them
cached and times decode steps only), runs twice, and reports the faster run: generated tokens over wall time
(tok/s), and milliseconds per step (sequences / tok/s * 1000). "identical" sends one prompt with one seed
N times (the copies route every token of a step to the same experts of a mixture of experts); "distinct" sends N
random prompts, each with its own seed.

    python bench/decode_speed.py --qwen3_30b=true --out=$OUT/decode_speed.json                     # 2 GPUs
    python bench/decode_speed.py --qwen3_30b=true --custom_all_reduce=true                          # vs NCCL
    python bench/decode_speed.py --qwen3_30b=true --tensor_parallel_size=1 --inductor=true          # 1 GPU
    bash run_cpu.sh python bench/decode_speed.py --preset=smoke --tokens=32 --long_prompt=512

--inductor=true compiles the piecewise graphs with vLLM's default backend (inductor) instead of "eager": inductor
fused kernels save per-step launches. It failed inside vLLM's compile flow at TP=2 on 2x H200 on 2026-11-29, so the
engine never uses it; this option only measures what it would buy.
"""

import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[0]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import plain_generation  # noqa: E402
import qwen3_30b  # noqa: E402
from agentic_es import cli, models  # noqa: E402
from agentic_es.engine import Engine, cuda_engine_args, sampling_params  # noqa: E402
from report import emit, print_until_reader_gone  # noqa: E402

SHORT_PROMPT = 64


def random_prompt(seed: int, length: int, vocab: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(10, vocab, length)]


def generate(engine, prompts: list[list[int]], params_for) -> int:
    """All prompts at once, request i with params_for(i); returns the tokens generated."""
    async def run_all():
        return await asyncio.gather(*(engine._complete(p, params_for(i), f"decode-{i}-{time.time_ns()}")
                                      for i, p in enumerate(prompts)))

    return sum(len(o.token_ids) for o in engine._run(run_all()))


def main(argv):
    opts, overrides = cli.parse_args(argv, {"tokens": 1024, "long_prompt": 16384, "repeats": 2, "qwen3_30b": False,
                                          "inductor": False, "out": ""})
    cfg = cli.parse_config(overrides)
    if opts["inductor"]:
        eager_backend = cuda_engine_args

        def inductor_backend(c):
            args = eager_backend(c)
            return {**args, "compilation_config": {**args["compilation_config"], "mode": 3, "backend": "inductor"}}

        cuda_engine_args = inductor_backend
    if opts["qwen3_30b"]:  # the real layout with random weights: only its config.json is needed
        model, load_format = qwen3_30b.write_config("/tmp/qwen3-30b-a3b-ref"), "dummy"
    else:
        model, load_format = models.resolve_model(cfg.model), "auto"
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    def sampled(c):  # the run's sampling settings, never stopping early
        return lambda seed: sampling_params(c, seed=seed, max_tokens=opts["tokens"], ignore_eos=True)

    sampling = {"run sampling": sampled(cfg),
                "no penalty": sampled(dataclasses.replace(cfg, presence_penalty=0.0, repetition_penalty=1.0)),
                "greedy": lambda seed: SamplingParams(temperature=0.0, max_tokens=opts["tokens"], ignore_eos=True,
                                                      detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)}
    rows = [  # (sequences, prompts, sampling)
        (1, "short", "run sampling"), (1, "short", "no penalty"), (1, "short", "greedy"), (1, "long", "run sampling"),
        (16, "identical", "run sampling"), (16, "distinct", "run sampling"), (16, "distinct", "no penalty"),
        (16, "distinct", "greedy"), (64, "distinct", "run sampling"),
    ]
    results = []
    with Engine(cfg, model, load_format=load_format, skip_tokenizer_init=opts["qwen3_30b"]) as engine:
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        plain_generation.generate(engine, [random_prompt(0, SHORT_PROMPT, vocab)] * 2, 16)  # warm-up
        for n, prompts, how in rows:
            length = opts["long_prompt"] if prompts == "long" else SHORT_PROMPT
            if prompts == "identical":
                batch, seed_of = [random_prompt(1, length, vocab)] * n, (lambda i: 1)
            else:
                batch, seed_of = [random_prompt(100 + i, length, vocab) for i in range(n)], (lambda i: 100 + i)
            runs = []
            for _ in range(opts["repeats"]):
                engine.reset_prefix_cache()
                distinct = list({tuple(p): p for p in batch}.values())
                plain_generation.generate(engine, distinct, 1)  # prefill: time only decode steps
                t0 = time.perf_counter()
                tokens = generate(engine, batch, lambda i: sampling[how](seed_of(i)))
                runs.append((tokens, time.perf_counter() - t0))
            tokens, seconds = max(runs, key=lambda r: r[0] / r[1])
            results.append({"sequences": n, "prompts": prompts, "prompt_tokens": length, "sampling": how,
                            "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
                            "ms_per_step": round(1000 * seconds * n / tokens, 2),
                            "runs_s": [round(s, 3) for _, s in runs]})
            r = results[-1]
            print(f"{n:>4} {prompts:<10}{how:<14}{r['tokens_per_s']:>10.1f} tok/s {r['ms_per_step']:>8.2f} ms/step",
                  flush=True)

    result = {"bench": "decode_speed", "date": time.strftime("%Y-%m-%d"), "device": engine.device,
              "vllm_version": __import__("vllm").__version__, "cuda_graphs": cfg.cuda_graphs,
              "cudagraph_mode": cfg.cudagraph_mode, "max_num_batched_tokens": cfg.max_num_batched_tokens,
              "custom_all_reduce": cfg.custom_all_reduce, "tensor_parallel_size": cfg.tensor_parallel_size,
              "graph_backend": "inductor" if opts["inductor"] else "eager",
              "model": "Qwen3-30B-A3B layout, dummy weights" if opts["qwen3_30b"] else cfg.model,
              "new_tokens": opts["tokens"], "rows": results}
    return emit(result, opts["out"])


if __name__ == "__main__":
    print_until_reader_gone()
    main(sys.argv[1:])
