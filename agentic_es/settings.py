"""The settings machinery of common.Config: the values of the settings that name a mode, the roles a setting plays
(which history.py's rules, 03_eval.py's reuse of finished episodes and --help read), setting() and Bounds (how a
field declares its default, role, meaning and valid values), the check of every value whenever a Config is made, and
the presets (--preset=NAME). A leaf: common.py imports it, it imports only stage.py; the run constants themselves
are common.Config's.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from agentic_es import stage

# The values of the settings that name a mode
RESTORE_MODES = ("copy_device", "copy_host", "subtract", "patch")
ROUNDING_MODES = ("nearest", "stochastic")
NOISE_MODES = ("rank_salted", "checkpoint")
PROMPT_MODES = ("render", "continue")  # see ChatPrompts
TRACKING_MODES = ("none", "tensorboard")
FITNESS_MODES = ("agent", "shaped")  # see EPISODE_REWARDS
DTYPES = ("bfloat16", "float16", "float32")
CUDAGRAPH_MODES = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "FULL", "PIECEWISE", "NONE")  # vLLM's CUDAGraphMode
SPECULATIVE_MODES = ("off", "ngram")  # see engine.speculative_config

# A setting's role, which history.py's rules, 03_eval.py's reuse of finished episodes and --help read (cli.ROLE_RULES
# says in words what the settings of each role may do)
WEIGHTS = "weights"  # defines the trained weights
RUN = "run"  # a run constant: what the run computes besides the weights' definition
EXECUTION = "execution"  # where and how fast a stage runs, never what it computes
POOL = "pool"  # how many engines run, and where: this machine's, never recorded in a history
RESTORE = "restore"  # how a member's perturbation is undone


@dataclass(frozen=True)
class Bounds:
    """The valid values of a numeric setting: low..high, each end included unless marked open."""
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    why: str = ""

    def admits(self, value) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return (isinstance(value, int) or math.isfinite(value)) and above and below

    def __str__(self) -> str:
        def number(x):
            return str(int(x)) if float(x).is_integer() else f"{x:g}"

        if self.high == math.inf:
            text = f"{'greater than' if self.low_open else 'at least'} {number(self.low)}"
        else:
            text = (f"in {'(' if self.low_open else '['}{number(self.low)}, {number(self.high)}"
                    f"{')' if self.high_open else ']'}")
        return text + (f" ({self.why})" if self.why else "")


def setting(default, role: str, meaning: str, *, choices: tuple = (), bounds: Bounds | None = None):
    """A Config field and what it is: its default (the paper's value where the paper has one), its role, what it
    means (--help) and its valid values (choices, or numeric bounds: checked whenever a Config is made). How a file
    written before the field existed reads it is upgrade.py's."""
    return dataclasses.field(default=default, metadata={"role": role, "help": meaning, "choices": choices,
                                                        "bounds": bounds})


def check_settings(cfg) -> None:
    """Every value of a Config (common.Config.__post_init__: the defaults, a preset, the command line, or the settings
    read back from a history or an evaluation) against its declaration, then the settings that exclude each other."""
    for field in dataclasses.fields(cfg):
        problem = setting_problem(field, getattr(cfg, field.name))
        if problem:
            raise stage.ConfigError(problem)
    if cfg.noise == "checkpoint" and cfg.restore == "subtract":
        raise stage.ConfigError("restore=subtract is for the rank-salted noise; use copy_device or copy_host with "
                                "noise=checkpoint")
    if cfg.rounding == "stochastic" and cfg.restore == "subtract":
        raise stage.ConfigError("restore=subtract cannot undo a stochastically rounded perturbation; use "
                                "copy_device or copy_host with rounding=stochastic")
    if cfg.max_new_tokens >= cfg.max_model_len:  # a turn's prompt needs at least one token of the context
        raise stage.ConfigError(f"max_new_tokens={cfg.max_new_tokens} leaves no room for the prompt in "
                                f"max_model_len={cfg.max_model_len}; use --max_new_tokens below --max_model_len")
    if cfg.speculative == "ngram" and cfg.ngram_lookup_min > cfg.ngram_lookup_max:
        raise stage.ConfigError(f"ngram_lookup_min={cfg.ngram_lookup_min} is above ngram_lookup_max="
                                f"{cfg.ngram_lookup_max}; the shortest n-gram looked up must not be longer than the "
                                "longest")
    if cfg.speculative == "ngram" and cfg.min_p > 0:  # vLLM would fail every request (SamplingParams.verify)
        raise stage.ConfigError(f"speculative=ngram: vLLM samples no min_p with speculative decoding, and min_p is "
                                f"{cfg.min_p}; use --min_p=0 or --speculative=off")
    if cfg.learn_digits == 1:
        raise stage.ConfigError("learn_digits=1 leaves too few pairs of one-digit numbers to hold out; use 0 (the "
                                "numbers 2..19) or 2 digits and more")
    if cfg.learn_digits and cfg.train_data != "learn":
        raise stage.ConfigError(f"learn_digits={cfg.learn_digits} is a tier of the learn task; use it with "
                                f"--train_data=learn (train_data is {cfg.train_data!r})")
    if cfg.compute_level != 1 and cfg.train_data != "compute":
        raise stage.ConfigError(f"compute_level={cfg.compute_level} is a level of the compute task; use it with "
                                f"--train_data=compute (train_data is {cfg.train_data!r})")
    if cfg.rounding == "stochastic" and cfg.dtype != "bfloat16":
        # the random bits replace bf16's dropped low half of a float32; other dtypes would round to nearest
        raise stage.ConfigError(f"rounding=stochastic is defined for dtype=bfloat16 only, got "
                                f"dtype={cfg.dtype!r}; use rounding=nearest with this dtype")


def setting_problem(field: dataclasses.Field, value) -> str | None:
    """What is wrong with one Config value (the type of the field's default, its declared bounds or choices), or
    None."""
    name, field_type = field.name, type(field.default)
    bounds, choices = field.metadata["bounds"], field.metadata["choices"]
    if field_type is float:
        expected, ok = "a number", isinstance(value, (int, float)) and not isinstance(value, bool)
    elif field_type is int:
        expected, ok = "an integer", isinstance(value, int) and not isinstance(value, bool)
    else:
        expected, ok = {bool: "true or false", str: "a string"}[field_type], isinstance(value, field_type)
    if not ok:
        return f"{name} must be {expected}, got {value!r}"
    if bounds is not None and not bounds.admits(value):
        finite = "a finite number " if field_type is float else ""
        return f"{name} must be {finite}{bounds}, got {value!r}"
    if field_type is int and not -2**63 <= value < 2**63:
        return f"{name} must fit in 64 bits (numpy, torch and vLLM hold it as an int64), got {value!r}"
    if choices and value not in choices:
        return f"{name} must be one of {', '.join(choices)}, got {value!r}"
    return None


def settings_of(config_class, *roles: str) -> tuple[str, ...]:
    """The names of the settings of these roles (WEIGHTS, RUN, EXECUTION, POOL, RESTORE), in Config's order
    (config_class: common.Config)."""
    return tuple(f.name for f in dataclasses.fields(config_class) if f.metadata["role"] in roles)


# The README's main job: a tiny random Qwen3 the project writes itself, tiny arithmetic problems, CPU-sized budgets.
PRESETS = {
    "smoke": dict(
        model="tiny-qwen3-dense", max_model_len=2048, generations=2, population=4, case_batch=2, max_turns=3,
        max_new_tokens=48, bash_timeout_s=5.0, train_data="smoke", eval_problems=2, run_dir="runs/smoke",
        smoke_eval=True,
    ),
    # Evidence that ES learns: the real SmolLM2-135M-Instruct (models.py) on small additions made locally, where
    # the base model succeeds sometimes; 03_eval.py evaluates the first eval_problems of the held-out additions
    # (never trained on). Its strict agent score is 0, so it trains on the shaped fitness. A gentler sampling than
    # the paper's (this 135M model rambles at temperature 1 with presence penalty 2) and sigma 2x, alpha 8x the
    # paper's: 12 generations, not hundreds (bench/README.md, "Learning").
    "learn": dict(
        model="smollm2-135m", max_model_len=2048, generations=12, population=16, case_batch=32, max_turns=3,
        max_new_tokens=96, bash_timeout_s=5.0, train_data="learn", eval_problems=64, run_dir="runs/learn",
        temperature=0.7, presence_penalty=0.0, sigma_start=2e-3, sigma_end=1e-3, alpha=4e-3, fitness="shaped",
    ),
    # ES on the strict score itself (--fitness=agent, the reference's): Qwen2.5-Coder-1.5B-Instruct (models.py) on a
    # tier of the learn task, sums of two 4-digit numbers. Its base strict score (bench/strict_base.py, one H100,
    # 64 x 8 episodes per tier) is 0.17-0.21 on every tier measured (2..19, 3, 4, 6, 8 digits), 0.180 on this one:
    # clearly above 0 and below the ceiling, which ES lifted to Mean4 0.92-0.98 (bench/README.md, "The strict
    # preset"). The learn preset's sampling and step sizes; turns enough for this model's habit of stating its
    # answer in the reply that calls the tool (the loop then asks for it again).
    "strict": dict(
        model="qwen2.5-coder-1.5b", max_model_len=4096, generations=12, population=16, case_batch=32, max_turns=6,
        max_new_tokens=256, bash_timeout_s=5.0, train_data="learn", learn_digits=4, eval_problems=64,
        run_dir="runs/strict", temperature=0.7, presence_penalty=0.0, sigma_start=2e-3, sigma_end=1e-3, alpha=4e-3,
        fitness="agent",
    ),
    # A task whose prompt gives no command (agentic_es/compute_task.py): competition-style problems that a program
    # solves (modular powers, primes in an interval, lattice paths around blocked points, ...) in DAPO's wording,
    # evaluated on unseen parameters of the training families and on families training never sees. Shows whether
    # ES teaches the strict preset's model to compute, not only to copy the command a learn question hands it. The
    # strict preset's model, sampling and step sizes; room for a program in a reply and for longer conversations.
    "compute": dict(
        model="qwen2.5-coder-1.5b", max_model_len=8192, generations=12, population=16, case_batch=32, max_turns=6,
        max_new_tokens=512, bash_timeout_s=10.0, train_data="compute", compute_level=1, eval_problems=64,
        run_dir="runs/compute", temperature=0.7, presence_penalty=0.0, sigma_start=2e-3, sigma_end=1e-3, alpha=4e-3,
        fitness="agent",
    ),
}
