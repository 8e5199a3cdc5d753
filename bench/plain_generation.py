"""Plain batched generation on an engine, outside the agent loop: token ids in, exactly max_tokens token ids out
per prompt. What benchmarks measure decoding with and tests check sampling and loaded weights with; the stages
never generate this way."""

import asyncio
import time

from agentic_es.engine import Engine, sampling_params


def generate(engine: Engine, prompts_token_ids: list[list[int]], max_tokens: int, *, greedy: bool = True,
             seed: int = 0, with_cached_tokens: bool = False):
    """Greedy, or sampled (greedy=False) with the run's settings, request i with seed + i: distinct samples, as
    from one batched sampler, even of the same prompt. with_cached_tokens: returns (token ids, prompt tokens each
    request took from the prefix cache) instead."""
    from vllm import SamplingParams

    def params(i):
        if greedy:
            return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        return sampling_params(engine.cfg, seed=seed + i, max_tokens=max_tokens, ignore_eos=True)

    async def one(i, ids):
        out = await engine._finished(ids, params(i), f"gen-{time.time_ns()}-{i}")
        return list(out.outputs[0].token_ids), out.num_cached_tokens

    async def run_all():
        return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts_token_ids)))

    results = engine._run(run_all())
    tokens = [t for t, _ in results]
    return (tokens, [c for _, c in results]) if with_cached_tokens else tokens
