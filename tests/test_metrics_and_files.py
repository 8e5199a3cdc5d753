import dataclasses
import hashlib
import importlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import common
from agentic_es import cli, export, fileio, history, metrics, models, stage, tracking
from agentic_es.data import DATA_MANIFEST, load_problems
from agentic_es.smoke_task import smoke_problems
from conftest import as_user

DATA_DIR = common.REPO.parent / "shared" / "data"  # the reference files, where CI keeps them beside the clone
MANIFEST = json.loads(DATA_MANIFEST.read_text())["files"]

# -----------------------------------------------------------------------------
# data


def write_lines(tmp_path, lines, name="p.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def problem_line(pid="a", question="What is 1 + 1?", answer="2", **extra):
    return json.dumps({"id": pid, "question": question, "answer": answer, **extra})


def test_load_problems_keeps_order_and_extra_fields(tmp_path):
    path = write_lines(tmp_path, [problem_line("a", source="s1"), "", problem_line("b")])
    problems = load_problems(path)
    assert [p["id"] for p in problems] == ["a", "b"]
    assert problems[0]["source"] == "s1"


@pytest.mark.parametrize("lines, expected", [
    ([problem_line("a"), "{not json"], ":2: malformed JSON"),
    ([problem_line("a"), problem_line("b"), "[1, 2]"], ":3: expected a JSON object"),
    ([json.dumps({"id": "a", "question": "q"})], ":1: missing required field 'answer'"),
    ([problem_line("a"), problem_line("b", question="  ")], ":2: field 'question' is empty"),
    ([problem_line("a", answer="")], ":1: field 'answer' is empty"),
    ([problem_line(7)], ":1: field 'id' must be a string"),
    ([problem_line("a"), problem_line("b"), problem_line("a")], ":3: duplicate id 'a' (first seen on line 1)"),
])
def test_load_problems_errors_name_file_and_line(tmp_path, lines, expected):
    path = write_lines(tmp_path, lines)
    with pytest.raises(stage.DataError) as e:
        load_problems(path)
    assert path + expected in str(e.value)


def test_load_problems_missing_and_empty_file(tmp_path):
    with pytest.raises(stage.DataError, match="not found"):
        load_problems(str(tmp_path / "nope.jsonl"))
    empty = write_lines(tmp_path, [])
    with pytest.raises(stage.DataError, match="no problems"):
        load_problems(empty)
    assert issubclass(stage.DataError, ValueError)


@pytest.mark.parametrize("name, rows", [
    ("dapo_train400.jsonl", 400), ("dapo_test100.jsonl", 100), ("aime2026.jsonl", 30)])
def test_real_data_files_load(name, rows):
    assert len(MANIFEST[name]["rows"]) == rows
    if not (DATA_DIR / name).exists():
        pytest.skip(f"no reference data file {DATA_DIR / name} beside this clone: its {rows} rows are not loaded")
    problems = load_problems(DATA_DIR / name)
    assert [[p["id"], p["answer"]] for p in problems] == [row[:2] for row in MANIFEST[name]["rows"]]


def test_train_and_test_ids_disjoint():
    train, test = ({row[0] for row in MANIFEST[name]["rows"]} for name in ("dapo_train400.jsonl", "dapo_test100.jsonl"))
    assert len(train) == 400 and len(test) == 100 and not train & test


def ids(batch):
    return [p["id"] for p in batch]


def test_case_batch_deterministic_disjoint_and_covering():
    problems = smoke_problems(400, seed=1)
    epoch0 = [ids(common.case_batch(problems, 7, g, 16)) for g in range(25)]
    assert epoch0 == [ids(common.case_batch(problems, 7, g, 16)) for g in range(25)]  # same run seed, same batches
    flat = [pid for batch in epoch0 for pid in batch]
    assert len(flat) == len(set(flat)) == 400                                     # disjoint and covering
    assert flat != [p["id"] for p in problems]                                    # actually shuffled
    epoch1 = [pid for g in range(25, 50) for pid in ids(common.case_batch(problems, 7, g, 16))]
    assert sorted(epoch1) == sorted(flat) and epoch1 != flat                      # new permutation per epoch
    assert ids(common.case_batch(problems, 8, 0, 16)) != epoch0[0]                     # run seed matters


def test_case_batch_straddles_epoch_boundary():
    problems = smoke_problems(10, seed=0)
    order0 = [problems[i]["id"] for i in common.epoch_permutation(10, 3, 0)]
    order1 = [problems[i]["id"] for i in common.epoch_permutation(10, 3, 1)]
    assert ids(common.case_batch(problems, 3, 2, 4)) == order0[8:10] + order1[0:2]  # items 8..11


@pytest.mark.parametrize("batch_size, generation", [(0, 0), (11, 0), (4, -1)])
def test_case_batch_rejects_bad_arguments(batch_size, generation):
    with pytest.raises(ValueError):
        common.case_batch(smoke_problems(10, seed=0), 0, generation, batch_size)


def test_smoke_problems_deterministic_and_correct(tmp_path):
    rows = smoke_problems(20, seed=5)
    assert rows == smoke_problems(20, seed=5)
    assert [r["id"] for r in rows[:2]] == ["smoke-000", "smoke-001"]
    for r in rows:
        expr = r["question"].removeprefix("What is ").removesuffix("?")
        a, op, b = expr.split()
        assert r["answer"] == str(int(a) + int(b) if op == "+" else int(a) * int(b))
    path = str(tmp_path / "smoke.jsonl")
    fileio.write_jsonl(rows, path)
    assert load_problems(path) == rows

# -----------------------------------------------------------------------------
# scoring metrics

# Three problems, 16 samples each; 1 marks a correct sample.
#   a: all 16 correct                        (c = 16)
#   b: only sample 13 correct                (c = 1)
#   c: samples 0, 1, 8, 14, 15 correct       (c = 5)
CORRECT = {"a": set(range(16)), "b": {13}, "c": {0, 1, 8, 14, 15}}


def make_records(correct=CORRECT):
    return [{"problem_id": pid, "sample_index": i, "score": int(i in hits), "seed": 1000 + i,
             "score_method": "integer_match"} for pid, hits in correct.items() for i in range(16)]


def test_group_metrics_hand_computed():
    groups = metrics.group_metrics(list(reversed(make_records())))  # record order must not matter
    assert [g["group"] for g in groups] == ["0-3", "4-7", "8-11", "12-15"]
    assert groups[3]["sample_indices"] == [12, 13, 14, 15]
    # correct samples per problem in each group (a, b, c) and problems solved at least once:
    #   0-3:   4, 0, 2 -> Mean4 6/12 = 0.5     Pass4 2/3
    #   4-7:   4, 0, 0 -> Mean4 4/12 = 1/3     Pass4 1/3
    #   8-11:  4, 0, 1 -> Mean4 5/12           Pass4 2/3
    #   12-15: 4, 1, 2 -> Mean4 7/12           Pass4 3/3 = 1
    expected = [(0.5, 0.6666666666666666), (0.3333333333333333, 0.3333333333333333),
                (0.4166666666666667, 0.6666666666666666), (0.5833333333333334, 1.0)]
    for g, (mean4, pass4) in zip(groups, expected):
        assert g["mean4"] == pytest.approx(mean4, abs=1e-15)
        assert g["pass4"] == pytest.approx(pass4, abs=1e-15)


def test_dataset_metrics_hand_computed():
    m = metrics.dataset_metrics(make_records())
    assert m["reported"]["group"] == "12-15"
    assert m["reported"]["mean4"] == pytest.approx(0.5833333333333334, abs=1e-15)   # 7/12
    assert m["reported"]["pass4"] == 1.0
    # mean@16 = (16 + 1 + 5) / 48 = 11/24
    assert m["mean_at_16"] == pytest.approx(0.4583333333333333, abs=1e-15)
    # pass@4 unbiased, C(16,4) = 1820:  a: 1;  b: 1 - C(15,4)/1820 = 1 - 1365/1820 = 1/4;
    # c: 1 - C(11,4)/1820 = 1 - 330/1820 = 149/182.  Mean = (1 + 1/4 + 149/182) / 3 = 251/364
    assert m["pass_at_4_unbiased"] == pytest.approx(0.6895604395604396, abs=1e-15)
    assert m["n_problems"] == 3 and m["n_records"] == 48
    assert m["scorer_failures"] == {"score_error": 0, "score_timeout": 0}
    json.dumps(m)  # plain JSON-able values


def test_dataset_metrics_count_the_episodes_the_scorer_failed_on():
    records = mutate(mutate(mutate(make_records(), "a", 3, score=0, score_method="score_error"), "b", 3, score=0,
                            score_method="score_timeout"), "c", 3, score=0, score_method="score_error")
    assert metrics.dataset_metrics(records)["scorer_failures"] == {"score_error": 2, "score_timeout": 1}


def test_pass_at_k_unbiased_matches_brute_force():
    for c in range(17):
        samples = [1] * c + [0] * (16 - c)
        subsets = list(itertools.combinations(samples, 4))
        brute = sum(any(s) for s in subsets) / len(subsets)
        assert metrics.pass_at_k_unbiased(16, c, 4) == pytest.approx(brute, abs=1e-12)
    assert metrics.pass_at_k_unbiased(16, 0, 4) == 0.0
    assert metrics.pass_at_k_unbiased(16, 13, 4) == 1.0         # n - c < k
    assert metrics.pass_at_k_unbiased(16, 3, 1) == pytest.approx(3 / 16)
    assert 0.0 < metrics.pass_at_k_unbiased(10_000, 1, 5000) <= 1.0  # large n: no overflow


@pytest.mark.parametrize("n, c, k", [(16, 17, 4), (16, -1, 4), (16, 3, 0), (4, 1, 5)])
def test_pass_at_k_unbiased_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError):
        metrics.pass_at_k_unbiased(n, c, k)


def mutate(records, pid, index, **change):
    out = [dict(r) for r in records]
    for r in out:
        if r["problem_id"] == pid and r["sample_index"] == index:
            r.update(change)
    return out


@pytest.mark.parametrize("records, message", [
    ([r for r in make_records() if not (r["problem_id"] == "b" and r["sample_index"] == 7)],
     "problem 'b': missing sample indices [7]"),
    (make_records() + [{"problem_id": "c", "sample_index": 3, "score": 0}],
     "problem 'c': sample_index 3 appears more than once"),
    (mutate(make_records(), "a", 15, sample_index=16), "problem 'a': sample_index 16 outside 0..15"),
    (mutate(make_records(), "c", 2, score=0.5), "problem 'c' sample 2: score must be 0 or 1"),
    ([{"problem_id": "a", "sample_index": 0}], "missing 'score'"),
    ([], "no eval records"),
])
def test_metrics_validation_errors(records, message):
    with pytest.raises(stage.DataError) as e:
        metrics.dataset_metrics(records)
    assert message in str(e.value)


def test_an_evaluation_counts_the_replies_cut_at_the_token_limit():
    """metrics.json's "replies": the replies cut ("length") of all the set's replies; the records of an older
    episode log (an evaluation resumed across versions) without reply_finish_reasons are counted apart, never as
    replies that ended."""
    records = make_records()
    for r in records:
        r["reply_finish_reasons"] = ["length", "stop"] if r["sample_index"] < 3 else ["stop"]
    assert metrics.dataset_metrics(records)["replies"] == {"replies": 3 * (3 * 2 + 13), "cut": 3 * 3, "unrecorded": 0}
    del records[0]["reply_finish_reasons"], records[20]["reply_finish_reasons"]
    m = metrics.dataset_metrics(records)
    assert m["replies"] == {"replies": 57 - 2 - 1, "cut": 9 - 1, "unrecorded": 2}
    assert importlib.import_module("03_eval").format_cut_replies({"dapo100": m}) == (
        "[eval] dapo100: 8 of 54 replies cut at the token limit (not counted: 2 episodes recorded before their "
        "replies' finish reasons were kept)")


def test_format_metrics_table():
    m = metrics.dataset_metrics(make_records())
    table = importlib.import_module("03_eval").format_metrics_table({"dapo100": m, "aime2026": m})
    lines = table.splitlines()
    assert len(lines) == 3
    assert "Mean4@12-15" in lines[0] and "pass@4 unbiased" in lines[0] and "Mean4 0-3" in lines[0]
    assert lines[1].split() == ["dapo100", "0.5833", "1.0000", "0.4583", "0.6896",
                                "0.5000", "0.3333", "0.4167", "0.5833"]
    assert lines[1].index("0.5833") == lines[2].index("0.5833")  # columns aligned

# -----------------------------------------------------------------------------
# files and hashing


def test_write_json_atomic_roundtrip(tmp_path):
    path = str(tmp_path / "h.json")
    fileio.write_json_atomic({"b": [1, 2.5], "a": "é"}, path)
    assert fileio.read_json(path) == {"b": [1, 2.5], "a": "é"}
    assert list(fileio.read_json(path)) == ["b", "a"]  # insertion order kept
    assert os.listdir(tmp_path) == ["h.json"]


def test_write_json_atomic_keeps_old_content_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "h.json"
    fileio.write_json_atomic({"generation": 1}, str(path))
    before = path.read_bytes()
    with pytest.raises(TypeError):
        fileio.write_json_atomic({"generation": 2, "bad": object()}, str(path))  # fails mid-serialisation
    with pytest.raises(ValueError):
        fileio.write_json_atomic({"sigma": float("nan")}, str(path))
    def broken_replace(src, dst):
        raise OSError("disk full")                                            # fails after the temp file
    monkeypatch.setattr(common.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        fileio.write_json_atomic({"generation": 3}, str(path))
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["h.json"]  # no temp files left behind


def output_check(path, folder: bool = True) -> str:
    """What fileio.check_output_path says of an output path: "ok", or its refusal."""
    try:
        fileio.check_output_path(path, "out", folder=folder)
    except stage.ConfigError as exc:
        return str(exc)
    return "ok"


def test_an_output_is_checked_in_the_folder_the_stage_writes_in(tmp_path, monkeypatch):
    """An output folder that exists must itself be writable, whatever its parent; one that does not exist yet, its
    nearest existing parent; an output file, the folder it goes in. Root ignores permission bits (CI runs as root),
    so os.access, where check_output_path looks it up, says here which folders this user may write in."""
    home, srv = tmp_path / "home", tmp_path / "srv"  # tmp_path itself: not writable, as /home is not
    for folder in (home / "runs", srv / "theirs"):
        folder.mkdir(parents=True)
    (home / "result.json").write_text("{}")
    (srv / "theirs" / "result.json").write_text("{}")
    writable = {home, home / "runs", srv}
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) in writable and mode == os.W_OK | os.X_OK)
    refused = "--out={}: no permission to write in {}".format
    for path, folder, says in [
        (home, True, "ok"),  # --run_dir=$HOME: a writable folder in a parent that is not
        (home / "runs", True, "ok"),
        (srv / "theirs", True, refused(srv / "theirs", srv / "theirs")),  # a folder of others' in a writable one
        (home / "new" / "run", True, "ok"),  # made inside the nearest folder that exists
        (srv / "theirs" / "new" / "run", True, refused(srv / "theirs" / "new" / "run", srv / "theirs")),
        (home / "result.json", False, "ok"),  # a file: written beside, then renamed over
        (home / "new" / "result.json", False, "ok"),
        (srv / "theirs" / "result.json", False, refused(srv / "theirs" / "result.json", srv / "theirs")),
        (tmp_path / "new", True, refused(tmp_path / "new", tmp_path)),
    ]:
        assert output_check(path, folder) == says, path
    monkeypatch.chdir(home)
    assert output_check(".") == "ok"  # --run_dir=. in a home folder
    monkeypatch.chdir(srv / "theirs")
    assert output_check(".") == refused(".", srv / "theirs")


def test_output_folders_are_checked_against_the_permissions_of_an_unprivileged_user():
    """The same rules where permission bits bind: as this user when it is not root, else as nobody (uid 65534) in
    a forked child. One's own run folder in a folder of root's (as under /home) is accepted; a folder of root's in
    one anyone may write in is refused, and so is a new folder where only root may make it."""
    if os.geteuid() == 0 and as_user(65534, os.geteuid) != "65534":
        pytest.skip("root cannot act as another user (uid 65534) on this machine")
    top = Path(tempfile.mkdtemp(prefix="es-output-", dir="/tmp"))  # tmp_path's parents admit root alone
    home, mine, scratch, theirs = top / "home", top / "home" / "me", top / "scratch", top / "scratch" / "theirs"
    try:
        for folder in (mine, theirs):
            folder.mkdir(parents=True)
        for folder, mode in ((top, 0o755), (home, 0o555), (mine, 0o777), (scratch, 0o777), (theirs, 0o555)):
            folder.chmod(mode)
        paths = (mine, mine / "new", theirs, home / "new")

        def check() -> str:
            return "\n".join(output_check(p) for p in paths)

        said = as_user(65534, check) if os.geteuid() == 0 else check()
        assert said.splitlines() == ["ok", "ok", f"--out={theirs}: no permission to write in {theirs}",
                                     f"--out={home / 'new'}: no permission to write in {home}"]
    finally:
        for folder in (home, theirs):
            folder.chmod(0o755)
        shutil.rmtree(top)


def test_read_json_errors(tmp_path):
    with pytest.raises(stage.DataError, match="not found"):
        fileio.read_json(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1', encoding="utf-8")
    with pytest.raises(stage.DataError, match="not valid JSON"):
        fileio.read_json(str(bad))


def test_sha256_file_known_value(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    assert fileio.sha256_file(str(path)) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    data = os.urandom(10_000)
    path.write_bytes(data)
    assert fileio.sha256_file(str(path), chunk=7) == hashlib.sha256(data).hexdigest()


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="needs coreutils sha256sum")
def test_sha256sums_checked_by_real_sha256sum(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "model-rank-1-part-0.safetensors").write_bytes(b"rank1")
    (tmp_path / "model-rank-0-part-0.safetensors").write_bytes(b"rank0")
    (tmp_path / "sub" / "config.json").write_text("{}")
    (tmp_path / "with space.txt").write_text("x")
    files = ["model-rank-1-part-0.safetensors", "sub/config.json", "model-rank-0-part-0.safetensors",
             str(tmp_path / "with space.txt")]  # relative or absolute-inside-folder
    sums = fileio.write_sha256sums(str(tmp_path), files)
    text = (tmp_path / "SHA256SUMS").read_text()
    assert text.splitlines()[0] == f"{hashlib.sha256(b'rank0').hexdigest()}  model-rank-0-part-0.safetensors"
    assert [line.split("  ", 1)[1] for line in text.splitlines()] == sorted(sums)
    run = subprocess.run(["sha256sum", "-c", "--strict", "SHA256SUMS"], cwd=tmp_path, capture_output=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert fileio.verify_sha256sums(str(tmp_path)) == []

    (tmp_path / "model-rank-1-part-0.safetensors").write_bytes(b"altered")
    (tmp_path / "sub" / "config.json").unlink()
    run = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=tmp_path, capture_output=True)
    assert run.returncode != 0
    assert fileio.verify_sha256sums(str(tmp_path)) == ["model-rank-1-part-0.safetensors: sha256 mismatch",
                                                        "sub/config.json: missing"]


def test_an_export_hashes_each_file_once_when_written_and_when_verified(tmp_path, monkeypatch):
    """A shard of the 30B export is 28 GiB: writing the manifest and SHA256SUMS reads each file once, and so does
    verifying them (the manifest's shard sums and SHA256SUMS checked from one hash), also when a shard is altered."""
    folder = tmp_path / "export"
    folder.mkdir()
    shards = [f"model-rank-{rank}-part-0.safetensors" for rank in range(2)]
    for name in shards:
        (folder / name).write_bytes(os.urandom(4096))
    (folder / "config.json").write_text("{}")
    identity = {"config": {"dtype": "bfloat16"}, "tensor_parallel_size": 2, "parameter_names_sha256": "names",
                "devices": [], "base_model": "tiny", "base_fingerprint": "sha256:base", "device_type": "cpu",
                "vllm_version": "0.32.0", "torch_version": "2"}
    hashed = []
    sha256_file = fileio.sha256_file
    monkeypatch.setattr(fileio, "sha256_file", lambda path, *args: hashed.append(Path(path).name) or
                        sha256_file(path, *args))  # where export.py and fileio look it up
    weights = export.sharded_state_fields(folder, identity, ["d0", "d1"])
    export.write_manifest(folder, {"config": {}, "replayed_generations": 1}, identity, weights)
    every_file = sorted([*shards, "config.json", export.SHARDED_STATE_MANIFEST])
    assert sorted(hashed) == every_file
    hashed.clear()
    assert export.verify(folder, 2)["shards"] == weights["shards"]
    assert sorted(hashed) == every_file
    (folder / shards[0]).write_bytes(b"altered")
    hashed.clear()
    with pytest.raises(stage.ExportError, match=f"shard {shards[0]} does not match its sha256 in the manifest; "
                                                f"{shards[0]}: sha256 mismatch$"):
        export.verify(folder, 2)
    assert sorted(hashed) == every_file


def test_sha256sums_rejects_outside_files_and_reports_missing_list(tmp_path):
    with pytest.raises(ValueError, match="not inside"):
        fileio.write_sha256sums(str(tmp_path), ["../elsewhere"])
    assert "missing" in fileio.verify_sha256sums(str(tmp_path))[0]
    (tmp_path / "SHA256SUMS").write_text("nothex  file\n")
    assert "malformed line" in fileio.verify_sha256sums(str(tmp_path))[0]


def test_append_and_read_jsonl(tmp_path):
    path = str(tmp_path / "log.jsonl")
    fileio.append_jsonl(path, [{"g": 0}, {"g": 1}])
    fileio.append_jsonl(path, [{"g": 2, "text": "é"}])
    assert fileio.read_jsonl(path) == [{"g": 0}, {"g": 1}, {"g": 2, "text": "é"}]


def test_read_jsonl_ignores_torn_last_line_and_append_repairs_it(tmp_path):
    path = tmp_path / "log.jsonl"
    fileio.append_jsonl(str(path), [{"g": 0}, {"g": 1}])
    with open(path, "ab") as f:
        f.write('{"g": 2, "text": "\u00e9'.encode()[:-1])  # crash mid-row, even mid UTF-8 character
    assert fileio.read_jsonl(str(path)) == [{"g": 0}, {"g": 1}]
    fileio.append_jsonl(str(path), [{"g": 3}])                   # the fragment is dropped, not glued to g=3
    assert fileio.read_jsonl(str(path)) == [{"g": 0}, {"g": 1}, {"g": 3}]
    assert path.read_bytes().endswith(b'{"g": 3}\n')


def test_jsonl_whole_last_row_without_newline_is_kept(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"g": 0}\n{"g": 1}')  # torn just before the newline: the row itself is whole
    assert fileio.read_jsonl(str(path)) == [{"g": 0}, {"g": 1}]
    fileio.append_jsonl(str(path), [{"g": 2}])
    assert fileio.read_jsonl(str(path)) == [{"g": 0}, {"g": 1}, {"g": 2}]


def test_read_jsonl_corrupt_middle_line_is_an_error(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"g": 0}\n{"g": \n{"g": 2}\n')
    with pytest.raises(stage.DataError, match=":2: malformed JSON line"):
        fileio.read_jsonl(str(path))
    with pytest.raises(stage.DataError, match="not found"):
        fileio.read_jsonl(str(tmp_path / "missing.jsonl"))


# -----------------------------------------------------------------------------
# base models: hub ids resolve to their local snapshot (a fake, offline hub cache here)


def test_hub_id_resolves_to_its_local_snapshot(hub_cache, tmp_path):
    """A hub id becomes the snapshot folder of the local cache, so its weights are fingerprinted by content (as
    the same files in a plain folder) and its config/tokenizer files can be copied beside an export."""
    from conftest import write_hub_cache

    tiny = models.resolve_model("tiny-qwen3-dense")
    snapshot = write_hub_cache(hub_cache, "es-test/tiny-qwen3-dense", tiny)
    resolved = models.resolve_model("es-test/tiny-qwen3-dense")
    assert os.path.samefile(resolved, snapshot)
    assert fileio.model_fingerprint(resolved) == fileio.model_fingerprint(tiny)
    assert fileio.model_fingerprint(resolved).startswith("sha256:")
    out = tmp_path / "export"
    out.mkdir()
    copied = export.copy_model_files(resolved, out)
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(copied)
    assert not any(name.endswith(".safetensors") for name in copied)
    assert not (out / "config.json").is_symlink()  # the file itself, not a link into this machine's cache
    assert (out / "config.json").read_bytes() == (common.Path(tiny) / "config.json").read_bytes()


@pytest.mark.parametrize("name, message", [
    ("es-test/not-downloaded", "is not a local folder and not in the local Hugging Face cache"),
    ("/no/such/model/folder", "no such folder, and not a Hugging Face hub id"),
])
def test_model_that_is_not_local_is_refused_without_network(hub_cache, name, message):
    with pytest.raises(stage.ConfigError, match=message):
        models.resolve_model(name)
    with pytest.raises(stage.ConfigError, match="not a model folder"):
        fileio.model_fingerprint(name)


# ---- the models the project builds: two runs at once, and folders that are not models ----

RESOLVE_AT_ONCE = """
import json, os, sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
from agentic_es import models
from safetensors.torch import load_file
from transformers import AutoTokenizer

cache, barrier, me = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
(barrier / f"ready-{{me}}").touch()
while not (barrier / "go").exists():
    time.sleep(0.005)
path = Path(models.resolve_model("tiny-qwen3-dense", cache_dir=cache))
given = path.stat().st_ino
(barrier / f"resolved-{{me}}").touch()
while len(list(barrier.glob("resolved-*"))) < 2:  # the other process resolves (and maybe builds) meanwhile
    time.sleep(0.005)
assert path.stat().st_ino == given, "the folder this process was given was replaced while it used it"
tokens = AutoTokenizer.from_pretrained(path)("What is 2 + 2?")["input_ids"]
print(json.dumps({{"inode": given, "tensors": len(load_file(path / "model.safetensors")), "tokens": len(tokens)}}))
"""


def test_two_processes_started_at_once_build_one_tiny_model_and_both_load_it(tmp_path):
    """Two runs started together on one machine both need the tiny model: one builds it, neither removes or
    replaces the folder the other was given, both load it whole, and no build folder is left behind."""
    cache, barrier = tmp_path / "models", tmp_path / "barrier"
    barrier.mkdir()
    script = RESOLVE_AT_ONCE.format(repo=str(common.REPO))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(cache), str(barrier), str(k)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in range(2)]
    deadline = time.monotonic() + 300
    while len(list(barrier.glob("ready-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    (barrier / "go").touch()  # both resolve at the same moment
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0] == results[1] and results[0]["tensors"] > 0 and results[0]["tokens"] > 0
    assert sorted(os.listdir(cache)) == [".tiny-qwen3-dense.lock", "tiny-qwen3-dense"]
    assert models.model_folder_problem(cache / "tiny-qwen3-dense") is None


def test_a_build_that_died_leaves_no_folder_in_use_and_the_next_one_cleans_up(tmp_path, monkeypatch):
    cache = tmp_path / "models"

    def dies(path, kind):
        (Path(path) / "config.json").write_text("{}")  # half a model in its own build folder
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "write_tiny_model", dies)
    with pytest.raises(KeyboardInterrupt):
        models.resolve_model("tiny-qwen3-dense", cache_dir=cache)
    assert sorted(os.listdir(cache)) == [".tiny-qwen3-dense.lock"]
    (cache / ".tiny-qwen3-dense.building-left-by-a-killed-process").mkdir()  # SIGKILL runs no cleanup
    monkeypatch.undo()
    path = models.resolve_model("tiny-qwen3-dense", cache_dir=cache)
    assert sorted(os.listdir(cache)) == [".tiny-qwen3-dense.lock", "tiny-qwen3-dense"]
    assert models.model_folder_problem(Path(path)) is None


def quick_build(folder, kind):
    """A stand-in for write_tiny_model (a real build takes seconds): a folder with a config.json naming the build."""
    (Path(folder) / "config.json").write_text(json.dumps({"built_by": os.getpid(), "kind": kind}))


def test_a_folder_in_the_way_of_a_build_is_moved_aside_not_deleted(tmp_path, monkeypatch, capsys):
    """A folder at the model's place without config.json is not a finished build, yet a process may be reading it:
    it is moved aside, whole (the same files, still readable through what was open), and the build goes on."""
    cache = tmp_path / "models"
    in_the_way = cache / "tiny-qwen3-dense"
    in_the_way.mkdir(parents=True)
    (in_the_way / "model.safetensors").write_bytes(b"weights being read")
    inode = (in_the_way / "model.safetensors").stat().st_ino
    monkeypatch.setattr(models, "write_tiny_model", quick_build)
    with open(in_the_way / "model.safetensors", "rb") as reading:
        path = Path(models.resolve_model("tiny-qwen3-dense", cache_dir=cache))
        assert reading.read() == b"weights being read"
    assert json.loads((path / "config.json").read_text())["built_by"] == os.getpid()
    [aside] = cache.glob(".tiny-qwen3-dense.moved-aside-*/tiny-qwen3-dense")
    assert (aside / "model.safetensors").stat().st_ino == inode
    assert capsys.readouterr().out == (f"[models] {path} is not a finished build (no config.json): moved aside to "
                                       f"{aside}, not deleted (a process may still read it); remove it when none "
                                       "does\n")


def test_a_build_that_loses_the_rename_uses_the_finished_folder(tmp_path, monkeypatch):
    """Another process's build that did not take turns with this one (another lock file) puts its folder in place
    while this one builds: this one's rename fails, and it uses that folder (untouched) instead of failing."""
    cache = tmp_path / "models"
    theirs = cache / "tiny-qwen3-dense"

    def overtaken(folder, kind):
        quick_build(folder, kind)
        theirs.mkdir()
        (theirs / "config.json").write_text('{"built_by": "another process"}')

    monkeypatch.setattr(models, "write_tiny_model", overtaken)
    path = models.resolve_model("tiny-qwen3-dense", cache_dir=cache)
    inode = (theirs / "config.json").stat().st_ino
    assert path == str(theirs) and json.loads((theirs / "config.json").read_text()) == {"built_by": "another process"}
    assert sorted(os.listdir(cache)) == [".tiny-qwen3-dense.lock", "tiny-qwen3-dense"]  # its own build removed
    assert models.resolve_model("tiny-qwen3-dense", cache_dir=cache) == path
    assert (theirs / "config.json").stat().st_ino == inode


def test_a_process_waiting_for_another_s_build_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    """While another process holds the build lock, the wait is one line naming the folder and the lock; then the
    build goes on."""
    import fcntl
    import threading

    cache = tmp_path / "models"
    cache.mkdir()
    lock = cache / ".tiny-qwen3-dense.lock"
    monkeypatch.setattr(models, "write_tiny_model", quick_build)
    resolved, said = [], ""
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another open file: as another process's build would hold it
        waiting = threading.Thread(target=lambda: resolved.append(models.resolve_model("tiny-qwen3-dense",
                                                                                       cache_dir=cache)))
        waiting.start()
        deadline = time.monotonic() + 60
        while "\n" not in said and time.monotonic() < deadline:
            time.sleep(0.05)
            said += capsys.readouterr().out
        assert resolved == []
    waiting.join()
    path = cache / "tiny-qwen3-dense"
    assert said == f"[models] another process is building {path}: waiting for it ({lock})\n"
    assert resolved == [str(path)] and capsys.readouterr().out == ""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as two users")
def test_another_user_sharing_the_models_folder_takes_turns_through_the_same_lock(monkeypatch):
    """A models folder shared by the users of a machine: the lock file one user's build left (made under a umask
    that keeps files private) is readable by all, and another user's process takes it and builds."""
    if as_user(65534, os.geteuid) != "65534":
        pytest.skip("root cannot act as another user (uid 65534) on this machine")
    shared = Path(tempfile.mkdtemp(prefix="es-models-", dir="/tmp"))  # tmp_path's parents admit root alone
    shared.chmod(0o1777)
    try:
        def dies(folder, kind):
            raise KeyboardInterrupt

        monkeypatch.setattr(models, "write_tiny_model", dies)
        umask = os.umask(0o077)
        try:
            with pytest.raises(KeyboardInterrupt):  # root's build, interrupted: its lock file stays
                models.resolve_model("tiny-qwen3-dense", cache_dir=shared)
        finally:
            os.umask(umask)
        lock = shared / ".tiny-qwen3-dense.lock"
        assert lock.stat().st_uid == 0 and lock.stat().st_mode & 0o777 == 0o644
        monkeypatch.setattr(models, "write_tiny_model", quick_build)
        assert as_user(65534, lambda: models.resolve_model("tiny-qwen3-dense", cache_dir=shared)) == str(
            shared / "tiny-qwen3-dense")
        assert (shared / "tiny-qwen3-dense").stat().st_uid == 65534
    finally:
        shutil.rmtree(shared)


def damaged_copy(tmp_path, damage) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(models.resolve_model("tiny-qwen3-dense"), folder)
    damage(folder)
    return folder


def cut_in_half(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damage, message", [
    (lambda f: shutil.rmtree(f) or f.mkdir(), "no config.json"),
    (lambda f: (f / "model.safetensors").unlink(), r"no weight files \(\*.safetensors"),
    (lambda f: cut_in_half(f / "model.safetensors"), "model.safetensors: truncated or damaged: its header describes"),
    (lambda f: (f / "model.safetensors").write_bytes(b"\x05"), "model.safetensors: not a whole safetensors file"),
    (lambda f: (f / "config.json").write_text('{"model_type": "qwen3", '), "config.json is not readable JSON"),
    (lambda f: (f / "config.json").write_bytes(b"\xff\xfe{}"), "config.json is not readable JSON .*utf-8"),
    (lambda f: (f / "config.json").write_text("[1, 2]"), "config.json names no model_type or architectures"),
    (lambda f: (f / "tokenizer.json").unlink(), "no tokenizer"),
    (lambda f: (f / "chat_template.jinja").unlink(), "no chat template"),
    (lambda f: (f / models.SAFETENSORS_INDEX).write_text(json.dumps({"weight_map": {"a": "model-00002.safetensors"}})),
     "model.safetensors.index.json names 1 missing weight files \\(model-00002.safetensors\\)"),
    (lambda f: (f / "pytorch_model.bin").write_bytes(b"PK\x03\x04" + b"\0" * 100), "pytorch_model.bin: a torch archive"),
])
def test_a_folder_that_is_not_a_model_is_refused_naming_what_is_wrong(tmp_path, damage, message):
    folder = damaged_copy(tmp_path, damage)
    with pytest.raises(stage.ConfigError, match=f"^{folder} is not a model folder: {message}"):
        models.resolve_model(str(folder))


def test_a_model_folder_that_is_not_a_model_stops_training_before_any_engine_or_run_folder(stage, tmp_path):
    folder = damaged_copy(tmp_path, lambda f: cut_in_half(f / "model.safetensors"))
    proc = stage("01_train.py", "--preset=smoke", f"--model={folder}", f"--run_dir={tmp_path / 'run'}")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    whole = (Path(models.resolve_model("tiny-qwen3-dense")) / "model.safetensors").stat().st_size
    assert proc.stderr.strip().splitlines() == [
        f"[train] error: {folder} is not a model folder: model.safetensors: truncated or damaged: its header "
        f"describes {whole} bytes, the file has {whole // 2}"]
    assert not (tmp_path / "run").exists()


# ---- experiment tracking ----

RECORD = {"generation": 3, "rewards": [0.25, 0.5, 1.0, 0.25], "sigma": 7.5e-4, "alpha": 5e-4,
          "timings": {"rollout": 12.5, "perturb": 0.25}}


def tensorboard_scalars(folder):
    """{tag: [(step, value), ...]} of every event file in folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_generation_scalars_are_the_records_numbers():
    assert tracking.generation_scalars(RECORD) == {
        "reward/mean": 0.5, "reward/max": 1.0, "reward/min": 0.25, "reward/std": pytest.approx(0.3061862178),
        "sigma": 7.5e-4, "alpha": 5e-4, "seconds/rollout": 12.5, "seconds/perturb": 0.25}
    counted = dict(RECORD, replies={"cut": 2, "replies": 9}, scorer_failures={"score_error": 1, "score_timeout": 0})
    assert {k: v for k, v in tracking.generation_scalars(counted).items() if k not in tracking.generation_scalars(
        RECORD)} == {"replies/cut": 2.0, "scorer_failures/score_error": 1.0, "scorer_failures/score_timeout": 0.0}


def test_tensorboard_tracking_writes_each_step_and_a_resume_appends(tmp_path):
    cfg = common.Config(tracking="tensorboard")
    with tracking.Tracker(cfg, tmp_path) as tracker:
        tracker.log(0, {"reward/mean": 0.125, "sigma": 1e-3})
        tracker.log(1, {"reward/mean": 0.5, "sigma": 9e-4})
    with tracking.Tracker(cfg, tmp_path) as tracker:  # the run resumed
        tracker.log(2, {"reward/mean": 0.75, "sigma": 8e-4})
    scalars = tensorboard_scalars(tmp_path / tracking.TENSORBOARD_DIR)
    assert scalars["reward/mean"] == [(0, 0.125), (1, 0.5), (2, 0.75)]
    assert [(s, pytest.approx(v)) for s, v in scalars["sigma"]] == [(0, 1e-3), (1, 9e-4), (2, 8e-4)]


def generation_record(g: int) -> dict:
    return dict(RECORD, generation=g, rewards=[0.25 * g, 0.5, 1.0, 0.25], sigma=1e-3 - 1e-4 * g)


def test_a_resume_logs_the_generations_the_history_has_and_the_event_files_lack(tmp_path):
    """The process died after generation 2's history write: generation 1 is all there, generation 2 got one of
    its scalars. The resumed tracker adds exactly what is missing, once."""
    cfg, records = common.Config(tracking="tensorboard"), [generation_record(g) for g in range(3)]
    with tracking.Tracker(cfg, tmp_path) as tracker:
        for record in records[:2]:
            tracker.log(record["generation"], tracking.generation_scalars(record))
        tracker.log(2, {"sigma": records[2]["sigma"]})
    with tracking.Tracker(cfg, tmp_path) as tracker:
        tracker.log_missing(records)
    files = sorted((tmp_path / tracking.TENSORBOARD_DIR).iterdir())
    with tracking.Tracker(cfg, tmp_path) as tracker:
        tracker.log_missing(records)  # nothing missing: no new event file either
    assert sorted((tmp_path / tracking.TENSORBOARD_DIR).iterdir()) == files
    scalars = tensorboard_scalars(tmp_path / tracking.TENSORBOARD_DIR)
    expected = [tracking.generation_scalars(r) for r in records]
    assert set(scalars) == set(expected[0])
    for name, points in scalars.items():
        assert points == [(g, pytest.approx(expected[g][name])) for g in range(3)], name


def test_a_finished_run_started_again_logs_the_last_generation_its_process_did_not(tmp_path):
    """01_train.py on a history that holds every generation starts no engine; the event files still get the
    generation whose process ended between the history write and the log."""

    train = importlib.import_module("01_train")
    argv = ["--preset=smoke", f"--run_dir={tmp_path}", "--tracking=tensorboard"]
    cfg = cli.parse_config(argv)
    timings = {k: 1.0 for k in ("rollout", "perturb", "restore", "update", "digest")}
    records = [dict(generation_record(g), timings=timings, digests=["d"], seeds=[1, 2, 3, 4], z=[0.0] * 4)
               for g in range(cfg.generations)]
    fileio.write_json_atomic({"config": dataclasses.asdict(cfg), "base_model": "tiny", "base_digests": ["d0"],
                              "generations": records}, tmp_path / history.HISTORY_FILE)
    with tracking.Tracker(cfg, tmp_path) as tracker:
        for record in records[:-1]:
            tracker.log(record["generation"], tracking.generation_scalars(record))
    train.main(argv)
    steps = [step for step, _ in tensorboard_scalars(tmp_path / tracking.TENSORBOARD_DIR)["reward/mean"]]
    assert steps == list(range(cfg.generations))


def test_no_tracking_writes_nothing_and_an_unknown_tracker_is_refused(tmp_path):
    with tracking.Tracker(common.Config(), tmp_path) as tracker:
        tracker.log(0, {"reward/mean": 1.0})
        tracker.log_missing([RECORD])
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(stage.ConfigError, match="tracking must be one of none, tensorboard, got 'wandb'"):
        cli.parse_config(["--tracking=wandb"])
