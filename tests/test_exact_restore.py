"""restore="patch": the exact restore without a copy of the weights (restore_patch.RestorePatch). Pure tests of the
patch on random tensors (every dtype, both roundings, both noise kinds, special values), the worker's overflow path
without vLLM, and the memory plan's bound. The real engines (TP=2, tiny dense and MoE) are checked in
tests/test_es_engine.py and tests/test_checkpoint_noise.py, on their modules' engines."""

import math
import re

import pytest
import torch

import common
from agentic_es import checkpoint_noise, restore_patch, stage, stochastic_rounding

CHUNK = 1001  # not a multiple of 8: chunks start inside a byte of the mask
SIGMA = 1e-3


def special_values(dtype: torch.dtype) -> torch.Tensor:
    """Zeros of both signs, subnormals, values near sigma (the noise flips their sign), huge and tiny magnitudes,
    infinities and a NaN, of `dtype`."""
    info = torch.finfo(dtype)
    tiny_sub = info.smallest_normal / 4  # a subnormal
    values = [0.0, -0.0, tiny_sub, -tiny_sub, info.smallest_normal, -info.smallest_normal, 1e-4, -1e-4, 5e-4,
              -5e-4, SIGMA, -SIGMA, 2e-3, -2e-3, 1.0, -1.0, 3.0, info.max / 2, -info.max / 2, info.max, -info.max,
              math.inf, -math.inf, math.nan]
    return torch.tensor(values, dtype=torch.float64).to(dtype)


def weights(dtype: torch.dtype, sizes=(20_011, 7, 4096, 3_333), seed: int = 0) -> list[torch.Tensor]:
    """Parameters of odd sizes, N(0, 0.02), with the special values at the start of the first and last."""
    g = torch.Generator().manual_seed(seed)
    out = [(torch.randn(n, generator=g) * 0.02).to(dtype) for n in sizes]
    for t in (out[0], out[-1]):
        special = special_values(dtype)
        t[:special.numel()] = special
    return out


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def rank_salted(kind: str, rounding: str):
    """The rank-salted noise of one member on parameter i, as the worker applies it."""
    def apply(i, flat, coeff, patch):
        seed = common.noise_seed(77, 0, f"p{i}")
        write_ = stochastic_rounding.write_for(flat, common.rounding_seed(kind, [77], 0, f"p{i}") if rounding == "stochastic"
                                      else None)
        if patch is None:
            common.add_noise_(flat, [seed], [coeff], CHUNK, write_)
        else:
            common.add_noise_through_patch_(patch, flat, [seed], [coeff], CHUNK, write_)
    return apply


def checkpoint(kind: str, rounding: str):
    """The checkpoint noise of one member on parameter i: a padded segment layout (padding keeps its value)."""
    def apply(i, flat, coeff, patch):
        n = flat.numel()
        segments = torch.tensor([[0, n - 5, i, 3], [n - 5, 5, -1, 0]])  # the last 5 elements are padding
        keys = checkpoint_noise.checkpoint_keys(77, [f"p{j}" for j in range(4)], "cpu")
        rounding_keys = (checkpoint_noise.checkpoint_rounding_keys(kind, [77], [f"p{j}" for j in range(4)], "cpu")
                         if rounding == "stochastic" else None)
        if patch is None:
            checkpoint_noise.add_checkpoint_noise_(flat, segments, [keys], [coeff], CHUNK, rounding_keys)
        else:
            checkpoint_noise.add_checkpoint_noise_through_patch_(patch, flat, segments, [keys], [coeff], CHUNK,
                                                                 rounding_keys)
    return apply


NOISES = {"rank_salted": rank_salted, "checkpoint": checkpoint}
CASES = [(torch.bfloat16, "nearest"), (torch.bfloat16, "stochastic"), (torch.float16, "nearest"),
         (torch.float32, "nearest")]


def perturb(params, noise, rounding, patch):
    patch.start_recording()
    for i, t in enumerate(params):
        noise("perturb", rounding)(i, t, SIGMA, patch)


def restore(params, noise, patch):
    patch.start_applying()
    for i, t in enumerate(params):
        noise("restore", "nearest")(i, t, -SIGMA, patch)
    patch.check_applied()


@pytest.mark.parametrize("noise", NOISES)
@pytest.mark.parametrize("dtype,rounding", CASES)
def test_subtract_and_patch_restore_every_bit(noise, dtype, rounding):
    params = weights(dtype)
    centre, special = [bits(t) for t in params], special_values(dtype).numel()
    first = params[0][:special].double()
    patch = restore_patch.RestorePatch(params, 0.5)
    for member in range(2):  # the patch is reused member after member
        perturb(params, NOISES[noise], rounding, patch)
        perturbed = [t.clone() for t in params]
        assert [bits(t) for t in params] != centre
        assert ((first * perturbed[0][:special].double()) < 0).any()  # some values near zero changed sign
        assert sum(patch.used.values()) > 0  # subtraction alone misses these elements
        subtracted = [t.clone() for t in perturbed]
        for i, t in enumerate(subtracted):
            NOISES[noise]("restore", "nearest")(i, t, -SIGMA, None)
        assert [bits(t) for t in subtracted] != centre  # why the patch is needed
        restore(params, NOISES[noise], patch)
        assert [bits(t) for t in params] == centre  # -0.0, NaN payloads, subnormals: every bit


def test_the_patch_holds_the_elements_subtraction_misses_and_nothing_else():
    params = weights(torch.bfloat16, sizes=(50_000,))
    centre = params[0].clone()
    patch = restore_patch.RestorePatch(params, 0.5)
    perturb(params, rank_salted, "nearest", patch)
    subtracted = params[0].clone()
    rank_salted("restore", "nearest")(0, subtracted, -SIGMA, None)
    misses = subtracted.view(torch.int16) != centre.view(torch.int16)
    assert patch.used[torch.bfloat16] == int(misses.sum())
    assert 0.02 < misses.float().mean().item() < 0.08  # ~5% at N(0, 0.02), sigma 1e-3 (bench/README.md)
    assert torch.equal(patch.values[torch.bfloat16][:int(misses.sum())].view(torch.int16),
                       centre[misses].view(torch.int16))


def test_patch_bytes_are_its_bound_and_allocated_up_front():
    params = weights(torch.bfloat16, sizes=(1000, 37))
    patch = restore_patch.RestorePatch(params, 0.12)
    assert patch.nbytes == restore_patch.patch_bytes({torch.bfloat16: 1037}, 0.12) == 130 + 125 * 2
    # parameters of several dtypes (a float32 router bias beside bfloat16 weights): each dtype's share at its size
    mixed = params + [torch.zeros(50), torch.zeros(9), torch.zeros(3, dtype=torch.float16)]
    patch = restore_patch.RestorePatch(mixed, 0.12)
    counts = {torch.bfloat16: 1037, torch.float32: 59, torch.float16: 3}
    assert patch.nbytes == restore_patch.patch_bytes(counts, 0.12) == 138 + 125 * 2 + 8 * 4 + 1 * 2
    assert restore_patch.patch_capacity(common.Config()) == restore_patch.PATCH_CAPACITY["nearest"]
    stochastic = common.Config(rounding="stochastic")
    assert restore_patch.patch_capacity(stochastic) == restore_patch.PATCH_CAPACITY["stochastic"]
    assert restore_patch.patch_capacity(common.Config(patch_capacity=0.2, rounding="stochastic")) == 0.2


def test_patch_restore_is_allowed_where_subtract_is_refused():
    common.Config(restore="patch", noise="checkpoint")
    common.Config(restore="patch", rounding="stochastic")
    with pytest.raises(stage.ConfigError, match=r"patch_capacity must be a finite number in \[0, 1\]"):
        common.Config(restore="patch", patch_capacity=1.5)


# ---- the worker's overflow path, without vLLM ----

class Worker(common.ESWorker):
    """ESWorker on plain tensors: rank 0 of `ranks`, where the other ranks report `others` from their pass."""

    def __init__(self, params, others=()):
        self.__dict__.update(es_params=[(f"p{i}", t) for i, t in enumerate(params)], es_rank=0)
        self.others = list(others)

    def _es_gather(self, value):
        return [value, *self.others]


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_an_overflow_leaves_the_exact_centre_and_says_what_to_change(rounding):
    params = weights(torch.bfloat16)
    centre = [bits(t) for t in params]
    worker = Worker(params)
    worker.es_configure(CHUNK, "patch", rounding, patch_capacity=0.01)
    refusal = worker.es_perturb(5, SIGMA)
    assert re.fullmatch(r"restore=patch: member seed 5 at sigma 0\.001 misses more elements than the patch holds "
                        r"\(patch_capacity=0\.01 of each rank's elements; rank 0: at least \d+ of 27447 elements "
                        r"\(torch\.bfloat16\) need the patch after \d+ of them, capacity 275\)\. The weights are "
                        r"back at the centre; raise --patch_capacity or use --restore=copy_device", refusal)
    assert [bits(t) for t in params] == centre and worker.es_perturbation is None
    worker.es_configure(CHUNK, "patch", rounding, patch_capacity=0.5)
    assert worker.es_perturb(5, SIGMA) is None  # a new patch
    assert [bits(t) for t in params] != centre
    worker.es_restore()
    assert [bits(t) for t in params] == centre


def test_another_rank_s_overflow_brings_this_rank_back_too():
    params = weights(torch.float16)
    centre = [bits(t) for t in params]
    worker = Worker(params, others=["at least 9 of 9 elements need the patch"])
    worker.es_configure(CHUNK, "patch", "nearest", patch_capacity=0.5)
    refusal = worker.es_perturb(5, SIGMA)
    assert "(patch_capacity=0.5 of each rank's elements; rank 1: at least 9 of 9" in refusal
    assert [bits(t) for t in params] == centre and worker.es_perturbation is None


def test_update_changes_nothing_without_an_active_member_and_keeps_the_copy_the_centre():
    params = weights(torch.bfloat16, sizes=(5000,))
    worker = Worker(params)
    worker.es_configure(CHUNK, "copy_device", "stochastic", patch_capacity=0.0)
    worker.es_perturb(5, SIGMA)
    worker.es_restore()
    before = bits(params[0])
    worker.es_update([1, 2], [0.0, 0.0])  # z = 0: no noise drawn, no rounding applied
    assert bits(params[0]) == before
    worker.es_configure(CHUNK, "copy_device", "nearest", patch_capacity=0.0)
    worker.es_update([1, 2], [1e-3, 0.0])
    assert bits(params[0]) != before and bits(worker.es_copy[0]) == bits(params[0])
