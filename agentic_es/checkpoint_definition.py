"""What a history records of the checkpoint noise (noise="checkpoint", checkpoint_noise.py): the text that defines
its noise and its stochastic rounding. Histories compare by it, so a change to checkpoint_noise.py's section 1 is a
change here: a run's weights are never rebuilt with another noise. A leaf, so that common.noise_definition records it
beside the rank-salted noise's record without importing checkpoint_noise (which imports common)."""

CHECKPOINT_NOISE = {
    "distribution": "float32(r cos(2 pi u2)), r = sqrt(-2 ln u1): Box-Muller in float64 with ln and cos as fixed "
                    "polynomials, Horner with one multiply and one add per term (ln: 2 s sum s^2k/(2k+1), k < 12, "
                    "s=(m-1)/(m+1), m in [sqrt(1/2), sqrt(2)); cos, sin: Taylor, k < 12, on quarter turns)",
    "uniforms": "x = splitmix64_mix(key + index * golden); u1 = (x >> 32 + 1) / 2^32, u2 = (x & 0xffffffff) / 2^32",
    "key": "splitmix64(member seed ^ name_hash(checkpoint tensor name))",
    "index": "the element's row-major index in the checkpoint tensor",
}
CHECKPOINT_ROUNDING = ("the float32 value's bits + (splitmix64_mix(key + index * golden) >> 40) & 0xffff, low 16 "
                       "bits cleared; key splitmix64(rounding seed of rank 0 ^ name_hash(checkpoint tensor name))")


def checkpoint_noise_definition(member_seeds: str, rounding: str) -> dict:
    """What a history records of a checkpoint-noise run's noise: CHECKPOINT_NOISE with its member seeds (the
    reference's, `member_seeds`), and for stochastic rounding its source (round to nearest adds no key)."""
    definition = dict(CHECKPOINT_NOISE, member_seeds=member_seeds)
    if rounding != "nearest":
        definition["rounding"] = f"{rounding}: {CHECKPOINT_ROUNDING}"
    return definition
