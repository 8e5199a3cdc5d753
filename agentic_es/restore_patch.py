"""Exact restore without a copy of the weights (restore="patch"). Subtracting the same noise from the rounded
perturbed value gives the original bits back for most elements (bench/README.md measures how many). The
perturbation finds the others itself, chunk by chunk, by computing the restore's result before it is needed, and the
patch keeps their original bits: one bit per element (where the subtraction misses) plus the missed elements' bits in
walk order, in buffers of fixed capacity allocated once, so that the memory plan can count them. Both noise kinds
change a parameter through the patch by its walk (walk_): common.add_noise_through_patch_ and
checkpoint_noise.add_checkpoint_noise_through_patch_, the patch's variants of their plain loops."""

import math

import torch

# Config.patch_capacity=0: a margin above the share of elements the subtraction misses in each rounding mode
# (bench/README.md)
PATCH_CAPACITY = {"nearest": 0.12, "stochastic": 0.32}
BIT_SHIFTS = (0, 1, 2, 3, 4, 5, 6, 7)


def patch_capacity(cfg) -> float:
    """The share of each rank's elements a patch holds: Config.patch_capacity, or its rounding mode's default."""
    return cfg.patch_capacity or PATCH_CAPACITY[cfg.rounding]


def patch_bytes(numel: dict[torch.dtype, int], capacity: float) -> int:
    """The bytes of one rank's patch, all of them allocated when the patch is made, as RestorePatch allocates them:
    a bit per element, and for each dtype `capacity` of its elements (`numel`: elements per dtype) at its size."""
    return ((sum(numel.values()) + 7) // 8
            + sum(math.ceil(capacity * n) * dtype.itemsize for dtype, n in numel.items()))


def walk_(patch: "RestorePatch", flat: torch.Tensor, chunk: int, coeffs: list[float], noise, summed,
          write_rounded_) -> None:
    """One parameter's change flat <- round(float32(flat) + sum_i coeffs_i * eps_i) through the patch, chunk by chunk:
    how either noise kind changes a parameter with restore="patch". The noise kind gives noise(start, end), its
    members' float32 noise for the elements [start, end) (asked once per chunk, in order: a stream may be drawn);
    summed(values, noise, coeffs), its float32 sum; write_rounded_(values, start, end, acc), its rounding.
    Recording (a perturbation), each chunk's original bits are kept and the restore's result is computed ahead: the
    same sum of the same noise negated, rounded to nearest. Applying (the restore, which subtracts), each chunk's
    missed elements get their bits back. The walk stops where the perturbation stopped (done)."""
    for start in range(0, flat.numel(), chunk):
        if patch.done():
            return
        end = min(start + chunk, flat.numel())
        values, eps = flat[start:end], noise(start, end)
        original = values.clone() if patch.recording else None
        write_rounded_(values, start, end, summed(values, eps, coeffs))
        patch.chunk(values, original, lambda: summed(values, eps, [-c for c in coeffs]))


class PatchFull(RuntimeError):
    """A perturbation misses more elements than the patch holds; the chunk being perturbed has been put back (the
    worker puts back the rest and the driver raises stage.PatchOverflow)."""


class RestorePatch:
    """The patch of one rank's ES parameters, for one perturbation at a time. The noise functions walk the
    parameters in the same order, chunk by chunk, when perturbing (recording) and restoring (applying), so an
    element is its position in that walk (`cursor`): a bit per element in `mask`, and in `values` (one buffer per
    dtype) the original bits of the missed elements, in walk order."""

    def __init__(self, tensors: list[torch.Tensor], capacity: float):
        numel = {}
        for t in tensors:
            numel[t.dtype] = numel.get(t.dtype, 0) + t.numel()
        device = tensors[0].device
        self.numel, self.capacity = sum(numel.values()), capacity
        self.mask = torch.zeros((self.numel + 7) // 8, dtype=torch.uint8, device=device)
        self.values = {d: torch.empty(math.ceil(capacity * n), dtype=d, device=device) for d, n in numel.items()}
        self.shifts = torch.tensor(BIT_SHIFTS, dtype=torch.uint8, device=device)
        self.recording, self.cursor, self.end = False, 0, self.numel
        self.used = dict.fromkeys(numel, 0)  # values recorded, per dtype
        self.taken = dict.fromkeys(numel, 0)  # values put back in this restore

    @property
    def nbytes(self) -> int:
        return self.mask.numel() + sum(v.numel() * v.element_size() for v in self.values.values())

    def start_recording(self) -> None:
        self.mask.zero_()
        self.recording, self.cursor, self.end = True, 0, self.numel
        self.used = dict.fromkeys(self.used, 0)

    def start_applying(self) -> None:
        """Before a restore: of the whole perturbation, or, after an overflow, of the part done (cursor)."""
        self.recording, self.end, self.cursor = False, self.cursor if self.recording else self.end, 0
        self.taken = dict.fromkeys(self.taken, 0)

    def done(self) -> bool:
        """Every element the perturbation changed has been seen (the walk stops here after an overflow)."""
        return self.cursor >= self.end

    def check_applied(self) -> None:
        if self.cursor != self.end or self.taken != self.used:
            raise RuntimeError(f"restore=patch: the restore walked {self.cursor} of {self.end} elements and put back "
                               f"{self.taken} of {self.used} patched values: not the perturbation's walk")

    def chunk(self, values: torch.Tensor, original: torch.Tensor | None, restored) -> None:
        """Called by walk_ after writing a chunk: recording, `restored()` is what the restore will
        compute (float32) and the chunk's misses against `original` are noted; applying, the chunk has just been
        restored and its misses get their bits back."""
        if self.recording:
            self._record(values, original, torch.empty_like(values).copy_(restored()))
        else:
            self._apply(values)

    def _record(self, values: torch.Tensor, original: torch.Tensor, estimate: torch.Tensor) -> None:
        width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[values.element_size()]
        misses = original.view(width) != estimate.view(width)  # bitwise: -0.0 vs +0.0 and NaN payloads are misses
        k, used, store = int(misses.sum()), self.used[values.dtype], self.values[values.dtype]
        if used + k > store.numel():
            values.copy_(original)
            raise PatchFull(f"at least {used + k} of {self.numel} elements ({values.dtype}) need the patch after "
                                f"{self.cursor + values.numel()} of them, capacity {store.numel()}")
        lead, n = self.cursor % 8, values.numel()
        padded = torch.zeros(lead + n + (-(lead + n)) % 8, dtype=torch.uint8, device=values.device)
        padded[lead:lead + n] = misses
        first = self.cursor // 8
        packed = (padded.view(-1, 8) << self.shifts).sum(1, dtype=torch.uint8)
        self.mask[first:first + packed.numel()] |= packed
        store[used:used + k] = original[misses]
        self.used[values.dtype] += k
        self.cursor += n

    def _apply(self, values: torch.Tensor) -> None:
        lead, n, first = self.cursor % 8, values.numel(), self.cursor // 8
        bits = (self.mask[first:(self.cursor + n + 7) // 8, None] >> self.shifts) & 1
        where = bits.view(-1)[lead:lead + n].nonzero().squeeze(1)
        taken, k = self.taken[values.dtype], where.numel()
        values[where] = self.values[values.dtype][taken:taken + k]
        self.taken[values.dtype] += k
        self.cursor += n
