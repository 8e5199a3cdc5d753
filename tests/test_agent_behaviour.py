"""bench/agent_behaviour.py (what an agent did in its episodes: never called bash, a call and an answer in one
reply, only the system prompt's example, commands that use the problem's numbers, junk) and
bench/compute_stages_summary.py (base vs trained on every set two evaluation folders share, with behaviour)."""

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import agent_behaviour  # noqa: E402
import compute_stages_summary  # noqa: E402

import common  # noqa: E402

QUESTION = ("Solve the following math problem step by step. The last line of your response should be of the form "
            "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
            "How many integers from 150 to 4321 are divisible by 7 but not by 3?\n\n"
            "Remember to put your answer on its own line after \"Answer:\".")


def call(command: str, text: str = "") -> str:
    return text + json.dumps({"name": "bash", "arguments": {"command": command}})


def episode(*replies: str, score: float = 0.0) -> dict:
    messages = [{"role": "system", "content": common.SYSTEM_PROMPT},
                {"role": "user", "content": common.user_prompt(QUESTION)}]
    for reply in replies:
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "(observation)"}]
    return {"messages": messages, "score": score, "turns": len(replies), "completion_tokens": 10 * len(replies),
            "finish_reason": "max_turns"}


def kinds(record: dict) -> set[str]:
    return {k for k, v in agent_behaviour.behaviour(record).items() if v}


def test_the_problems_numbers_leave_out_the_answer_instructions():
    assert agent_behaviour.problem_numbers(agent_behaviour.problem_text(episode())) == {"150", "4321"}
    assert agent_behaviour.problem_numbers("Find 2^5 mod 7.") == {"2", "5", "7"}  # only one-digit numbers: all


@pytest.mark.parametrize("replies, expected", [
    (["Final answer: \\boxed{397}", "Final answer: \\boxed{397}"], {"never_bash"}),
    ([call("python3 -c 'print(sum(1 for n in range(150, 4322) if n % 7 == 0 and n % 3))'")], {"from_problem"}),
    ([call("python3 -c 'print(397)'", "The count is 397.\n") + "\nFinal answer: \\boxed{397}"],
     {"bash_and_answer", "junk"}),
    ([call("python3 -c 'from fractions import Fraction; print(Fraction(3, 4) + 1)'")], {"example_only"}),
    ([call("<shell command>"), call("python3 -c 'from fractions import Fraction; print(Fraction(3, 4) + 1)'")],
     {"example_only"}),
    ([call("bash"), call("ls -la")], {"junk"}),
    ([call("ls"), call("seq 150 4321 | awk '$1 % 7 == 0' | wc -l", "Let me count.\n")], {"from_problem"}),
    (["I think about it.", call("python3 -c 'print(1504321)'")], {"junk"}),  # digits run together are no number of it
])
def test_each_episode_kind(replies, expected):
    assert kinds(episode(*replies)) == expected


def test_summary_counts_shares_turns_and_tokens(tmp_path):
    records = [episode("Final answer: \\boxed{1}"), episode(call("echo 150 4321"), "Final answer: \\boxed{2}",
                                                             score=1.0)]
    path = tmp_path / "x_episodes.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    s = agent_behaviour.summary(agent_behaviour.read_episodes(path))
    assert s["episodes"] == 2 and s["score"] == 0.5
    assert s["counts"] == {"never_bash": 1, "bash_and_answer": 0, "example_only": 0, "from_problem": 1, "junk": 0}
    assert s["turns_per_episode"] == 1.5 and s["completion_tokens_per_episode"] == 15


def write_eval(folder: Path, name: str, scores: dict, sha: str = "x") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    records = [{"problem_id": pid, "sample_index": i, "seed": i, "score": s} for pid, row in scores.items()
               for i, s in enumerate(row)]
    (folder / f"{name}_eval16.json").write_text(json.dumps({"records": records, "data_sha256": sha,
                                                            "checkpoint": {"kind": "base"}}))
    (folder / f"{name}_episodes.jsonl").write_text("".join(
        json.dumps(episode(call("python3 -c 'print(150 + 4321)'")) if s else episode("Final answer: 3")) + "\n"
        for row in scores.values() for s in row))


def test_the_summary_compares_every_shared_set_with_behaviour(tmp_path):
    base = {"p0": [0] * 16, "p1": [0] * 15 + [1]}
    trained = {"p0": [1] * 16, "p1": [1] * 16}
    for name in ("compute_heldout", "compute_families"):
        write_eval(tmp_path / "base", name, base)
        write_eval(tmp_path / "trained", name, trained)
    write_eval(tmp_path / "trained", "dapo", trained)  # only one side has it: not compared
    report = compute_stages_summary.main([f"--trained={tmp_path / 'trained'}", f"--base={tmp_path / 'base'}"])
    assert sorted(report["sets"]) == ["compute_families", "compute_heldout"]
    s = report["sets"]["compute_heldout"]
    assert s["metrics"]["mean4"]["difference"]["mean"] == pytest.approx(1 - 1 / 8)
    assert s["base_behaviour"]["counts"]["never_bash"] == 31 and s["trained_behaviour"]["shares"]["from_problem"] == 1


def test_the_summary_refuses_sets_of_other_data(tmp_path):
    write_eval(tmp_path / "base", "compute_heldout", {"p0": [0] * 16}, sha="a")
    write_eval(tmp_path / "trained", "compute_heldout", {"p0": [1] * 16}, sha="b")
    with pytest.raises(ValueError, match="different data"):
        compute_stages_summary.main([f"--trained={tmp_path / 'trained'}", f"--base={tmp_path / 'base'}"])
