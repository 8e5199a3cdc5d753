"""The algorithm the four stages share: evolution strategies running inside vLLM workers at TP=2, and the 50-turn
bash-tool math agent it trains. How one generation uses it: the README's "One generation".

Sections, in order:
  1. run constants (Config)
  2. noise and ES math (pure functions): the rank-salted noise of the reference, the generation's member seeds and
     case batch, sigma_at, zscore, the update
  3. the vLLM worker extension that applies them inside each TP rank
  4. replay: a run history's updates applied again to the base weights
  5. the math agent: prompts, per-request seeds, the episode loop, the member step (perturb, the agent, restore), a
     member's fitness and the definition of its reward
Beside it in agentic_es/: how a setting is declared and checked, and the presets (settings.py); a reply's bash action
and the command's observation (actions.py); each turn's prompt ids (prompts.py); the learn task's problems and
shaped reward (learn_task.py). The errors a stage stops with are agentic_es/stage.py's (stage.ConfigError, ...).

The infrastructure lives beside it in agentic_es/, one concern per module (agentic_es/__init__.py maps them): engine.py
and pool.py run this on K vLLM engines, history.py records, refuses and rebuilds runs, data.py and metrics.py hold the
problems and the evaluation's metrics, fileio.py writes and reads the files, cli.py and tracking.py parse and watch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from agentic_es import (checkpoint_definition, digests, learn_task, restore_patch, sandbox, scoring, stage,
                        stochastic_rounding, vllm_platform, worker_memory)
from agentic_es.actions import format_observation, parse_action
from agentic_es.prompts import ChatPrompts
from agentic_es.settings import (CUDAGRAPH_MODES, DTYPES, EXECUTION, FITNESS_MODES, NOISE_MODES, POOL,  # noqa: F401
                                 PROMPT_MODES, RESTORE, RESTORE_MODES, ROUNDING_MODES, RUN, SPECULATIVE_MODES,
                                 TRACKING_MODES, WEIGHTS, Bounds, check_settings, setting)

REPO = Path(__file__).resolve().parent

# ============================================================================================================
# 1. Run constants: the reference run's. Edit here, or override any field on the command line (cli.py):
#    python 01_train.py --population=8 --alpha=1e-3      (nanoGPT style, parsed once by cli.parse_config)
#    python 01_train.py --preset=smoke                    (the tiny CPU run of the README)
# ============================================================================================================


@dataclass(frozen=True)
class Config:
    # the paper's constants: the run seed, G generations of N members on a case batch, the sigma schedule, alpha
    run_seed: int = setting(20260627, RUN, "member seeds, case batches and request seeds all derive from it",
                            bounds=Bounds(0, 2**32 - 1, why="vLLM seeds numpy's global generator with it"))
    generations: int = setting(20, RUN, "ES updates G (the sigma schedule runs over them)", bounds=Bounds(1))
    population: int = setting(16, RUN, "members N per generation",
                              bounds=Bounds(2, 65536, why="z-scores need two members; every member's seed, reward "
                                                          "and z-score is recorded each generation"))
    case_batch: int = setting(16, RUN, "problems per generation; a member's fitness is its mean reward on them",
                              bounds=Bounds(1))
    sigma_start: float = setting(1e-3, RUN, "noise scale at generation 0 (cosine schedule)",
                                 bounds=Bounds(0, low_open=True))
    sigma_end: float = setting(5e-4, RUN, "noise scale at the last generation", bounds=Bounds(0, low_open=True))
    alpha: float = setting(5e-4, RUN, "step size: theta += alpha / N * sum_i z_i eps_i (1/sigma folded in)",
                           bounds=Bounds(0, why="0: members are evaluated, the weights never move"))
    # evolution strategies: a member's fitness, the noise, the rounding of every change, how a perturbation is undone
    fitness: str = setting("agent", RUN, "a member's fitness, its episodes' mean reward: \"agent\" (the agent's "
                           "score, the reference) or \"shaped\" (the learn task's partial credit: shaped_reward)",
                           choices=FITNESS_MODES)
    noise: str = setting("rank_salted", WEIGHTS, '"rank_salted" (the reference: per-rank noise, the model exists at '
                         'this TP size only) or "checkpoint" (per checkpoint element: any TP size, a Hugging Face '
                         "export)", choices=NOISE_MODES)
    rounding: str = setting("nearest", WEIGHTS, 'bf16 rounding of every weight change: "nearest" (the reference) or '
                            '"stochastic" (unbiased: steps below half an ulp still move theta in expectation)',
                            choices=ROUNDING_MODES)
    noise_chunk: int = setting(8_388_608, WEIGHTS, "elements per float32 noise draw: part of the noise definition",
                               bounds=Bounds(1))
    restore: str = setting("copy_device", RESTORE, "copy_device | copy_host (pinned) | subtract (low memory, NOT "
                           "bit-exact in bf16) | patch (exact: subtract, then put back the elements it misses; "
                           "restore_patch.py)", choices=RESTORE_MODES)
    patch_capacity: float = setting(0.0, RESTORE, "restore=patch: the share of each rank's elements whose bits the "
                                    "patch can hold; 0: restore_patch.PATCH_CAPACITY of the rounding mode",
                                    bounds=Bounds(0, 1, why="0: 0.12 with rounding=nearest, 0.32 with stochastic"))
    # the math agent
    max_turns: int = setting(50, RUN, "assistant turns per episode", bounds=Bounds(1))
    max_new_tokens: int = setting(4096, RUN, "per assistant turn", bounds=Bounds(1))
    bash_timeout_s: float = setting(20.0, RUN, "wall-clock limit of one sandboxed bash command",
                                    bounds=Bounds(0, 86400, low_open=True, why="at most a day: the sandbox's CPU-time "
                                                                              "limit is made of it"))
    observation_chars: int = setting(4000, RUN, "characters of a command's result the model sees (its head and "
                                     "tail)", bounds=Bounds(1))
    allow_leaky_sandbox: bool = setting(False, RUN, "run even when the start-up leak check finds the data, run "
                                        "folder or other episodes visible to the sandbox (then every record says so)")
    prompt_mode: str = setting("render", RUN, 'each turn\'s prompt: "render" the conversation (as the reference) or '
                               '"continue" ids', choices=PROMPT_MODES)
    # sampling (training and evaluation alike)
    temperature: float = setting(1.0, RUN, "sampling (training and evaluation alike)",
                                 bounds=Bounds(0, 2, why="vLLM's range; 0: greedy"))
    top_p: float = setting(1.0, RUN, "sampling", bounds=Bounds(0, 1, low_open=True))
    top_k: int = setting(40, RUN, "sampling", bounds=Bounds(-1, why="-1 or 0: every token"))
    min_p: float = setting(0.0, RUN, "sampling", bounds=Bounds(0, 1))
    presence_penalty: float = setting(2.0, RUN, "sampling", bounds=Bounds(-2, 2, why="vLLM's range"))
    repetition_penalty: float = setting(1.0, RUN, "sampling", bounds=Bounds(0, low_open=True, why="1: none"))
    # data
    train_data: str = setting("data/dapo_train400.jsonl", RUN, 'built by 00_data.py; "smoke", "learn": arithmetic '
                              'made here; "compute": the compute task made here (agentic_es/compute_task.py)')
    learn_digits: int = setting(0, RUN, "the learn task's tier: additions of two numbers of this many digits; 0: of "
                                "2..19", bounds=Bounds(0, 30, why="0: the numbers 2..19; one digit is refused (too "
                                                                  "few pairs to hold out)"))
    compute_level: int = setting(1, RUN, "the compute task's level, of its training and held-out sets: 1 numbers in "
                                 "the hundreds, 2 thousands, 3 competition sizes", bounds=Bounds(1, 3))
    eval_problems: int = setting(0, RUN, "evaluate only the first K problems of each eval set (0: all)",
                                 bounds=Bounds(0, why="0: all"))
    smoke_eval: bool = setting(False, EXECUTION, "03_eval.py evaluates the smoke problems in place of the DAPO and "
                               "AIME files (the smoke preset's setting); --dapo=PATH or --aime2026=PATH still names a "
                               "set's file")
    # the model and its engines
    model: str = setting("Qwen/Qwen3-30B-A3B", WEIGHTS, 'HF id or local folder; "tiny-qwen3-dense" / '
                         '"tiny-qwen3-moe" are written locally')
    tensor_parallel_size: int = setting(2, WEIGHTS, "GPUs (TP ranks) per engine; part of the trained state "
                                        "(rank-salted noise)", bounds=Bounds(1))
    dtype: str = setting("bfloat16", WEIGHTS, "the runtime weights' dtype: perturbed, updated and saved in it",
                         choices=DTYPES)
    max_model_len: int = setting(40960, RUN, "Qwen3-30B-A3B's native context; a longer conversation ends the "
                                 "episode", bounds=Bounds(1))
    gpu_memory_utilization: float = setting(0.6, EXECUTION, "leaves room for the exact-restore copy of the weights "
                                            "on the GPU", bounds=Bounds(0, 1, low_open=True, why="the share of each "
                                                                        "GPU's memory vLLM may take"))
    cuda_graphs: bool = setting(True, EXECUTION, "CUDA graphs without inductor (engine.cuda_engine_args); CPU always "
                                "runs eager")
    cudagraph_mode: str = setting("FULL_AND_PIECEWISE", EXECUTION, "decode steps as full graphs, steps with a "
                                  'prefill as piecewise ones; "FULL_DECODE_ONLY" runs the latter eagerly (README)',
                                  choices=CUDAGRAPH_MODES)
    max_num_batched_tokens: int = setting(256, EXECUTION, "GPU: tokens per engine step, and CUDA graphs are "
                                          "captured up to it. 0: vLLM's defaults (2048-token steps, graphs only up "
                                          "to 256 tokens: longer steps eager)",
                                          bounds=Bounds(0, why="0: vLLM's default"))
    custom_all_reduce: bool = setting(False, EXECUTION, "GPU: vLLM's own all-reduce over NVLink peer memory instead "
                                      "of NCCL's (README)")
    speculative: str = setting("off", RUN, '"ngram": vLLM drafts tokens by n-gram lookup in each request\'s own ids '
                               "and the model verifies them (engine.speculative_config). Samples the same "
                               "distribution, not the same tokens: the random draws are spent otherwise, so it is a "
                               "run constant", choices=SPECULATIVE_MODES)
    speculative_tokens: int = setting(4, RUN, "speculative=ngram: tokens drafted per step (vLLM's "
                                      "num_speculative_tokens)", bounds=Bounds(1, 32))
    ngram_lookup_max: int = setting(4, RUN, "speculative=ngram: the longest n-gram matched (prompt_lookup_max)",
                                    bounds=Bounds(1))
    ngram_lookup_min: int = setting(2, RUN, "speculative=ngram: the shortest n-gram matched (prompt_lookup_min)",
                                    bounds=Bounds(1))
    concurrency: int = setting(256, EXECUTION, "episodes in flight at once", bounds=Bounds(1))
    engines: int = setting(0, POOL, "engines evaluating members at once (pool.py); 0: GPUs // tensor_parallel_size, "
                           "1 on CPU", bounds=Bounds(0, why="0: one per tensor_parallel_size GPUs"))
    ray_address: str = setting("", POOL, 'engines as Ray actors on this cluster ("auto", HEAD:PORT); empty: in this '
                               "process")
    # files
    run_dir: str = setting("runs/es", EXECUTION, "history, rollouts, export and eval results of the run live here")
    tracking: str = setting("none", EXECUTION, '"tensorboard": each generation\'s summary also to '
                            "<run_dir>/tensorboard", choices=TRACKING_MODES)

    def __post_init__(self):
        check_settings(self)


# ============================================================================================================
# 2. Noise and ES math: pure functions of their arguments, which the worker extension (section 3) applies. How one
#    generation uses them: the README's "One generation".
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


CASE_BATCH_SEED_TAG = 0xCA5E  # keeps case-batch streams apart from other streams seeded by (run seed, g)


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


def active_members(seeds: list[int], coeffs: list[float]) -> list[tuple[int, float]]:
    """The (seed, coefficient) pairs that change theta: a member with coefficient 0 (z = 0) adds nothing, so its
    noise is never drawn."""
    return [(s, c) for s, c in zip(seeds, coeffs) if c != 0.0]


def noise_chunks(numel: int, seed: int, chunk: int, device):
    """The noise eps of one parameter, drawn from one generator in flat chunks of `chunk` elements: each chunk's
    float32 standard normals, in order."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    for start in range(0, numel, chunk):
        yield torch.randn(min(chunk, numel - start), generator=gen, dtype=torch.float32, device=device)


def add_noise_(flat: torch.Tensor, seeds: list[int], coeffs: list[float], chunk: int,
               write_=torch.Tensor.copy_) -> None:
    """docs/algorithm.md's perturb (one member, coefficient sigma) and update (coefficients alpha/N z_i) of one
    parameter: flat <- round(float32(flat) + sum_i coeffs_i * eps(seeds_i)), chunk by chunk, each member's noise
    drawn as it is added, accumulated in float32 and rounded once by write_(values, acc): to nearest (a copy), or
    stochastically (stochastic_rounding.write_for)."""
    noise = [noise_chunks(flat.numel(), s, chunk, flat.device) for s in seeds]
    for values in flat.split(chunk):
        write_(values, float32_sum(values, (next(eps) for eps in noise), coeffs))


def add_noise_through_patch_(patch: restore_patch.RestorePatch, flat: torch.Tensor, seeds: list[int],
                             coeffs: list[float], chunk: int, write_=torch.Tensor.copy_) -> None:
    """add_noise_ with restore="patch": the same change, walked by the patch (restore_patch.walk_)."""
    noise = [noise_chunks(flat.numel(), s, chunk, flat.device) for s in seeds]
    restore_patch.walk_(patch, flat, chunk, coeffs, lambda start, end: [next(eps) for eps in noise], float32_sum,
                        lambda values, start, end, acc: write_(values, acc))


def float32_sum(values: torch.Tensor, noise, coeffs: list[float]) -> torch.Tensor:
    """float32(values) + sum_i coeffs_i * noise_i, accumulated in float32 member by member (torch's add with alpha:
    on CPU a fused multiply-add): a new tensor, also for float32 values."""
    acc = values.to(torch.float32, copy=True)
    for eps, c in zip(noise, coeffs):
        acc.add_(eps, alpha=c)
    return acc


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


# ---- The noise kinds (Config.noise): the reference's rank-salted noise above, or the checkpoint noise
# (checkpoint_noise.py, its record checkpoint_definition.py): per checkpoint element, the same weights at any TP size

def is_checkpoint_noise(settings: Config | dict) -> bool:
    """Whether a run's settings (a Config, or what a file records of one: a history's config, an export's manifest)
    use the checkpoint noise. The one place that asks."""
    return (settings.get("noise") if isinstance(settings, dict) else settings.noise) == "checkpoint"


def noise_definition(cfg: Config) -> dict:
    """What a history records of the noise: its definition, and for stochastic rounding the rounding's source
    (round to nearest, the reference, adds no key)."""
    if is_checkpoint_noise(cfg):
        return checkpoint_definition.checkpoint_noise_definition(NOISE_DEFINITION["member_seeds"], cfg.rounding)
    definition = dict(NOISE_DEFINITION, chunk=cfg.noise_chunk)
    if cfg.rounding != "nearest":
        definition["rounding"] = f"{cfg.rounding}: {STOCHASTIC_ROUNDING}"
    return definition


# ============================================================================================================
# 3. The vLLM worker extension: vLLM mixes ESWorker into every TP worker (WORKER_EXTENSIONS); the driver calls its
#    methods with collective_rpc and gets one result per rank, in rank order (the README's "One generation").
# ============================================================================================================


def es_parameters(named_parameters) -> list[tuple[str, torch.Tensor]]:
    """The ES parameter set: every floating-point parameter, one entry per storage (tied or
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


# The worker extension of each noise kind (Config.noise), by qualified name: vLLM imports it in every worker. The
# checkpoint noise's subclass lives in checkpoint_noise.py, which imports this module.
WORKER_EXTENSIONS = {"rank_salted": "common.ESWorker", "checkpoint": "agentic_es.checkpoint_noise.CheckpointESWorker"}



class ESWorker(worker_memory.WorkerMemory):
    """Methods run inside each TP worker; they return plain JSON-able values. es_configure once, when the engine
    starts; then docs/algorithm.md's perturb, restore and update of every parameter of this rank:
    es_perturb(seed, sigma), es_restore() and es_update(seeds, coeffs). The reference path is _es_add_noise: the rank-salted noise, added by
    add_noise_'s loop, rounded to nearest. Its variants, each one call:
      - rounding="stochastic": _es_rounding_seed, the random source of a change's rounding (None: to nearest), and
        stochastic_rounding.write_for, the write add_noise_ rounds each chunk with;
      - noise="checkpoint": checkpoint_noise.CheckpointESWorker overrides _es_add_noise;
      - the restore modes (the last part of the class): copy_device and copy_host keep a copy of the centre
        (_es_keep_copy) and copy it back (_es_copy_back); subtract adds the noise again, negated (_es_add_noise);
        patch perturbs and restores through restore_patch.py (_es_perturb_through_patch, _es_restore_through_patch).
    """

    es_settings: dict | None = None  # es_configure's: chunk, restore, rounding, patch_capacity
    es_copy: list[torch.Tensor] | None = None  # the exact-restore copy: always the centre theta (es_snapshot)
    es_patch: restore_patch.RestorePatch | None = None  # restore="patch": where subtracting the noise misses
    es_perturbation: tuple | None = None  # (seed, sigma) of the perturbation in effect
    es_staging: list | None = None  # es_digest's pinned host buffers on a GPU: made once, reused every generation

    @functools.cached_property
    def es_rank(self) -> int:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()

    @functools.cached_property
    def es_params(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's ES parameters (es_parameters): what is perturbed, updated, digested and saved."""
        return es_parameters(self.model_runner.model.named_parameters())

    def es_parameter_names(self) -> list[dict]:
        return [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype)} for n, t in self.es_params]

    def es_device(self) -> dict:
        """The device model this rank draws its noise on: CUDA's normal streams depend on the GPU model; on the CPU
        they depend on torch's kernel set (the AVX2 kernels' normals differ from the scalar ones)."""
        device = self.es_params[0][1].device
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            return {"name": props.name, "sm_count": props.multi_processor_count}
        return {"name": f"cpu ({torch.backends.cpu.get_cpu_capability()} kernels)", "sm_count": None}

    def es_digest(self) -> dict:
        device = self.es_params[0][1].device
        if device.type == "cuda" and self.es_staging is None:  # pinned once, reused every generation
            self.es_staging = [digests.DigestStaging(device) for _ in range(digests.DIGEST_THREADS_PER_RANK)]
        named = digests.tensor_digests(self.es_params, digests.DIGEST_THREADS_PER_RANK, self.es_staging)
        return {"rank": self.es_rank, "digest": digests.combine_digests(named), "params": len(named)}

    def es_configure(self, chunk: int, restore: str, rounding: str, patch_capacity: float) -> None:
        """The run's ES settings, given once when the engine starts (the history records each): elements per noise
        draw (Config.noise_chunk), the restore mode, the rounding of every change, and the share of the elements
        the patch holds (restore="patch")."""
        if self.es_perturbation is not None:
            raise RuntimeError("es_configure called on a perturbed model; restore first")
        self.es_settings = {"chunk": chunk, "restore": restore, "rounding": rounding, "patch_capacity": patch_capacity}

    def es_perturb(self, seed: int, sigma: float) -> str | None:
        """theta_r <- theta_r + sigma * eps(seed) for every parameter, keeping what the restore mode needs. Returns
        None; with restore="patch", for a member that misses more elements than the patch holds on any rank, every
        rank is left at the exact centre, unperturbed, and returns the refusal with the numbers (the driver raises
        it: a raised worker error would leave vLLM's engine unusable)."""
        if self.es_perturbation is not None:
            raise RuntimeError("es_perturb called twice without es_restore")
        if self.es_settings["restore"] == "patch":
            refusal = self._es_perturb_through_patch(seed, sigma)
        else:
            self._es_keep_copy()
            self._es_add_noise("perturb", [seed], [sigma])
            refusal = None
        if refusal is None:
            self.es_perturbation = (seed, sigma)
        self._es_sync()
        return refusal

    def es_restore(self) -> None:
        """Back to the pre-perturbation bits (restore="subtract": approximately)."""
        if self.es_perturbation is None:
            raise RuntimeError("es_restore called without a perturbation")
        seed, sigma = self.es_perturbation
        restore = self.es_settings["restore"]
        if restore == "patch":
            self._es_restore_through_patch(seed, sigma)
        elif restore == "subtract":
            self._es_add_noise("restore", [seed], [-sigma])  # not exact in bf16 (docs/exact_restore.md)
        else:
            self._es_copy_back()
        self.es_perturbation = None
        self._es_sync()

    def es_update(self, seeds: list[int], coeffs: list[float]) -> None:
        """theta_r <- theta_r + sum_i coeffs_i * eps(seeds_i), float32 accumulation, rounded once."""
        if self.es_perturbation is not None:
            raise RuntimeError("es_update called on a perturbed model; restore first")
        if self._es_add_noise("update", seeds, coeffs) and self.es_copy is not None:
            for (_, t), saved in zip(self.es_params, self.es_copy):  # the saved copy always holds the centre
                saved.copy_(t)
        self._es_sync()

    def _es_add_noise(self, kind: str, seeds: list[int], coeffs: list[float],
                      patch: restore_patch.RestorePatch | None = None) -> bool:
        """theta_r <- round(theta_r + sum_i coeffs_i * eps(seeds_i, r, n)) for every parameter n, over the active
        members: add_noise_, or through `patch` add_noise_through_patch_ (restore="patch"). kind: "perturb",
        "update", or "restore" (subtracts); it picks the rounding (_es_rounding_seed). Returns whether any member is
        active (False: theta untouched)."""
        active = active_members(seeds, coeffs)
        for name, theta in self.es_params if active else []:
            noise_seeds = [noise_seed(s, self.es_rank, name) for s, _ in active]
            active_coeffs = [c for _, c in active]
            write_ = stochastic_rounding.write_for(theta, self._es_rounding_seed(kind, seeds, name))
            if patch is None:
                add_noise_(theta.view(-1), noise_seeds, active_coeffs, self.es_settings["chunk"], write_)
            else:
                add_noise_through_patch_(patch, theta.view(-1), noise_seeds, active_coeffs, self.es_settings["chunk"],
                                         write_)
        return bool(active)

    def _es_rounding_seed(self, kind: str, seeds: list[int], name: str) -> int | None:
        """The random source of a change's stochastic rounding (rounding_seed), or None: round to nearest, the
        reference's, and always for a restore, which subtracts the noise again."""
        return rounding_seed(kind, seeds, self.es_rank, name) if self._es_stochastic(kind) else None

    def _es_stochastic(self, kind: str) -> bool:
        """Whether a change rounds stochastically: a perturbation or update with rounding="stochastic"."""
        return kind != "restore" and self.es_settings["rounding"] == "stochastic"

    def _es_gather(self, value) -> list:
        """value from every TP rank, in rank order."""
        from vllm.distributed import get_tp_group

        group = get_tp_group()
        if group.world_size == 1:
            return [value]
        every_rank = [None] * group.world_size
        torch.distributed.all_gather_object(every_rank, value, group=group.cpu_group)
        return every_rank

    def _es_sync(self):
        """Wait for the device: a call returns when the weights have changed (the driver times the calls)."""
        if self.es_params[0][1].is_cuda:
            torch.cuda.synchronize()

    # ---- The restore modes (Config.restore): what a perturbation keeps, and how es_restore undoes it. copy_device
    # and copy_host keep a copy of the centre, taken once; patch records where subtracting the noise again misses the
    # original bits (restore_patch.py); subtract keeps nothing and is not exact in bf16.

    def es_snapshot(self) -> int:
        """Take the exact-restore copy, or allocate the patch (restore="patch"), now: a pool's GPU engines reserve
        it at start. Returns its bytes."""
        if self.es_settings["restore"] == "patch":
            return self._es_patch().nbytes
        if self.es_copy is None:
            self._es_snapshot()
        return sum(c.numel() * c.element_size() for c in self.es_copy)

    def _es_snapshot(self) -> None:
        on_host = self.es_settings["restore"] == "copy_host" and self.es_params[0][1].device.type != "cpu"
        self.es_copy = [t.to("cpu").pin_memory() if on_host else t.clone() for _, t in self.es_params]

    def _es_keep_copy(self) -> None:
        """copy_device and copy_host: the copy of the centre, taken before the first perturbation (subtract keeps
        nothing)."""
        if self.es_settings["restore"] in ("copy_device", "copy_host") and self.es_copy is None:
            self._es_snapshot()

    def _es_copy_back(self) -> None:
        for (_, t), saved in zip(self.es_params, self.es_copy):
            t.copy_(saved, non_blocking=True)

    def _es_patch(self) -> restore_patch.RestorePatch:
        """The patch of the configured capacity, allocated once (a pool's GPU engines reserve it at start)."""
        capacity = self.es_settings["patch_capacity"]
        if self.es_patch is None or self.es_patch.capacity != capacity:
            self.es_patch = None  # the old one's memory first
            self.es_patch = restore_patch.RestorePatch([t for _, t in self.es_params], capacity)
        return self.es_patch

    def _es_perturb_through_patch(self, seed: int, sigma: float) -> str | None:
        """es_perturb with restore="patch": the perturbation, recording in the patch what subtracting it would
        miss; on an overflow of any rank, every rank back at the centre and the refusal returned."""
        patch = self._es_patch()
        patch.start_recording()
        try:
            self._es_add_noise("perturb", [seed], [sigma], patch)
            overflow = None
        except restore_patch.PatchFull as e:
            overflow = str(e)
        overflows = self._es_gather(overflow)  # every rank learns of any rank's overflow
        if not any(overflows):
            return None
        self._es_restore_through_patch(seed, sigma)  # the part done is restored exactly, the rest never changed
        where = "; ".join(f"rank {r}: {o}" for r, o in enumerate(overflows) if o)
        return (f"restore=patch: member seed {seed} at sigma {sigma:g} misses more elements than the patch "
                f"holds (patch_capacity={patch.capacity:g} of each rank's elements; {where}). The weights are back "
                "at the centre; raise --patch_capacity or use --restore=copy_device")

    def _es_restore_through_patch(self, seed: int, sigma: float) -> None:
        """theta_r - sigma * eps(seed), rounded to nearest, and the elements the subtraction misses given their
        original bits back by the patch."""
        self.es_patch.start_applying()
        self._es_add_noise("restore", [seed], [-sigma], self.es_patch)
        self.es_patch.check_applied()


# ============================================================================================================
# 4. Replay: a run history records everything that defines theta (history.py: its file, the run's identity and
#    the refusals of another run's), so that any stage can rebuild theta from the base weights.
# ============================================================================================================

Z_TOLERANCE = 1e-6  # recorded z against the z-scores of the recorded rewards, relative to the z scale (max(1, |z|))


def recorded_z(record: dict) -> list[float]:
    """A generation's recorded z-scores (what training applied, so what a replay applies), refused unless they are
    the z-scores of its recorded rewards within Z_TOLERANCE: another numpy may compute them a few ulps (~1e-16) off,
    an edited reward moves them by orders of magnitude more than the tolerance."""
    z = zscore(record["rewards"])
    gap = max(abs(a - b) for a, b in zip(z, record["z"])) if len(z) == len(record["z"]) else math.inf
    tolerance = Z_TOLERANCE * max(1.0, *(abs(v) for v in z))
    if not gap <= tolerance:  # (also a NaN)
        raise stage.HistoryMismatch(f"generation {record['generation']}: the recorded z-scores {record['z']} differ "
                                    f"from the z-scores of the recorded rewards {record['rewards']} by {gap:.3g} > "
                                    f"tolerance {tolerance:.3g}: an edited history (a numpy change moves them by ulps)")
    return record["z"]


def replay(engine, generations, base_digests: list[str]) -> list[str]:
    """Re-apply recorded updates (seeds, alpha, the recorded z: recorded_z) to the base weights of `engine` (an
    engine.Engine or a pool.EnginePool), checking each generation's per-rank digests; returns the digests of the rebuilt weights. `generations`: the records, or a
    progress bar over them."""
    per_rank = base_digests
    for record in generations:
        engine.update(record["seeds"], update_coefficients(recorded_z(record), record["alpha"]))
        per_rank = engine.digests()
        if per_rank != record["digests"]:
            raise stage.HistoryMismatch(
                f"replay diverged at generation {record['generation']}: per-rank digests {per_rank} "
                f"!= recorded {record['digests']} (different base weights, vLLM version or device?)")
    return per_rank


# ============================================================================================================
# 5. The math agent: a ReAct loop with one sandboxed `bash` tool
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


# ---- Seeds: every request carries its own seed, so any sample can be re-run on its own

def request_seed(run_seed, problem_id, sample_index, turn):
    """Stable 63-bit seed for one model request (blake2b, not Python's per-process salted hash())."""
    key = json.dumps(["es-agent-request", int(run_seed), str(problem_id), int(sample_index), int(turn)])
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


# ---- The sandbox of a run: checked once at start-up, by every stage that runs model-written commands

def check_sandbox(cfg: Config, data=(), checkpoint=None) -> list[str]:
    """sandbox.check_sandbox for this run's folder and the given data and checkpoint: a sandbox that lets commands see
    them is refused (a ConfigError) unless cfg.allow_leaky_sandbox. Returns the leaks it found."""
    return sandbox.check_sandbox(cfg.run_dir, data, checkpoint, allow_leaks=cfg.allow_leaky_sandbox,
                                 error=stage.ConfigError)


# ---- The episode loop

SANDBOX_MAX_PARALLEL = 32  # bash calls running at once in run_episodes (threads in the tool executor)


async def run_episode(policy, problem, sample_index, cfg: Config, *, sandbox_check: dict, tool_executor=None):
    """One agent episode on one problem ({id, question, answer}) under the run's settings (cfg.run_seed, max_turns,
    max_new_tokens, observation_chars, bash_timeout_s), its commands in the sandbox that `sandbox_check` names
    ({kind, leaks, override}: sandbox.leak_check_result(), which the record carries). `policy(messages, seed=,
    max_tokens=)` is async and returns a dict: the reply's "text" and, where the policy counts them, its
    "prompt_tokens" and "completion_tokens", and where it tells, its "finish_reason" (vLLM's: "stop" where the reply
    ended, "length" where it was cut at max_tokens). The record keeps each reply's finish reason, in turn order
    (reply_finish_reasons; None where the policy does not tell).

    A reply with a bash action runs it, even if it also states a final answer: the answer was written before the
    command's output was seen, so the model has to restate it afterwards. A final answer counts only after at
    least one bash call; before that it is refused and the loop continues."""
    started = time.monotonic()
    problem_id = problem["id"]
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": user_prompt(problem["question"])}]
    turns = bash_calls = prompt_tokens = completion_tokens = 0
    prediction, error = None, None
    finish_reason, reply_finish_reasons = "max_turns", []
    run_bash = functools.partial(sandbox.run_bash, timeout_s=cfg.bash_timeout_s, sandbox=sandbox_check["kind"])
    workdir = sandbox.make_workdir()
    try:
        for turn in range(cfg.max_turns):
            seed = request_seed(cfg.run_seed, problem_id, sample_index, turn)
            try:
                reply = await policy(messages, seed=seed, max_tokens=cfg.max_new_tokens)
            except ContextOverflow as exc:
                finish_reason, error = "context_overflow", f"ContextOverflow: {exc}"
                break
            text = reply["text"]
            turns += 1
            prompt_tokens = reply.get("prompt_tokens", 0)
            completion_tokens += reply.get("completion_tokens", 0)
            reply_finish_reasons.append(reply.get("finish_reason"))
            messages.append({"role": "assistant", "content": text})

            command = parse_action(text)
            answer = scoring.extract_final_answer(text)
            if command is not None:
                result = await asyncio.get_running_loop().run_in_executor(
                    tool_executor, functools.partial(run_bash, command, workdir))
                bash_calls += 1
                messages.append({"role": "user", "content": format_observation(result, cfg.observation_chars)})
            elif answer is not None and bash_calls == 0:
                messages.append({"role": "user", "content": ANSWER_BEFORE_BASH_MESSAGE})
            elif answer is not None:
                prediction, finish_reason = answer, "final_answer"
                break
            else:
                messages.append({"role": "user", "content": NO_ACTION_MESSAGE})
    except stage.EngineFailure:  # vLLM failed, not this episode: no record, the whole batch stops
        raise
    except Exception as exc:  # a policy or sandbox failure ends this episode only; it never scores
        finish_reason, error = "error", f"{type(exc).__name__}: {exc}"
    finally:
        sandbox.remove_workdir(workdir)

    reason = scoring.unscored_reason(prediction, bash_calls=bash_calls, finish_reason=finish_reason, error=error)
    score, score_method = (0.0, reason) if reason else await scoring.score_answer_isolated(prediction, problem["answer"])
    return {
        "problem_id": problem_id, "sample_index": sample_index,
        "seed": request_seed(cfg.run_seed, problem_id, sample_index, 0),
        "score": score, "score_method": score_method, "prediction": prediction, "gold": problem["answer"],
        "turns": turns, "bash_calls": bash_calls, "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens, "finish_reason": finish_reason,
        "reply_finish_reasons": reply_finish_reasons, "error": error,
        "sandbox": sandbox_check["kind"], "sandbox_leaks": sandbox_check["leaks"],
        "sandbox_override": sandbox_check["override"], "messages": messages,
        "seconds": time.monotonic() - started,
    }


async def run_episodes(policy, problems_and_sample_indices, cfg: Config, *, sandbox_check: dict, progress=None,
                       tool_executor=None):
    """Run many episodes (run_episode), at most cfg.concurrency at once; records come back in input order,
    `progress(record)` is called as each ends; each record's "ended_s" is its end in seconds from this call's start
    (a member's straggler tail: generation_time.tail_share). Bash calls run in a thread pool of SANDBOX_MAX_PARALLEL
    workers unless tool_executor is given. An EngineFailure (or cancellation) in one episode cancels the others and
    is raised once they have stopped; the episodes that finished before it have been passed to `progress`."""
    items = list(problems_and_sample_indices)
    limit = asyncio.Semaphore(cfg.concurrency)
    began = time.monotonic()
    own_executor = None
    if tool_executor is None:
        tool_executor = own_executor = concurrent.futures.ThreadPoolExecutor(max_workers=SANDBOX_MAX_PARALLEL,
                                                                             thread_name_prefix="sandbox")

    async def one(problem, sample_index):
        async with limit:
            record = await run_episode(policy, problem, sample_index, cfg, sandbox_check=sandbox_check,
                                       tool_executor=tool_executor)
        record["ended_s"] = time.monotonic() - began
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


# ---- The member step of ES: one member's episodes on one engine

def evaluate_member(engine, seed: int, sigma: float, jobs: list[tuple[dict, int]], *, desc: str | None = None,
                    on_record=None) -> tuple[list[dict], dict]:
    """theta + sigma * eps(seed) on `engine` (an engine.Engine, or a pool's engine in a Ray actor), the agent on
    `jobs` ((problem, sample index) pairs: one episode each, run_episodes), then the exact theta back. Returns the
    member's records in input order and the seconds of each step, with the member's span on this process's
    perf_counter clock ("began_at", "ended_at": which members were in flight at once). The pool runs it on its next
    free engine (EnginePool.map); on_record(record) as each episode ends, desc: the episodes' progress bar (None:
    none)."""
    started = time.perf_counter()
    engine.perturb(seed, sigma)
    perturbed = time.perf_counter()
    records = engine.run_agent(jobs, desc=desc, on_record=on_record)
    ran = time.perf_counter()
    engine.restore()
    ended = time.perf_counter()
    return records, {"perturb": perturbed - started, "rollout": ran - perturbed, "restore": ended - ran,
                     "began_at": started, "ended_at": ended}


# ---- A member's fitness (Config.fitness): the mean of one reward per episode of its case batch

def agent_reward(record: dict) -> float:
    """The agent's own score (scoring.py): 1 for a correct final answer after a bash call, else 0."""
    return float(record["score"])


EPISODE_REWARDS = {"agent": agent_reward, "shaped": learn_task.shaped_reward}  # by Config.fitness (FITNESS_MODES)


def fitness(records: list[dict], mode: str) -> float:
    """A member's fitness: the mean reward of its episodes, each scored as the fitness mode (Config.fitness) says
    (EPISODE_REWARDS). An episode the scorer gave no score for (SCORER_FAILURES, within the bound) says nothing of
    the member's answer: it is left out of the mean (scored_records), not a 0 that would bias z against whichever
    member it hit."""
    reward = EPISODE_REWARDS[mode]
    scored = scored_records(records)
    return sum(reward(r) for r in scored) / len(scored)


def scored_records(records: list[dict]) -> list[dict]:
    """The episodes the scorer gave a score for (not SCORER_FAILURES); ScorerFailure where it gave none."""
    scored = [r for r in records if r.get("score_method") not in stage.SCORER_FAILURES]
    if not scored:
        raise stage.ScorerFailure(f"the scorer failed on all {len(records)} episodes of a member: it has no fitness")
    return scored


@functools.cache
def agent_score_version() -> str:
    """The agent's score's policy as the code that scores it: scoring.py's sha256 (any edit of it may score an answer
    otherwise)."""
    return "agentic_es/scoring.py sha256:" + hashlib.sha256(Path(scoring.__file__).read_bytes()).hexdigest()


def reward_definition(fitness_mode: str) -> dict:
    """How an episode's reward is scored under a fitness mode (Config.fitness): the agent's score
    (agent_score_version), and for the shaped reward its rules (learn_task.SHAPED_REWARD_RULES)."""
    definition = {"fitness": fitness_mode, "agent_score": agent_score_version()}
    if fitness_mode == "shaped":
        definition["shaped_rules"] = learn_task.SHAPED_REWARD_RULES
    return definition


def reward_differences(recorded: dict, current: dict, what: str, this: str) -> list[str]:
    """Each part of two reward definitions that differs, named with both values: `what` has the recorded one,
    `this` the current one."""
    return [f"reward {key}: {what} has {recorded.get(key)!r}, {this} has {value!r}"
            for key, value in current.items() if recorded.get(key) != value]


# A vLLM CPU worker imports this module (worker_extension_cls) before its model loads, which is when the linear
# layers must keep their weights: the engine marks its worker processes with this variable (vllm_platform.configure_cpu_env)
# so that importing common anywhere else changes nothing
if os.environ.get(vllm_platform.KEEP_CPU_WEIGHTS_ENV) == "1":
    vllm_platform.keep_cpu_linear_weights()
    vllm_platform.freeze_imported_heap()


def __getattr__(name: str):
    """common.ConfigError and the other errors of a stage, for code outside the repository written while common.py
    re-exported them: stage.ConfigError is their one spelling here."""
    if name in ("StageError", "ConfigError", "DataError", "HistoryMismatch", "EngineFailure", "ScorerFailure",
                "PatchOverflow", "ExportError"):
        return getattr(stage, name)
    raise AttributeError(f"module 'common' has no attribute {name!r}")
