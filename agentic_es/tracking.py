"""Watching a run: the progress bars of the stages (redrawn in place on a terminal, plain lines in a log file), the
seconds of each step, the reward curve beside the history, and the optional TensorBoard scalars of each generation.
The history stays the record of a run; nothing here is read back by a stage, except the scalars a resumed run has yet
to log."""

from __future__ import annotations

import contextlib
import io
import re
import sys
import time
from pathlib import Path

import numpy as np

from agentic_es.fileio import ClosedOnExit, write_file_atomic
from agentic_es import generation_time, stage, upgrade


# ---- Progress: the bars of episodes, members and generations

PROGRESS_LOG_INTERVAL_S = 10.0  # without a terminal (a log file): one progress line at most this often


_TERMINAL_CONTROL = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|[@-Z\\-_])?")  # ANSI escape sequences (cursor moves)


class _LineStream:
    """tqdm's stream when the console is not a terminal: plain lines only. Each redraw becomes a line of its own
    (not one more carriage return within a single endless line); the blank writes that clear a bar are dropped, and
    so are the cursor moves (ESC[A) by which nested bars redraw their own line of a terminal."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        for line in _TERMINAL_CONTROL.sub("", text).replace("\r", "\n").split("\n"):
            if line.strip():
                self.stream.write(line.rstrip() + "\n")

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


# ---- Timings: the seconds each step of a generation takes (perturb, rollout, restore, update, digest), recorded
# in its history record and tracked as seconds/<step>

@contextlib.contextmanager
def stopwatch(timings: dict, key: str):
    """Adds the wall time of the block to timings[key]."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - t0


# ---- The reward curve: mean and max member fitness per generation, beside the history

def reward_curve_axes(history: dict):
    """A figure of a run's rewards per generation, mean and max member fitness: (figure, axes), for a caller to add
    to (bench/learning.py adds the held-out reward) before save_figure."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    gens = history["generations"]
    x = [g["generation"] for g in gens]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    ax.plot(x, [sum(g["rewards"]) / len(g["rewards"]) for g in gens], "o-", label="mean member fitness")
    ax.plot(x, [max(g["rewards"]) for g in gens], "^--", alpha=0.7, label="max member fitness")
    settings = history["config"]
    ax.set(xlabel="generation", ylabel="reward",
           title=f"{history['base_model']}: N={settings['population']}, alpha={settings['alpha']:g}, "
                 f"sigma={settings['sigma_start']:g}->{settings['sigma_end']:g}, seed {settings['run_seed']}")
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig, ax


def save_figure(fig, path: str | Path) -> Path:
    """The figure as a PNG, atomically (a reader never sees half a picture), and closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    write_file_atomic(png.getvalue(), path)
    return Path(path)


def plot_reward_curve(history: dict, path: str | Path) -> Path:
    return save_figure(reward_curve_axes(history)[0], path)


# ---- Experiment tracking (optional): the per-generation summary as TensorBoard scalars

TENSORBOARD_DIR = "tensorboard"  # in the run dir: `tensorboard --logdir runs/es/tensorboard`


def generation_scalars(record: dict) -> dict[str, float]:
    """What a history record says about its generation, as named scalars: rewards, sigma, alpha, the replies cut
    at the token limit and the episodes the scorer failed on (where the record counts them), seconds, and where the
    time went (generation_time.scalars, where the record keeps it)."""
    rewards = np.asarray(record["rewards"], dtype=np.float64)
    scalars = {"reward/mean": rewards.mean(), "reward/max": rewards.max(), "reward/min": rewards.min(),
               "reward/std": rewards.std(), "sigma": record["sigma"], "alpha": record["alpha"]}
    record = upgrade.upgraded(record, upgrade.GENERATION_KEYS_ADDED)
    if record["replies"] is not None:
        scalars["replies/cut"] = record["replies"]["cut"]
    scalars.update({f"scorer_failures/{method}": n for method, n in record["scorer_failures"].items()})
    scalars.update({f"seconds/{k}": v for k, v in record["timings"].items()})
    if record["time_breakdown"] is not None:
        scalars.update(generation_time.scalars(record["time_breakdown"]))
    return {k: float(v) for k, v in scalars.items()}


def logged_scalars(folder: str | Path) -> set[tuple[str, int]]:
    """(tag, step) of every scalar in the TensorBoard event files of a folder."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={SCALARS: 0})  # 0: every value, none sampled away
    events.Reload()
    return {(tag, e.step) for tag in events.Tags()[SCALARS] for e in events.Scalars(tag)}


class Tracker(ClosedOnExit):
    """Scalars per step (the generation) for TensorBoard when cfg.tracking says so; nothing otherwise. A resumed
    run appends to the same folder (a new event file, opened at the first scalar). The history stays the record of
    the run: this is for watching it."""

    def __init__(self, cfg, run_dir: str | Path):
        self.folder, self.writer = None, None
        if cfg.tracking == "tensorboard":
            try:
                import tensorboard  # noqa: F401  (torch's SummaryWriter needs it)
            except ImportError as exc:
                raise stage.ConfigError("--tracking=tensorboard needs the tensorboard package (pip install "
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
