"""00_data.py, offline: local stand-ins of the two public datasets (their schemas, made from a reference build by
inverting the mapping, with the hub's repeated rows and rows the project does not use) must give back that build
byte for byte; bad sources give clear errors and leave no file. Nothing is fetched.

The reference build is data_manifest.json's: its files (../shared/data, where CI keeps them beside the clone) are
compared byte for byte when they are there, and those tests are skipped otherwise. Every other test builds stand-ins
the tests write: a few made-up problems of each file and a manifest of them, in data_manifest.json's format."""

import hashlib
import importlib
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import common
from agentic_es import cli, fileio, history, learn_task, stage
from agentic_es.data import DATA_MANIFEST, load_problems, problems_from, training_problems
from agentic_es.learn_task import (LEARN_HELDOUT_PAIRS, LEARN_OPERANDS, LEARN_PROBLEMS, LEARN_QUESTION,
                                   LEARN_TRAIN_SEED, learn_problems)
from agentic_es.smoke_task import SMOKE_PROBLEMS, smoke_problems

REPO = common.REPO
SHARED = REPO.parent / "shared" / "data"  # the reference files: never part of the project
data = importlib.import_module("00_data")
evaluation = importlib.import_module("03_eval")
MANIFEST = fileio.read_json(DATA_MANIFEST)["files"]
NAMES = list(MANIFEST)  # build order: dapo_train400, dapo_test100, aime2026
needs_reference_files = pytest.mark.skipif(
    not all((SHARED / name).exists() for name in NAMES),
    reason=f"no reference data files beside this clone ({SHARED}): nothing to compare 00_data.py's output with")


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def standin_files() -> dict[str, str]:
    """A reference build made up here, in the reference files' format (their fields in their order; non-ASCII text
    escaped as json.dumps does): a few problems per file, the DAPO ones with the reference's prompt around them."""
    prompt = ("Solve the following math problem step by step. The last line of your response should be of the form "
              "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{}\n\nRemember to put "
              "your answer on its own line after \"Answer:\".")
    dapo = [{"id": f"dapo_{i:08x}-0000-4000-8000-{i * 7919:012x}", "source": data.DAPO,
             "question": prompt.format(f"Find $x$ such that $x^2 = {i * i}$ and $x > 0$ (\u00e9tape {i})."),
             "answer": str(i), "ability": "MATH", "split_source": "train"} for i in range(1, 10)]
    aime = [{"id": f"aime_2026_{i:03d}", "source": data.AIME,
             "question": f"Let $N$ be the number of pairs $(a, b)$ with $a + b = {i}$. Find $N \\bmod 1000$.",
             "answer": str(i - 1), "split_source": "train"} for i in (3, 1, 12, 7)]
    return {"dapo_train400.jsonl": jsonl(dapo[:6]), "dapo_test100.jsonl": jsonl(dapo[6:]), "aime2026.jsonl": jsonl(aime)}


def manifest_of(files: dict[str, str]) -> dict:
    """data_manifest.json's "files" for a build (00_data.manifest_entry of each file)."""
    return {name: data.manifest_entry(text) for name, text in files.items()}


STANDIN = standin_files()
STANDIN_MANIFEST = manifest_of(STANDIN)


def reference_rows(files: dict[str, str], name: str) -> list[dict]:
    return [json.loads(line) for line in files[name].splitlines()]


def dapo_source_rows(files: dict[str, str] = STANDIN):
    """DAPO-Math-17k's schema: every DAPO problem of a build, twice (the hub repeats each problem), and problems the
    project does not use, shuffled."""
    rows = [{"data_source": "math_dapo", "prompt": [{"content": r["question"], "role": "user"}],
             "ability": r["ability"], "reward_model": {"ground_truth": r["answer"], "style": "rule-lighteval/MATH_v2"},
             "extra_info": {"index": r["id"].removeprefix("dapo_")}}
            for name in ("dapo_train400.jsonl", "dapo_test100.jsonl") for r in reference_rows(files, name)]
    unused = [{"data_source": "math_dapo", "prompt": [{"content": f"What is {i} + {i}?", "role": "user"}],
               "ability": "MATH", "reward_model": {"ground_truth": str(2 * i), "style": "rule-lighteval/MATH_v2"},
               "extra_info": {"index": f"00000000-0000-0000-0000-{i:012d}"}} for i in range(50)]
    rows = rows * 2 + unused
    random.Random(0).shuffle(rows)
    return rows


def aime_source_rows(files: dict[str, str] = STANDIN):
    """MathArena/aime_2026's schema: problem_idx and answer as integers, problem as text."""
    rows = [{"problem_idx": int(r["id"].removeprefix("aime_2026_")), "answer": int(r["answer"]),
             "problem": r["question"]} for r in reference_rows(files, "aime2026.jsonl")]
    random.Random(1).shuffle(rows)
    return rows


def write_sources(root: Path, dapo: list[dict], aime: list[dict]) -> Path:
    for repo, rows in ((data.DAPO, dapo), (data.AIME, aime)):
        folder = root / repo / "data"
        folder.mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(rows), folder / "train-00000-of-00001.parquet")
    return root


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The public datasets as local copies holding the stand-ins."""
    return write_sources(tmp_path_factory.mktemp("sources"), dapo_source_rows(), aime_source_rows())


@pytest.fixture
def standin_manifest(tmp_path, monkeypatch):
    """The stand-ins' manifest in data_manifest.json's place: 00_data.py builds the stand-ins."""
    path = tmp_path / "data_manifest.json"
    fileio.write_json_atomic({"format": "es-data-manifest/1", "files": STANDIN_MANIFEST}, path)
    monkeypatch.setattr("agentic_es.data.DATA_MANIFEST", path)
    return STANDIN_MANIFEST


def build(source_dir, out, cache, *extra):
    return data.main([f"--source_dir={source_dir}", f"--out={out}", f"--cache_dir={cache}", *extra])


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir()) if out.exists() else []


@needs_reference_files
def test_manifest_describes_the_reference_files_without_their_questions():
    files = {name: (SHARED / name).read_bytes().decode() for name in NAMES}
    assert manifest_of(files) == MANIFEST
    text = DATA_MANIFEST.read_text()
    for name in NAMES:
        assert not any(json.dumps(r["question"])[1:-1] in text for r in reference_rows(files, name))  # no question


@pytest.mark.parametrize("reference", ["stand-ins", pytest.param("reference files", marks=needs_reference_files)])
def test_builds_the_reference_files_byte_for_byte_then_leaves_them_alone(reference, tmp_path, request):
    if reference == "stand-ins":
        request.getfixturevalue("standin_manifest")
        files = STANDIN
    else:
        files = {name: (SHARED / name).read_bytes().decode() for name in NAMES}
    source_dir = write_sources(tmp_path / "sources", dapo_source_rows(files), aime_source_rows(files))
    out = tmp_path / "data"
    assert build(source_dir, out, tmp_path / "cache") == {name: "built" for name in NAMES}
    for name in NAMES:
        assert (out / name).read_bytes() == files[name].encode(), name
    assert leftovers(out) == sorted(NAMES)  # no temporary files

    stamps = {name: (out / name).stat().st_mtime_ns for name in NAMES}
    assert build(source_dir, out, tmp_path / "cache") == {name: "up to date" for name in NAMES}
    assert {name: (out / name).stat().st_mtime_ns for name in NAMES} == stamps


@pytest.mark.parametrize("reference", ["stand-ins", pytest.param("reference files", marks=needs_reference_files)])
def test_the_manifest_of_a_build_is_written_from_its_files(reference, tmp_path, request):
    """--write_manifest describes the files in --out, builds nothing: of the reference files it is
    data_manifest.json byte for byte, of the stand-ins their manifest; a missing file is named."""
    if reference == "stand-ins":
        request.getfixturevalue("standin_manifest")
        files, out = STANDIN, tmp_path / "data"
        out.mkdir()
        for name, text in files.items():
            (out / name).write_text(text)
    else:
        out = SHARED
    written = tmp_path / "manifest.json"
    assert data.main([f"--out={out}", f"--write_manifest={written}"]) == {name: "described" for name in NAMES}
    if reference == "stand-ins":
        assert fileio.read_json(written) == {"format": "es-data-manifest/1", "about": data.MANIFEST_ABOUT,
                                             "files": STANDIN_MANIFEST}
        (out / "aime2026.jsonl").unlink()
        with pytest.raises(stage.DataError, match="aime2026.jsonl: file not found"):
            data.main([f"--out={out}", f"--write_manifest={written}"])
    else:
        assert written.read_bytes() == DATA_MANIFEST.read_bytes()


def test_a_different_file_in_the_way_is_kept_unless_forced(sources, standin_manifest, tmp_path):
    out = tmp_path / "data"
    out.mkdir()
    (out / "aime2026.jsonl").write_text('{"id": "mine", "question": "q", "answer": "1"}\n')
    with pytest.raises(stage.DataError, match="aime2026.jsonl exists but differs from data_manifest.json"):
        build(sources, out, tmp_path / "cache")
    assert (out / "aime2026.jsonl").read_text().startswith('{"id": "mine"')
    build(sources, out, tmp_path / "cache", "--force=true")
    assert (out / "aime2026.jsonl").read_text() == STANDIN["aime2026.jsonl"]


def first_train_id():
    return STANDIN_MANIFEST["dapo_train400.jsonl"]["rows"][0][0].removeprefix("dapo_")


def drop_train_row(dapo, aime):
    return [r for r in dapo if r["extra_info"]["index"] != first_train_id()], aime


def change_train_answer(dapo, aime):
    for r in dapo:
        if r["extra_info"]["index"] == first_train_id():
            r["reward_model"]["ground_truth"] = "12345"
    return dapo, aime


def change_train_question(dapo, aime):
    for r in dapo:
        if r["extra_info"]["index"] == first_train_id():
            r["prompt"][0]["content"] += " "
    return dapo, aime


def rename_dapo_column(dapo, aime):
    return [{("reward" if k == "reward_model" else k): v for k, v in r.items()} for r in dapo], aime


def change_aime_answer(dapo, aime):
    aime[0]["answer"] += 1
    return dapo, aime


@pytest.mark.parametrize("damage, failing, message", [
    (drop_train_row, "dapo_train400.jsonl",
     f"lacks 1 of the 6 ids of dapo_train400.jsonl: dapo_{first_train_id()}"),
    (change_train_answer, "dapo_train400.jsonl", "dapo_train400.jsonl: answer mismatch in 1 rows: dapo_"),
    (change_train_question, "dapo_train400.jsonl", "1 rows differ from the reference build"),
    (rename_dapo_column, "dapo_train400.jsonl", "expected column reward_model with ground_truth"),
    (change_aime_answer, "aime2026.jsonl", "aime2026.jsonl: answer mismatch in 1 rows: aime_2026_"),
])
def test_bad_sources_give_clear_errors_and_no_partial_file(standin_manifest, tmp_path, damage, failing, message):
    source_dir = write_sources(tmp_path / "sources", *damage(dapo_source_rows(), aime_source_rows()))
    out = tmp_path / "data"
    with pytest.raises(stage.DataError, match=message.replace("(", r"\(")):
        build(source_dir, out, tmp_path / "cache")
    assert failing not in leftovers(out)
    assert all(name in NAMES for name in leftovers(out))  # the files before it, complete; nothing temporary


def test_an_unreachable_source_names_the_dataset_and_writes_nothing(tmp_path, monkeypatch):
    """The hub in offline mode (nothing is fetched) stands for an unreachable one."""
    import datasets.config
    import huggingface_hub.constants

    for module in (datasets.config, huggingface_hub.constants):
        monkeypatch.setattr(module, "HF_HUB_OFFLINE", True)
    with pytest.raises(stage.DataError, match=f"could not load {data.DAPO} \\(split 'train'\\) from the Hugging Face "
                                         f"hub: ConnectionError: .*--source_dir=DIR"):
        data.main([f"--out={tmp_path / 'data'}", f"--cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(stage.DataError, match=f"no local copy of {data.DAPO} at"):
        build(tmp_path / "empty", tmp_path / "data", tmp_path / "cache")
    assert leftovers(tmp_path / "data") == []


def test_a_missing_default_file_names_the_command_that_builds_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a fresh clone: no data/
    with pytest.raises(stage.DataError, match="^data/dapo_train400.jsonl: problems file not found; build it with: "
                                         "python 00_data.py$"):
        importlib.import_module("01_train").main([])
    with pytest.raises(stage.DataError, match="^data/dapo_test100.jsonl: problems file not found; build it with: "
                                         "python 00_data.py$"):
        evaluation.main(["--export="])
    with pytest.raises(stage.DataError, match="build it with: python 00_data.py --out=elsewhere$"):
        load_problems("elsewhere/aime2026.jsonl")
    with pytest.raises(stage.DataError, match="not found$"):
        load_problems("data/other.jsonl")


def test_default_paths_are_the_built_files_and_the_smoke_and_learn_presets_need_none():
    defaults = [common.Config().train_data, *evaluation.DATASETS.values()]
    assert all(os.path.dirname(p) == data.OUT and os.path.basename(p) in MANIFEST for p in defaults)
    no_paths = {name: "" for name in evaluation.ALL_DATASETS}
    assert evaluation.data_paths(no_paths, common.Config()) == evaluation.DATASETS
    smoke = cli.parse_config(["--preset=smoke"])
    assert smoke.train_data == "smoke"
    assert evaluation.data_paths(no_paths, smoke) == {"dapo": "smoke", "aime2026": "smoke"}
    assert evaluation.data_paths(dict(no_paths, dapo="x.jsonl"), smoke) == {"dapo": "x.jsonl", "aime2026": "smoke"}
    learn = cli.parse_config(["--preset=learn"])  # the learn task: its held-out additions, whatever the preset
    assert evaluation.data_paths(no_paths, learn) == {"learn_heldout": "learn_heldout"}
    assert evaluation.data_paths(no_paths, cli.parse_config(["--train_data=learn"])) == {"learn_heldout":
                                                                                         "learn_heldout"}
    assert evaluation.data_paths(dict(no_paths, learn_heldout="x.jsonl"), learn) == {"learn_heldout": "x.jsonl"}
    with pytest.raises(stage.ConfigError, match=re.escape("--aime2026= names a set this run does not evaluate "
                                                          "(train_data=learn evaluates learn_heldout)")):
        evaluation.data_paths(dict(no_paths, aime2026="x.jsonl"), learn)
    with pytest.raises(stage.ConfigError, match="--learn_heldout= names a set this run does not evaluate"):
        evaluation.data_paths(dict(no_paths, learn_heldout="x.jsonl"), smoke)
    # --sets: only the sets named, each still at its own path or the one given; a set the run lacks refused
    assert evaluation.data_paths(dict(no_paths, sets="dapo"), common.Config()) == {"dapo": evaluation.DATASETS["dapo"]}
    assert evaluation.data_paths(dict(no_paths, sets=" aime2026 ,dapo", dapo="x.jsonl"), smoke) == {
        "dapo": "x.jsonl", "aime2026": "smoke"}
    assert evaluation.data_paths(dict(no_paths, sets=","), smoke) == {"dapo": "smoke", "aime2026": "smoke"}
    with pytest.raises(stage.ConfigError, match=re.escape("--sets=dapo names a set this run does not evaluate "
                                                          "(train_data=learn evaluates learn_heldout)")):
        evaluation.data_paths(dict(no_paths, sets="learn_heldout,dapo"), learn)
    with pytest.raises(stage.ConfigError, match="--sets=aime names a set this run does not evaluate"):
        evaluation.data_paths(dict(no_paths, sets="aime"), common.Config())
    assert problems_from("smoke", smoke.run_seed) == smoke_problems(SMOKE_PROBLEMS,
                                                                                  seed=smoke.run_seed)


def test_learn_problems_are_right_sums_and_held_out_sets_share_no_operands_with_training():
    train = learn_problems(LEARN_PROBLEMS, seed=LEARN_TRAIN_SEED)
    held_out = learn_problems(128, seed=1, split="heldout")

    def operands(p):
        return tuple(int(x) for x in p["question"].split("?")[0].removeprefix("What is ").split(" + "))

    trained_pairs = {frozenset(operands(p)) for p in train}
    assert len({p["question"] for p in train}) == LEARN_PROBLEMS == 192
    assert not trained_pairs & {frozenset(operands(p)) for p in held_out}  # not even as b + a
    low, high = LEARN_OPERANDS
    for p in train + held_out:
        a, b = operands(p)
        assert low <= a <= high and low <= b <= high and p["answer"] == str(a + b)
    assert len({p["id"] for p in train + held_out}) == len(train) + len(held_out)
    assert problems_from("learn", 0) == train  # the preset's one training set, whatever the run seed
    every = learn_problems(2 * LEARN_HELDOUT_PAIRS, seed=1, split="heldout")
    assert {operands(p) for p in every} == {(b, a) for a, b in map(operands, every)}  # both orders held out
    evaluated = problems_from("learn_heldout", 5)  # 03_eval's set: every held-out question, one order
    assert evaluated == problems_from("learn_heldout", 6) and evaluated[:128] == held_out
    assert {p["question"] for p in evaluated} == {p["question"] for p in every}
    with pytest.raises(stage.ConfigError, match="never trained on"):
        training_problems(cli.parse_config(["--preset=learn", "--train_data=learn_heldout"]))
    with pytest.raises(stage.DataError, match="only 132 questions"):  # asking for more than exist
        learn_problems(133, seed=1, split="heldout")
    # a history trained on another version of the generated problems (this one's were split differently) is refused
    learn = cli.parse_config(["--preset=learn"])
    now = history.train_data_sha256(learn)
    assert now.startswith("learn ") and now == history.train_data_sha256(learn)
    assert history.identity_differences({"train_data_sha256": "learn"}, {"train_data_sha256": now})


# sha256 of json.dumps(problems, sort_keys=True) of the learn task's two sets, as they were before its tiers: the
# learn preset's problems, their ids (the request seeds) and so its runs' digests stay what they were
LEARN_SETS_SHA256 = {"learn": "d87b53241450916bd8f7c4f3db5df3b353b356980d62be3d8b0c63e8e1f9e335",
                     "learn_heldout": "788007b61717f87772583ab3229f4c7c0d55499ecc60e32221c394c020d40d81"}


def test_the_learn_task_without_a_tier_is_the_learn_preset_s_as_before():
    for name, digest in LEARN_SETS_SHA256.items():
        for problems in (problems_from(name, 0), problems_from(name, 7, learn_digits=0)):
            assert hashlib.sha256(json.dumps(problems, sort_keys=True).encode()).hexdigest() == digest
    assert cli.parse_config(["--preset=learn"]).learn_digits == 0


@pytest.mark.parametrize("digits", [2, 3, 6])
def test_a_tier_of_the_learn_task_adds_numbers_of_that_many_digits_and_holds_out_pairs_never_trained(digits):
    train = problems_from("learn", 0, learn_digits=digits)
    held_out = problems_from("learn_heldout", 0, learn_digits=digits)

    def operands(p):
        return tuple(int(x) for x in learn_task.learn_operands(p["question"]))

    assert len(train) == LEARN_PROBLEMS and len(held_out) == 2 * LEARN_HELDOUT_PAIRS
    for p in train + held_out:
        a, b = operands(p)
        assert len(str(a)) == len(str(b)) == digits and p["answer"] == str(a + b)
        assert p["question"] == LEARN_QUESTION.format(a=a, b=b)  # the learn task's question, harder sums
    assert not {frozenset(operands(p)) for p in train} & {frozenset(operands(p)) for p in held_out}
    assert {operands(p) for p in held_out} == {(b, a) for a, b in map(operands, held_out)}  # both orders held out
    ids = {p["id"] for p in train + held_out}
    assert len(ids) == len(train) + len(held_out) and all(i.startswith(f"learn-d{digits}-") for i in ids)
    assert problems_from("learn", 5, learn_digits=digits) == train  # one fixed set per tier, whatever the run seed
    assert held_out == problems_from("learn_heldout", 9, learn_digits=digits)
    cfg = cli.parse_config(["--preset=learn", f"--learn_digits={digits}"])
    assert training_problems(cfg) == train and evaluation.eval_problems("learn_heldout", cfg) == held_out[:64]
    # a history of another tier is refused: the problems' fingerprint differs
    assert history.train_data_sha256(cfg) != history.train_data_sha256(cli.parse_config(["--preset=learn"]))


def test_a_tier_without_the_learn_task_or_of_one_digit_is_refused():
    with pytest.raises(stage.ConfigError, match=r"^learn_digits=1 leaves too few pairs"):
        cli.parse_config(["--preset=learn", "--learn_digits=1"])
    with pytest.raises(stage.ConfigError, match=r"^learn_digits=3 is a tier of the learn task; use it with "
                                                r"--train_data=learn \(train_data is 'smoke'\)"):
        cli.parse_config(["--preset=smoke", "--learn_digits=3"])
    with pytest.raises(stage.ConfigError, match=r"^learn_digits must be in \[0, 30\]"):
        cli.parse_config(["--preset=learn", "--learn_digits=31"])


def test_an_evaluation_of_an_export_resumes_however_its_folder_is_named(tmp_path):
    """An export is its manifest and digests: the same export named relative to the repository, then absolute, is
    one checkpoint; another manifest or other digests at the same path are another."""
    export = {"kind": "export", "path": "runs/x/export", "replayed_generations": 2, "manifest_sha256": "m" * 64,
              "per_rank_digests": ["a", "b"]}
    data, sha = {"dapo": "d.jsonl"}, {"dapo": "1" * 64}
    cfg = cli.parse_config(["--preset=smoke"])
    evaluation.claim_output_folder(tmp_path, export, cfg, data, sha)
    evaluation.claim_output_folder(tmp_path, dict(export, path=str(common.REPO / "runs/x/export")), cfg, data, sha)
    for other in ({"manifest_sha256": "n" * 64}, {"per_rank_digests": ["a", "c"]}, {"replayed_generations": 1}):
        with pytest.raises(stage.ConfigError, match="holds an evaluation of another checkpoint or config"):
            evaluation.claim_output_folder(tmp_path, dict(export, **other), cfg, data, sha)


def test_the_refusals_of_another_evaluation_name_each_differing_field_and_both_values(tmp_path):
    """03_eval's refusal of a folder holding another evaluation, and 04_replay's of eval16 files of different
    checkpoints or settings, name every field that differs with both its values."""
    checkpoint, data, sha = {"kind": "base", "per_rank_digests": ["a", "b"]}, {"dapo": "d.jsonl"}, {"dapo": "1" * 64}
    cfg = cli.parse_config(["--preset=smoke"])
    evaluation.claim_output_folder(tmp_path, checkpoint, cfg, data, sha)
    other = cli.parse_config(["--preset=smoke", "--temperature=0.5"])
    with pytest.raises(stage.ConfigError) as refused:
        evaluation.claim_output_folder(tmp_path, dict(checkpoint, per_rank_digests=["a", "c"]), other, data, sha)
    assert (f"config.temperature: {cfg.temperature!r} in eval_run.json, 0.5 in this evaluation" in str(refused.value)
            and "checkpoint.per_rank_digests: ['a', 'b'] in eval_run.json, ['a', 'c'] in this evaluation"
            in str(refused.value) and "choose another --out" in str(refused.value))
    replay = importlib.import_module("04_replay")
    first = {"config": {"temperature": 0.6, "max_turns": 3}, "checkpoint": {"kind": "base", "per_rank_digests": ["a"]}}
    second = {"config": {"temperature": 0.6, "max_turns": 4}, "checkpoint": {"kind": "base", "per_rank_digests": ["b"]}}
    with pytest.raises(stage.ConfigError) as refused:
        replay.replay_config({}, {"dapo": first, "aime2026": second}, [])
    assert str(refused.value) == ("the eval16 files come from different checkpoints or settings "
                                  "(checkpoint.per_rank_digests: ['a'] in dapo, ['b'] in aime2026; config.max_turns: 3 "
                                  "in dapo, 4 in aime2026); they cannot be replayed together")


def test_an_evaluation_folder_resumes_only_for_its_checkpoint_data_and_settings(tmp_path):
    """03_eval reuses the finished episodes of its --out folder: another checkpoint, data file (by path or by
    sha256) or sampling setting is refused (the marker kept as it was); a setting of speed or placement, or how a
    perturbation is undone (an evaluation never perturbs), may change, also against a marker written when such
    settings were still part of it; a marker written before markers held the data's sha256s is compared by path."""
    checkpoint, data = {"kind": "base", "per_rank_digests": ["a", "b"]}, {"dapo": "d.jsonl", "aime2026": "a.jsonl"}
    sha = {"dapo": "1" * 64, "aime2026": "2" * 64}
    cfg = cli.parse_config(["--preset=smoke"])
    evaluation.claim_output_folder(tmp_path, checkpoint, cfg, data, sha)
    marker = (tmp_path / "eval_run.json").read_bytes()
    for other in ({"checkpoint": dict(checkpoint, per_rank_digests=["a", "c"])}, {"data": dict(data, dapo="e.jsonl")},
                  {"sha": dict(sha, dapo="3" * 64)},
                  {"cfg": cli.parse_config(["--preset=smoke", "--temperature=0.5"])}):
        args = {"checkpoint": checkpoint, "cfg": cfg, "data": data, "sha": sha, **other}
        with pytest.raises(stage.ConfigError, match="holds an evaluation of another checkpoint or config"):
            evaluation.claim_output_folder(tmp_path, args["checkpoint"], args["cfg"], args["data"], args["sha"])
        assert (tmp_path / "eval_run.json").read_bytes() == marker
    faster = ["--concurrency=7", "--cudagraph_mode=FULL", "--max_num_batched_tokens=0"]
    evaluation.claim_output_folder(tmp_path, checkpoint, cli.parse_config(["--preset=smoke", *faster]), data, sha)
    for restore in (["--restore=patch", "--patch_capacity=0.3"], ["--restore=subtract"]):
        evaluation.claim_output_folder(tmp_path, checkpoint, cli.parse_config(["--preset=smoke", *restore]), data,
                                       sha)
    older = json.loads(marker)  # written by a version that kept the engine settings in the marker
    older["config"].update(cudagraph_mode="FULL_DECODE_ONLY", max_num_batched_tokens=0, concurrency=3)
    (tmp_path / "eval_run.json").write_text(json.dumps(older))
    evaluation.claim_output_folder(tmp_path, checkpoint, cfg, data, sha)
    del older["config"]["fitness"]  # written before the setting: its default, the agent's score
    (tmp_path / "eval_run.json").write_text(json.dumps(older))
    evaluation.claim_output_folder(tmp_path, checkpoint, cfg, data, sha)
    (tmp_path / "eval_run.json").write_text(json.dumps(older))
    with pytest.raises(stage.ConfigError, match="holds an evaluation of another checkpoint or config"):
        evaluation.claim_output_folder(tmp_path, checkpoint, cli.parse_config(["--preset=smoke", "--fitness=shaped"]),
                                       data, sha)
    del older["data_sha256"]  # written before the data's sha256s: the paths compared, the sha256s recorded now
    (tmp_path / "eval_run.json").write_text(json.dumps(older))
    evaluation.claim_output_folder(tmp_path, checkpoint, cfg, data, sha)
    assert json.loads((tmp_path / "eval_run.json").read_text())["data_sha256"] == sha
    (tmp_path / "eval_run.json").write_text(json.dumps(older))
    with pytest.raises(stage.ConfigError, match="holds an evaluation of another checkpoint or config"):
        evaluation.claim_output_folder(tmp_path, checkpoint, cfg, dict(data, dapo="e.jsonl"), sha)


def test_an_evaluation_marker_older_than_a_setting_reads_as_the_code_before_it(tmp_path, edit_default):
    """A marker written before --fitness and --prompt_mode holds episodes scored by the agent's score, their turns
    continuing the generated ids: the folder resumes under those, also after the fitness default is edited, and is
    refused under the edited default or today's prompt mode."""
    checkpoint, data, sha = {"kind": "base", "per_rank_digests": ["a"]}, {"dapo": "d.jsonl"}, {"dapo": "1" * 64}
    then = cli.parse_config(["--preset=smoke", "--prompt_mode=continue", "--fitness=agent"])
    evaluation.claim_output_folder(tmp_path, checkpoint, then, data, sha)
    older = json.loads((tmp_path / "eval_run.json").read_text())
    for name in ("fitness", "prompt_mode"):
        del older["config"][name]
    older["config"]["cudagraph_mode"] = "FULL_DECODE_ONLY"  # a marker of 3c340be..6bbc789 held it: ids continued
    edit_default("fitness", "shaped")
    for cfg, reused in ((then, True), (cli.parse_config(["--preset=smoke", "--prompt_mode=continue"]), False),
                        (cli.parse_config(["--preset=smoke", "--fitness=agent"]), False)):
        (tmp_path / "eval_run.json").write_text(json.dumps(older))
        if reused:
            evaluation.claim_output_folder(tmp_path, checkpoint, cfg, data, sha)
        else:
            with pytest.raises(stage.ConfigError, match="holds an evaluation of another checkpoint or config"):
                evaluation.claim_output_folder(tmp_path, checkpoint, cfg, data, sha)


@pytest.mark.parametrize("argv", [["--help"], ["--no_such_option=1"]])
def test_00_data_starts_without_torch_or_vllm(argv):
    """00_data.py runs no engine: its process, from the interpreter's start through its __main__ block (here its
    help, and a refusal once main has parsed the command line), imports neither torch nor vLLM (nor common, which
    imports torch). A subprocess: what is tested is what one process imports."""
    code = ("import runpy, sys\n"
            f"sys.argv = ['00_data.py', *{argv!r}]\n"
            "try:\n    runpy.run_path('00_data.py', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print(sorted({'torch', 'vllm', 'common'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout[-2000:] + result.stderr[-2000:]
