"""Stochastic rounding of a weight change to bf16 (Config.rounding="stochastic"): the write that rounds a chunk's
float32 sum up or down with the probability that keeps its expected value, from random bits of a seeded generator.
common.add_noise_'s loop takes it as its write (write_for); round to nearest, the reference, is a plain copy. The
seed of a change (common.rounding_seed) and its record in the noise definition (common.STOCHASTIC_ROUNDING) are the
algorithm's; the checkpoint noise draws its bits per checkpoint element and rounds with round_with_bits_. A leaf: it
imports only torch.
"""

from __future__ import annotations

import torch


def write_for(flat: torch.Tensor, rounding_seed: int | None):
    """How a change of flat writes each chunk's float32 sum back, write_(values, acc): stochastically, from a
    generator seeded with rounding_seed, for a bf16 flat; else (no seed, or another dtype) to nearest, a copy."""
    if rounding_seed is None or flat.dtype != torch.bfloat16:
        return torch.Tensor.copy_
    generator = torch.Generator(device=flat.device)
    generator.manual_seed(rounding_seed)
    return lambda values, acc: round_stochastic_(values, acc, generator)


def round_stochastic_(out: torch.Tensor, acc: torch.Tensor, generator: torch.Generator) -> None:
    """out (bf16) <- acc (float32) rounded up in magnitude with probability (distance to the lower bf16 value) /
    ulp, else down: E[out] = acc. bf16 is the top half of float32's bits, so adding a uniform 16-bit integer to the
    bits and clearing the low half does it (sign-magnitude: the same for negative values)."""
    round_with_bits_(out, acc, torch.randint(0, 1 << 16, acc.shape, generator=generator, dtype=torch.int32,
                                             device=acc.device))


def round_with_bits_(out: torch.Tensor, acc: torch.Tensor, bits: torch.Tensor) -> None:
    out.copy_(((acc.view(torch.int32) + bits) & -65536).view(torch.float32))  # exact: the low bits are 0
