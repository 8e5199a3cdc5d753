"""Settings without sense and inputs a stage cannot use, met as a user meets them: each numbered script's __main__
path (stage.run_stage) with the user's command line, in this process (the conftest's `stage`), and once per script
as a subprocess (the one line on the real stderr and the exit status of a real interpreter). Each refusal is one
line on stderr naming the setting or the file (and its line where it has lines), a non-zero exit, no traceback, and
nothing left behind: no run folder, no export or evaluation folder, no file changed. Every refusal comes before any
engine starts (starting one fails the test)."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import common
from agentic_es import cli, engine, fileio, metrics, models, stage, vllm_platform
from agentic_es.data import load_problems, problems_from
from agentic_es.export import SHARDED_STATE_MANIFEST, verify_sharded_state
from agentic_es.history import HISTORY_FILE, HISTORY_FORMAT
from agentic_es.placement import check_cpu_pool
from conftest import stage_process

SMOKE = cli.parse_config(["--preset=smoke"])
CORES = len(os.sched_getaffinity(0))


@pytest.fixture
def environment_restored():
    """os.environ as it was before the test (an engine's set-up writes vLLM's variables into it)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def no_engine_starts(monkeypatch):
    """Where an engine's processes would start (after vLLM has checked its configuration): a test that gets there
    has let a bad input through."""
    async def refuse(self, vllm_config):
        raise AssertionError("an engine started before the bad input was refused")
    monkeypatch.setattr(engine.Engine, "_start", refuse)


def files_under(folder: Path) -> dict:
    """Every file under folder with its bytes: what a refused stage must leave as it was."""
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_refused(proc: subprocess.CompletedProcess, name: str, *says: str) -> str:
    """One line '[name] error: ...' holding every one of `says`, and a non-zero exit."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"[{name}] error: ") and all(s in lines[0] for s in says), lines[0]
    return lines[0]


# ---- settings: each range means something, checked before any engine ----

@pytest.mark.parametrize("setting, says", [
    ("--population=1", "population must be in [2, 65536]"),
    ("--case_batch=0", "case_batch must be at least 1"),
    ("--sigma_start=-1e-3", "sigma_start must be a finite number greater than 0"),
    ("--sigma_end=0", "sigma_end must be a finite number greater than 0"),
    ("--sigma_start=nan", "sigma_start must be a finite number"),
    ("--alpha=inf", "alpha must be a finite number"),
    ("--alpha=nan", "alpha must be a finite number"),
    ("--max_turns=0", "max_turns must be at least 1"),
    ("--temperature=-0.5", "temperature must be a finite number in [0, 2]"),
    ("--top_k=-2", "top_k must be at least -1"),
    ("--max_new_tokens=2048", "max_new_tokens=2048 leaves no room for the prompt in max_model_len=2048"),
    ("--run_seed=4294967296", "run_seed must be in [0, 4294967295]"),
    ("--generations=1e19", "generations must fit in 64 bits"),
    ("--population=1e400", "--population expects an integer"),
    ("--bash_timeout_s=1e300", "bash_timeout_s must be a finite number in (0, 86400]"),
])
def test_a_setting_without_sense_is_one_line_before_anything_starts(stage, tmp_path, setting, says):
    assert_refused(stage("01_train.py", "--preset=smoke", setting, f"--run_dir={tmp_path / 'run'}"), "train", says)
    assert not (tmp_path / "run").exists()


def test_top_k_minus_one_and_zero_both_mean_every_token_in_vllm():
    """Both are admitted and reach vLLM, whose batch cuts to the top k only for 0 < top_k < vocabulary size (vLLM
    accepts -1 as 0); -2 has no meaning and never reaches it."""
    params = [engine.sampling_params(common.Config(top_k=k), seed=1, max_tokens=8).top_k for k in (-1, 0, 40)]
    assert params == [-1, 0, 40]
    with pytest.raises(stage.ConfigError, match="top_k must be at least -1"):
        common.Config(top_k=-2)


# ---- what the machine can place: TP ranks and engines, before any engine starts ----

def test_a_tp_size_beyond_the_machine_s_cores_is_refused_before_any_engine(stage, tmp_path):
    line = assert_refused(stage("01_train.py", "--preset=smoke", f"--tensor_parallel_size={CORES + 1}",
                                f"--run_dir={tmp_path / 'run'}"), "train")
    assert f"tensor_parallel_size={CORES + 1} needs {CORES + 1} CPU cores" in line and f"process {CORES}" in line
    assert not (tmp_path / "run").exists()


def test_more_cpu_engines_than_cores_are_refused_before_any_engine(stage, tmp_path):
    line = assert_refused(stage("01_train.py", "--preset=smoke", "--tensor_parallel_size=1", f"--engines={CORES + 1}",
                                f"--run_dir={tmp_path / 'run'}"), "train")
    assert f"engines={CORES + 1} x tensor_parallel_size=1 = {CORES + 1} TP ranks" in line
    assert f"has {CORES} CPU cores" in line
    assert not (tmp_path / "run").exists()


def test_placement_counts_gpus_cores_and_the_user_s_core_groups(monkeypatch):
    import torch

    monkeypatch.delenv(vllm_platform.CPU_BIND_DEFAULT, raising=False)  # no engine of this process chose a binding

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(stage.ConfigError, match=r"^tensor_parallel_size=2 needs 2 GPUs, one per TP rank; this "
                                                r"process sees 1 \(CUDA_VISIBLE_DEVICES=3\)$"):
        vllm_platform.check_placement(2, "cuda")
    vllm_platform.check_placement(1, "cuda")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    with pytest.raises(stage.ConfigError, match="tensor_parallel_size=5 needs 5 CPU cores"):
        vllm_platform.check_placement(5, "cpu")
    monkeypatch.setenv(vllm_platform.CPU_BIND, "0|1")  # the user's: two core groups
    with pytest.raises(stage.ConfigError, match=r"tensor_parallel_size=3 needs one core group per TP rank in "
                                                r"VLLM_CPU_OMP_THREADS_BIND, which names 2 \('0\|1'\)"):
        vllm_platform.check_placement(3, "cpu")
    vllm_platform.check_placement(2, "cpu")
    vllm_platform.check_placement(1, "cpu")  # one process: it takes the first group
    monkeypatch.setenv(vllm_platform.CPU_BIND, "0|1|2|3")
    with pytest.raises(stage.ConfigError, match="tensor_parallel_size=2 needs one core group per TP rank"):
        vllm_platform.check_placement(2, "cpu")
    monkeypatch.setenv(vllm_platform.CPU_BIND, "auto")
    vllm_platform.check_placement(4, "cpu")
    with pytest.raises(stage.ConfigError, match="engines=3 x tensor_parallel_size=2 = 6 TP ranks, but this machine "
                                                "has 4 CPU cores, one per rank: use --engines=2 or fewer"):
        check_cpu_pool(3, 2, 4)
    check_cpu_pool(2, 2, 4)


def test_the_default_core_binding_follows_each_engine_s_tp_size_and_leaves_the_user_s(monkeypatch,
                                                                                       environment_restored):
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    monkeypatch.setattr(vllm_platform, "keep_cpu_linear_weights", lambda: None)
    monkeypatch.delenv(vllm_platform.CPU_BIND_DEFAULT, raising=False)
    os.environ.pop(vllm_platform.CPU_BIND, None)
    vllm_platform.configure_cpu_env(3)
    assert os.environ[vllm_platform.CPU_BIND] == "0|1|2"
    vllm_platform.configure_cpu_env(1)  # another engine of this process, at another TP size
    assert os.environ[vllm_platform.CPU_BIND] == "0"
    os.environ[vllm_platform.CPU_BIND] = "2"  # the user's (or the pool's) choice wins
    vllm_platform.configure_cpu_env(1)
    assert os.environ[vllm_platform.CPU_BIND] == "2"


def test_a_stage_started_by_a_process_whose_engine_chose_a_binding_chooses_its_own(monkeypatch,
                                                                                     environment_restored):
    """A test (or script) that ran an engine at TP=1 leaves its default binding "0" in the environment its stages
    inherit; a stage at TP=2 started from it is placed on two cores, not refused as if the user had named one."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(vllm_platform, "keep_cpu_linear_weights", lambda: None)
    monkeypatch.delenv(vllm_platform.CPU_BIND_DEFAULT, raising=False)
    os.environ.pop(vllm_platform.CPU_BIND, None)
    vllm_platform.configure_cpu_env(1)
    assert os.environ[vllm_platform.CPU_BIND] == "0"
    # the child inherits this environment (the process boundary is what is tested); vLLM's layers are not
    stage = subprocess.run([sys.executable, "-c", "from agentic_es import vllm_platform; "
                            "vllm_platform.keep_cpu_linear_weights = lambda: None; vllm_platform.check_placement(2, 'cpu'); "
                            "vllm_platform.configure_cpu_env(2); import os; print(os.environ[vllm_platform.CPU_BIND])"],
                           cwd=common.REPO, capture_output=True, text=True, timeout=120)
    assert stage.returncode == 0 and stage.stdout.strip() != "0", stage.stderr[-2000:]  # "0|1" here, "auto" on 4+


# ---- what vLLM refuses: asked before the run folder or any process exists ----

def test_a_max_model_len_beyond_the_model_s_is_one_line_and_no_run_folder(stage, tmp_path):
    line = assert_refused(stage("01_train.py", "--preset=smoke", "--max_model_len=100000",
                                f"--run_dir={tmp_path / 'run'}"), "train", "vLLM refuses to run", "max_model_len")
    assert "(100000)" in line
    assert not (tmp_path / "run").exists()


def test_an_evaluation_vllm_refuses_leaves_no_output_folder(stage, tmp_path):
    assert_refused(stage("03_eval.py", "--preset=smoke", "--export=", "--max_model_len=100000",
                         f"--run_dir={tmp_path / 'run'}"), "eval", "vLLM refuses to run", "max_model_len (100000)")
    assert not (tmp_path / "run").exists()  # neither <run_dir>/eval-base nor vllm.log


def test_a_tp_size_that_does_not_divide_the_attention_heads_is_refused_by_vllm_before_it_starts(
        tmp_path, environment_restored):
    folder = tmp_path / "three-heads"
    shutil.copytree(models.resolve_model("tiny-qwen3-dense"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, num_attention_heads=3, num_key_value_heads=3)))
    cfg = dataclasses.replace(SMOKE, tensor_parallel_size=2, run_dir=str(tmp_path / "run"))
    with pytest.raises(stage.ConfigError, match=r"^vLLM refuses to run .*three-heads with these settings: Total "
                                                r"number of attention heads \(3\) must be divisible by tensor "
                                                r"parallel size \(2\)\.$"):
        engine.Engine(cfg, str(folder))
    assert not (tmp_path / "run").exists()


# ---- data: problem files ----

def problem(i, **fields) -> str:
    return json.dumps({"id": f"p{i}", "question": f"What is {i} + 1?", "answer": str(i + 1), **fields})


@pytest.mark.parametrize("content, says", [
    (problem(1) + "\n" + '{"id": "p2", "question": \n' + problem(3) + "\n", ":2: malformed JSON"),
    (problem(1) + "\n" + json.dumps({"id": "p2", "question": "q"}) + "\n", ":2: missing required field 'answer'"),
    ("", ": no problems in file"),
    ("\n  \n", ": no problems in file"),
    (problem(1) + "\n[1, 2]\n", ":2: expected a JSON object, got list"),
    (problem(1) + "\n" + problem(1) + "\n", ":2: duplicate id 'p1' (first seen on line 1)"),
    (problem(1) + "\n" + problem(2, question=5) + "\n", ":2: field 'question' must be a string, got int"),
    (problem(1) + "\n" + problem(2, answer="  ") + "\n", ":2: field 'answer' is empty"),
    ((problem(1) + "\n").encode() + b'{"id": "p2", "question": "caf\xe9", "answer": "1"}\n',
     ":2: not UTF-8 text (invalid continuation byte"),
])
def test_a_bad_training_file_names_the_file_and_line(stage, tmp_path, content, says):
    data = tmp_path / "train.jsonl"
    data.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert_refused(stage("01_train.py", "--preset=smoke", f"--train_data={data}", "--case_batch=1",
                         f"--run_dir={tmp_path / 'run'}"), "train", f"{data}{says}")
    assert not (tmp_path / "run").exists()


def test_a_training_file_may_open_with_a_byte_order_mark(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("\ufeff" + problem(1) + "\n" + problem(2) + "\n", encoding="utf-8")
    assert [p["id"] for p in load_problems(data)] == ["p1", "p2"]


def test_a_folder_given_as_a_json_file_is_one_line():
    with pytest.raises(stage.DataError, match=r"^.*tests: cannot read it \(Is a directory\)$"):
        fileio.read_json(common.REPO / "tests")
    with pytest.raises(stage.DataError, match=r"^.*tests: cannot read it \(Is a directory\)$"):
        fileio.read_jsonl(common.REPO / "tests")
    with pytest.raises(stage.DataError, match=r"^.*tests: a folder, not a problems file$"):
        load_problems(common.REPO / "tests")


# ---- histories: cut off, or valid JSON of the wrong shape ----

def generation_record(g, members=4):
    rewards = [float(m % 2) for m in range(members)]
    return {"generation": g, "sigma": 1e-3, "alpha": 5e-4, "seeds": list(range(1, members + 1)), "rewards": rewards,
            "z": common.zscore(rewards), "problem_ids": ["a", "b"], "digests": ["d0", "d1"], "timings": {}}


def history(generations=2) -> dict:
    return {"format": HISTORY_FORMAT, "config": dataclasses.asdict(SMOKE), "base_model": SMOKE.model,
            "base_digests": ["b0", "b1"], "generations": [generation_record(g) for g in range(generations)]}


def edited(change) -> dict:
    value = history()
    change(value)
    return value


@pytest.mark.parametrize("change, says", [
    (lambda h: h["generations"][0].update(seeds="1,2,3,4"), "generations[0].seeds expected a list, got str"),
    (lambda h: h["generations"][1]["seeds"].__setitem__(2, "3"), 'generations[1].seeds[2] expected an integer, got "3"'),
    (lambda h: h["generations"][0].update(sigma=None), "generations[0].sigma expected a finite number, got null"),
    (lambda h: h["generations"][0]["rewards"].__setitem__(0, True), "generations[0].rewards[0] expected a finite number, got true"),
    (lambda h: h["generations"][0].update(z=[0.5]), "generations[0] has 4 seeds, 4 rewards and 1 z-scores; the "
                                                    "run's population is 4"),
    (lambda h: h["generations"].__setitem__(1, generation_record(1, members=6)), "generations[1] has 6 seeds"),
    (lambda h: h["generations"][1].update(generation=5), "generations[1] is generation 5; a history holds "
                                                         "generations 0, 1, 2, ... in order"),
    (lambda h: h.update(base_digests="b0"), "base_digests expected a list, got str"),
    (lambda h: h["generations"][0].update(digests=[1, 2]), "generations[0].digests[0] expected a string, got 1"),
])
def test_a_history_of_the_wrong_shape_is_refused_by_export_before_any_engine(stage, tmp_path, change, says):
    path = tmp_path / HISTORY_FILE
    path.write_text(json.dumps(edited(change)))
    assert_refused(stage("02_export.py", "--preset=smoke", f"--history={path}", f"--out={tmp_path / 'export'}"),
                   "export", f"{path}: {says}")
    assert sorted(os.listdir(tmp_path)) == [HISTORY_FILE]  # no export, no export.partial


def test_a_history_cut_off_mid_file_is_one_line_and_training_changes_nothing(stage, tmp_path):
    text = json.dumps(history(), indent=2)
    (tmp_path / HISTORY_FILE).write_text(text[: len(text) // 2])  # a full disk, before the atomic writes
    before = files_under(tmp_path)
    assert_refused(stage("01_train.py", "--preset=smoke", f"--run_dir={tmp_path}"), "train",
                   f"{tmp_path / HISTORY_FILE}: not valid JSON")
    assert files_under(tmp_path) == before
    assert_refused(stage("02_export.py", "--preset=smoke", f"--run_dir={tmp_path}"), "export",
                   f"{tmp_path / HISTORY_FILE}: not valid JSON")
    assert files_under(tmp_path) == before


# ---- exports and evaluations ----

def sharded_export(folder: Path) -> Path:
    """An export folder as 02_export.py lays it out at TP=2 (stand-in shard bytes), its manifest and SHA256SUMS."""
    folder.mkdir(parents=True)
    shards = []
    for rank in range(2):
        name = f"model-rank-{rank}-part-0.safetensors"
        (folder / name).write_bytes(bytes([rank]) * 64)
        shards.append({"file": name, "rank": rank, "part": 0, "bytes": 64, "sha256": fileio.sha256_file(folder / name)})
    manifest = {"format": "es-sharded-export/1", "tensor_parallel_size": 2, "shards": shards,
                "per_rank_digests": ["a", "b"], "parameter_names_sha256": "p", "replayed_generations": 2,
                "vllm_version": "v"}
    fileio.write_json_atomic(manifest, folder / SHARDED_STATE_MANIFEST)
    fileio.write_sha256sums(folder, [s["file"] for s in shards] + [SHARDED_STATE_MANIFEST])
    return folder


def test_an_export_missing_a_rank_shard_is_one_line_for_verify_and_for_eval(stage, tmp_path):
    export = sharded_export(tmp_path / "export")
    verify_sharded_state(export, 2)  # whole, it passes
    (export / "model-rank-1-part-0.safetensors").unlink()
    line = assert_refused(stage("02_export.py", "--preset=smoke", f"--verify={export}"), "export",
                          f"{export} failed verification: missing shard model-rank-1-part-0.safetensors")
    assert "model-rank-1-part-0.safetensors: missing" in line
    (export / fileio.SHA256SUMS).write_bytes(b"\xff" + (export / fileio.SHA256SUMS).read_bytes())
    assert_refused(stage("02_export.py", "--preset=smoke", f"--verify={export}"), "export",
                   f"{export / fileio.SHA256SUMS}: not UTF-8 text")
    before = files_under(tmp_path)
    assert_refused(stage("03_eval.py", "--preset=smoke", f"--run_dir={tmp_path / 'run'}", f"--export={export}"),
                   "eval", "missing shard model-rank-1-part-0.safetensors")
    assert files_under(tmp_path) == before and not (tmp_path / "run").exists()


def evaluation(run_dir: Path) -> Path:
    """A finished 03_eval.py folder of the smoke run's base model, and the history beside it."""
    ids = [p["id"] for p in problems_from("smoke", SMOKE.run_seed)[:2]]
    records = [{"problem_id": pid, "sample_index": i, "seed": common.request_seed(SMOKE.run_seed, pid, i, 0),
                "score": 0.0} for pid in ids for i in range(metrics.EVAL_SAMPLES)]
    eval_dir = run_dir / "eval"
    fileio.write_json_atomic(history(), run_dir / HISTORY_FILE)
    fileio.write_json_atomic({"dataset": "dapo", "data": "smoke", "config": dataclasses.asdict(SMOKE),
                              "records": records,
                              "checkpoint": {"kind": "base", "model": SMOKE.model, "per_rank_digests": ["b0", "b1"]}},
                             eval_dir / "dapo_eval16.json")
    fileio.write_json_atomic({"datasets": {"dapo": {}}}, eval_dir / metrics.EVAL_METRICS)
    return eval_dir


@pytest.mark.parametrize("damage, says", [
    (lambda e: (e / metrics.EVAL_METRICS).write_text("metrics: none\n"), f"{metrics.EVAL_METRICS}: not valid JSON"),
    (lambda e: (e / metrics.EVAL_METRICS).write_bytes(b"\xff\xfe"), f"{metrics.EVAL_METRICS}: not valid JSON"),
    (lambda e: (e / "dapo_eval16.json").write_text((e / "dapo_eval16.json").read_text()[:500]),
     "dapo_eval16.json: not valid JSON"),
])
def test_an_evaluation_that_is_not_json_is_one_line_and_replay_writes_nothing(stage, tmp_path, damage, says):
    eval_dir = evaluation(tmp_path)
    damage(eval_dir)
    before = files_under(tmp_path)
    assert_refused(stage("04_replay.py", "--preset=smoke", f"--run_dir={tmp_path}"), "replay", says)
    assert files_under(tmp_path) == before


def test_damaged_episodes_of_an_evaluation_to_resume_are_one_line_before_any_engine(stage, tmp_path):
    out = tmp_path / "eval-base"
    rows = [{"problem_id": "smoke-000", "sample_index": i, "seed": i, "score": 0.0} for i in range(3)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (out).mkdir()
    (out / "dapo_episodes.jsonl").write_text(text.replace('"seed": 1,', '"seed": 1'))  # line 2 broken, not torn
    before = files_under(tmp_path)
    assert_refused(stage("03_eval.py", "--preset=smoke", "--export=", f"--out={out}", f"--run_dir={tmp_path / 'run'}"),
                   "eval", f"{out / 'dapo_episodes.jsonl'}:2: malformed JSON line")
    assert files_under(tmp_path) == before and not (tmp_path / "run").exists()


# ---- outputs a stage could not write at its end, refused at its start ----

@pytest.mark.parametrize("script, option, says", [
    ("01_train.py", "--run_dir={file}", "--run_dir={file}: a file is in the way of the folder this stage writes"),
    ("01_train.py", "--run_dir={file}/run", "--run_dir={file}/run: {file} is a file, not a folder"),
    ("02_export.py", "--out={file}/export", "--out={file}/export: {file} is a file, not a folder"),
    ("03_eval.py", "--out={file}", "--out={file}: a file is in the way of the folder this stage writes"),
    ("04_replay.py", "--out={folder}", "--out={folder}: a folder is in the way of the file this stage writes"),
])
def test_an_output_that_cannot_be_written_is_refused_before_any_work(stage, tmp_path, script, option, says):
    run_dir = tmp_path / "run"
    evaluation(run_dir)  # a history and a finished evaluation: what export and replay read first
    (tmp_path / "file").write_text("in the way")
    (tmp_path / "folder").mkdir()
    paths = {"file": tmp_path / "file", "folder": tmp_path / "folder"}
    before = files_under(tmp_path)
    name = {"01": "train", "02": "export", "03": "eval", "04": "replay"}[script[:2]]
    extra = ["--export="] if name == "eval" else []  # the base model
    assert_refused(stage(script, "--preset=smoke", f"--run_dir={run_dir}", *extra, option.format(**paths)), name,
                   says.format(**paths))
    assert files_under(tmp_path) == before and sorted(os.listdir(tmp_path / "folder")) == []


# ---- the same refusals from a real interpreter: one per script ----

def cut_off_history(folder: Path) -> list[str]:
    text = json.dumps(history(), indent=2)
    (folder / HISTORY_FILE).write_text(text[: len(text) // 2])
    return [f"--run_dir={folder}"]


def not_json_metrics(folder: Path) -> list[str]:
    (evaluation(folder) / metrics.EVAL_METRICS).write_text("metrics: none\n")
    return [f"--run_dir={folder}"]


@pytest.mark.parametrize("script, name, arrange, says", [
    ("01_train.py", "train", lambda f: ["--population=1", f"--run_dir={f / 'run'}"],
     "population must be in [2, 65536]"),
    ("02_export.py", "export", cut_off_history, f"{HISTORY_FILE}: not valid JSON"),
    ("03_eval.py", "eval", lambda f: ["--export=", "--max_model_len=100000", f"--run_dir={f / 'run'}"],
     "vLLM refuses to run"),  # vLLM's configuration made in the process, its log kept off the console
    ("04_replay.py", "replay", not_json_metrics, f"{metrics.EVAL_METRICS}: not valid JSON"),
])
def test_a_script_s_refusal_is_one_line_on_its_stderr_and_exit_status_1(tmp_path, script, name, arrange, says):
    """What the in-process runs above stand for: the script's own interpreter (prepare_script, vLLM's logging as
    the script sets it up, the exit through sys.exit) writes the one line and nothing else, and exits 1."""
    args = arrange(tmp_path)
    before = files_under(tmp_path)
    proc = stage_process(script, "--preset=smoke", *args)
    assert "Traceback" not in proc.stderr
    assert_refused(proc, name, says)
    assert files_under(tmp_path) == before and not (tmp_path / "run").exists()
