"""Does the base model ever succeed strictly on the learn task (a bash call, then an accepted final answer)?

Runs the base SmolLM2-135M-Instruct (the learn preset, TP=2 on CPU) on held-out learn questions, one sample each,
with the learn question as it is and with a sentence that shows the final-answer line, and reports the strict
score, the bash-call rate and the shaped reward per variant and turn budget. Prints one JSON line per row and the
whole report (also written to --out).

    python bench/learn_prompt_probe.py --problems=48 --turns=3,6 --out=bench/results/learn_prompt_probe_cpu.json
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[0]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import learning  # noqa: E402
from agentic_es import cli, data, learn_task, models, vllm_platform  # noqa: E402
from agentic_es.engine import Engine  # noqa: E402
from agentic_es.stage import prepare_script  # noqa: E402
from report import emit, print_until_reader_gone  # noqa: E402

VARIANTS = {
    "as_is": learn_task.LEARN_QUESTION,
    "shows_final_line": (learn_task.LEARN_QUESTION
                         + " Then, when it prints the sum, reply: Final answer: \\boxed{{<the sum>}}"),
}


def main(argv):
    opts, overrides = cli.parse_args(argv, {"out": "", "problems": 48, "turns": "3,6"})
    heldout = learning.heldout_problems(opts["problems"], cli.parse_config(["--preset=learn", *overrides]).learn_digits)
    rows = []
    for turns in map(int, str(opts["turns"]).split(",")):
        cfg = cli.parse_config(["--preset=learn", *overrides, f"--max_turns={turns}"])
        with Engine(cfg, models.resolve_model(cfg.model)) as engine:
            for name, template in VARIANTS.items():
                problems = [dict(p, question=template.format(a=int(a), b=int(b))) for p in heldout
                            for a, b in [learn_task.learn_operands(p["question"])]]
                t0 = time.perf_counter()
                records = engine.run_agent([(p, 0) for p in problems], desc=f"{name}, {turns} turns")
                rows.append(emit({"variant": name, "max_turns": turns, "problems": len(records),
                                  "strict": common.fitness(records, "agent"),
                                  "bash_call_rate": sum(1 for r in records if r["bash_calls"]) / len(records),
                                  "shaped": round(common.fitness(records, "shaped"), 4),
                                  "seconds": round(time.perf_counter() - t0, 1)}))
    return emit({"bench": "learn_prompt_probe", "date": time.strftime("%Y-%m-%d"), "model": cfg.model,
                 "device": vllm_platform.device_type(), "rows": rows}, opts["out"])


if __name__ == "__main__":
    print_until_reader_gone()
    prepare_script()
    main(sys.argv[1:])
