"""Base vs trained on every evaluation set two 03_eval.py folders share (the compute task: its unseen-parameter and
unseen-family held-out sets; any other: DAPO, AIME): per set the strict Mean4, Pass4 and mean@16 with paired 95%
intervals of the difference (bench/strict_stages_summary.compare), and what the agent did before and after
(bench/agent_behaviour.summary: episodes that never call bash, that put a call and an answer in one reply, that
run only the system prompt's example, whose commands use the problem's numbers; turns and tokens per episode);
beside them the replay's agreement and the history's fitness curve. Reads the folders as 03_eval.py writes them
(<set>_eval16.json and <set>_episodes.jsonl, either may be gzip-compressed), no engine:

    python bench/compute_stages_summary.py --trained=runs/compute/eval --base=runs/compute/eval-base \
        --replay=runs/compute/eval/aligned_history_replay_eval4.json --history=runs/compute/es_history.json \
        --out=bench/results/compute_stages_seed1_summary.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[0]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import agent_behaviour  # noqa: E402
from agentic_es import cli, fileio  # noqa: E402
from report import emit, print_until_reader_gone  # noqa: E402
from strict_stages_summary import BOOTSTRAP, compare, read_json, replay_agreement, score_table  # noqa: E402

OPTIONS = {"trained": "", "base": "", "replay": "", "history": "", "out": "", "seed": 0}


def found(folder: Path, name: str) -> Path | None:
    """folder/name, or its gzip-compressed copy folder/name.gz."""
    return next((p for p in (folder / name, folder / f"{name}.gz") if p.exists()), None)


def sets_of(folder: Path) -> list[str]:
    return sorted(p.name.split("_eval16.json")[0] for p in folder.glob("*_eval16.json*"))


def compare_set(trained_dir: Path, base_dir: Path, name: str, seed: int) -> dict:
    trained = read_json(str(found(trained_dir, f"{name}_eval16.json")))
    base = read_json(str(found(base_dir, f"{name}_eval16.json")))
    if base.get("data_sha256") != trained.get("data_sha256"):
        raise ValueError(f"{name}: the two evaluations read different data")
    problem_ids = sorted({r["problem_id"] for r in base["records"]}, key=str)
    if problem_ids != sorted({r["problem_id"] for r in trained["records"]}, key=str):
        raise ValueError(f"{name}: the two evaluations hold different problems")
    out = {"problems": len(problem_ids),
           "metrics": compare(score_table(base["records"], problem_ids),
                              score_table(trained["records"], problem_ids), seed)}
    for who, folder in (("base", base_dir), ("trained", trained_dir)):
        episodes = found(folder, f"{name}_episodes.jsonl")
        if episodes:
            out[f"{who}_behaviour"] = agent_behaviour.summary(agent_behaviour.read_episodes(episodes))
    return out


def main(argv: list[str]) -> dict:
    opts, rest = cli.parse_args(argv, OPTIONS)
    if rest or not opts["trained"] or not opts["base"]:
        raise SystemExit(f"usage: --trained=EVAL_DIR --base=EVAL_DIR [--replay=REPORT] [--history=FILE] "
                         f"[--out=FILE]; got {rest}")
    trained_dir, base_dir = Path(opts["trained"]), Path(opts["base"])
    names = [n for n in sets_of(trained_dir) if n in sets_of(base_dir)]
    if not names:
        raise SystemExit(f"{trained_dir} and {base_dir} share no evaluation set")
    report = {"bench": "compute_stages_summary", "trained": str(trained_dir), "base": str(base_dir),
              "ci": f"95% percentile bootstrap over problems, {BOOTSTRAP} resamples, paired",
              "sets": {name: compare_set(trained_dir, base_dir, name, opts["seed"]) for name in names}}
    if opts["replay"]:
        report["replay"] = replay_agreement(opts["replay"])
    if opts["history"]:
        history = fileio.read_json(opts["history"])
        report["run"] = {k: history["config"].get(k) for k in ("run_seed", "model", "train_data", "compute_level",
                                                              "generations", "population", "case_batch")}
        report["run"]["mean_fitness"] = [sum(g["rewards"]) / len(g["rewards"]) for g in history["generations"]]
    for name, s in report["sets"].items():
        for metric, m in s["metrics"].items():
            print(f"{name:18s} {metric:10s} base {m['base']['mean']:.3f}  trained {m['trained']['mean']:.3f}  "
                  f"difference {m['difference']['mean']:+.3f} [{m['difference']['ci_low']:+.3f}, "
                  f"{m['difference']['ci_high']:+.3f}]: {m['verdict']}")
        for who in ("base", "trained"):
            if f"{who}_behaviour" in s:
                b = s[f"{who}_behaviour"]
                print(f"{name:18s} {who:8s} " + ", ".join(f"{k} {v:.2f}" for k, v in b["shares"].items()) +
                      f"; {b['turns_per_episode']:.2f} turns, {b['completion_tokens_per_episode']:.0f} tokens")
    return emit(report, opts["out"])


if __name__ == "__main__":
    print_until_reader_gone()
    main(sys.argv[1:])
