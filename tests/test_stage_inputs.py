"""Files a stage reads that are valid JSON but lack what it reads (a history without `generations`, a manifest
without `shards`, eval records without `seed`): one clear StageError naming the file and the key, before any engine
starts; and what the stages that never perturb (export, evaluation, replay) ask of the pool they start. Fast: no
engine is ever started (starting one fails the test)."""

import dataclasses
import importlib
import json
import re

import pytest

import common
from agentic_es import cli, data, engine, export, fileio, metrics, models, pool, sandbox, settings, stage
from agentic_es.history import HISTORY_FILE, HISTORY_FORMAT

export_stage = importlib.import_module("02_export")
train_stage = importlib.import_module("01_train")
replay_stage = importlib.import_module("04_replay")
eval_stage = importlib.import_module("03_eval")


@pytest.fixture(autouse=True)
def no_engine(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("an engine started before the bad input was refused")
    for module, name in ((export_stage, "EnginePool"), (train_stage, "EnginePool"), (replay_stage, "EnginePool"),
                         (eval_stage, "EnginePool"), (engine, "Engine"), (pool, "EnginePool")):
        monkeypatch.setattr(module, name, refuse)  # where each stage, and the pool, look it up
    monkeypatch.setattr(models, "resolve_model", lambda name, *args, **kwargs: name)
    monkeypatch.setattr(sandbox, "check_sandbox", lambda *args, **kwargs: [])


SMOKE = cli.parse_config(["--preset=smoke"])


def generation_record(g):
    return {"generation": g, "sigma": 1e-3, "alpha": 5e-4, "seeds": [1, 2, 3, 4], "rewards": [0.0, 1.0, 0.0, 1.0],
            "z": common.zscore([0.0, 1.0, 0.0, 1.0]), "problem_ids": ["a", "b"], "digests": ["d0", "d1"],
            "timings": {}}


def history(generations=2):
    return {"format": HISTORY_FORMAT, "config": dataclasses.asdict(SMOKE), "base_model": SMOKE.model,
            "base_digests": ["b0", "b1"], "generations": [generation_record(g) for g in range(generations)]}


def without(value, *path):
    """A deep copy of value without the key at `path` (keys and list indices)."""
    value = json.loads(json.dumps(value))
    inner = value
    for key in path[:-1]:
        inner = inner[key]
    del inner[path[-1]]
    return value


def write(value, path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))
    return path


@pytest.mark.parametrize("value, shape, message", [
    ({"a": 1}, ("a", "b"), "f.json: missing key 'b'"),
    ([], ("a",), "f.json: expected an object, got list"),
    ({"a": {"b": 1}}, {"a": ("c",)}, "f.json: a missing key 'c'"),
    ({"a": [{"b": 1}, {}]}, {"a": [("b",)]}, "f.json: a[1] missing key 'b'"),
    ({"a": {}}, {"a": [("b",)]}, "f.json: a expected a list, got dict"),
    ({"a": "1"}, {"a": int}, 'f.json: a expected an integer, got "1"'),
    ({"a": [1.0, float("nan")]}, {"a": [float]}, "f.json: a[1] expected a finite number, got NaN"),
    ({"a": [1, True]}, {"a": [float]}, "f.json: a[1] expected a finite number, got true"),
    ({"a": [1.5]}, {"a": [int]}, "f.json: a[0] expected an integer, got 1.5"),
    ({"a": ["x", 2]}, {"a": [str]}, "f.json: a[1] expected a string, got 2"),
])
def test_check_shape_names_the_file_and_the_key(value, shape, message):
    with pytest.raises(stage.DataError, match=f"^{re.escape(message)}$"):
        fileio.check_shape(value, shape, "f.json")
    fileio.check_shape(value, None, "f.json")  # no shape: anything


def test_read_json_and_read_jsonl_check_the_required_shape(tmp_path):
    path = write({"generations": []}, tmp_path / "h.json")
    assert fileio.read_json(path, required=("generations",)) == {"generations": []}
    with pytest.raises(stage.DataError, match="h.json: missing key 'config'"):
        fileio.read_json(path, required=("config", "generations"))
    log = tmp_path / "episodes.jsonl"
    log.write_text('{"problem_id": "a", "sample_index": 0}\n{"problem_id": "a"}\n')
    with pytest.raises(stage.DataError, match=r"episodes.jsonl: row\[1\] missing key 'sample_index'"):
        fileio.read_jsonl(log, required=("problem_id", "sample_index"))


@pytest.mark.parametrize("path, message", [
    (("generations",), "missing key 'generations'"),
    (("config",), "missing key 'config'"),
    (("base_model",), "missing key 'base_model'"),
    (("generations", 1, "z"), r"generations\[1\] missing key 'z'"),
    (("generations", 0, "seeds"), r"generations\[0\] missing key 'seeds'"),
    (("config", "population"), "config missing key 'population'"),
])
def test_export_refuses_a_history_that_lacks_a_key_before_any_engine(tmp_path, path, message):
    bad = write(without(history(), *path), tmp_path / "es_history.json")
    with pytest.raises(stage.StageError, match=f"{bad}: {message}"):
        export_stage.main([f"--history={bad}", f"--out={tmp_path / 'export'}"])
    assert not (tmp_path / "export").exists() and not (tmp_path / "export.partial").exists()


def test_export_refuses_generations_that_are_not_a_list(tmp_path):
    bad = write(dict(history(), generations={"0": generation_record(0)}), tmp_path / "es_history.json")
    with pytest.raises(stage.StageError, match=f"{bad}: generations expected a list, got dict"):
        export_stage.main([f"--history={bad}", f"--out={tmp_path / 'export'}"])


def test_training_refuses_a_history_that_lacks_a_key_before_any_engine(tmp_path):
    bad = write(without(history(), "generations", 0, "rewards"), tmp_path / HISTORY_FILE)
    with pytest.raises(stage.StageError, match=rf"{bad}: generations\[0\] missing key 'rewards'"):
        train_stage.main(["--preset=smoke", f"--run_dir={tmp_path}"])


@pytest.mark.parametrize("path, message", [(("config",), "missing key 'config'"),
                                           (("generations", 0, "digests"), r"generations\[0\] missing key 'digests'")])
def test_evaluating_the_base_refuses_a_run_dir_history_that_lacks_a_key(tmp_path, path, message):
    """03_eval.py --export= takes the settings that define the base's digests from the run dir's history: that
    history is checked like every other stage's, before any engine starts."""
    bad = write(without(history(), *path), tmp_path / HISTORY_FILE)
    argv = ["--preset=smoke", f"--run_dir={tmp_path}"]
    with pytest.raises(stage.StageError, match=f"{bad}: {message}"):
        eval_stage.base_config(cli.parse_config(argv), argv)


def test_a_finished_history_without_timings_still_prints_its_summary(tmp_path, capsys):
    finished = history()
    for record in finished["generations"]:
        del record["timings"]
    write(finished, tmp_path / HISTORY_FILE)
    assert train_stage.main(["--preset=smoke", f"--run_dir={tmp_path}"]) == finished
    assert "rollout 0.00s" in capsys.readouterr().out


def test_the_generation_line_tells_the_population_wall_time_from_the_time_summed_over_members():
    record = {"generation": 4, "sigma": 1e-3, "rewards": [0.0, 0.5],
              "timings": {"members": 10.5, "rollout": 38.0, "perturb": 0.3, "restore": 0.2, "update": 0.1,
                          "digest": 0.2}, "scorer_failures": {"score_error": 0, "score_timeout": 0}}
    line = train_stage.summary_line(record, common.Config(generations=200))
    assert "generation 5/200" in line
    assert "members 10.5s wall" in line and "summed over members: rollout 38.0s" in line
    assert "scorer" not in line  # shown when it failed on an episode
    record["scorer_failures"]["score_timeout"] = 1
    line = train_stage.summary_line(record, common.Config(generations=200))
    assert line.endswith("|  scorer failed: score_error 0, score_timeout 1")


def test_an_export_manifest_that_lacks_a_key_is_refused(tmp_path):
    manifest = {"format": "es-sharded-export/1", "tensor_parallel_size": 2, "per_rank_digests": ["a", "b"],
                "parameter_names_sha256": "p", "replayed_generations": 2, "vllm_version": "v",
                "shards": [{"file": "model-rank-0-part-0.safetensors", "rank": 0, "sha256": "s"}]}
    write(without(manifest, "shards"), tmp_path / "a" / export.SHARDED_STATE_MANIFEST)
    with pytest.raises(stage.StageError, match=f"{export.SHARDED_STATE_MANIFEST}: missing key 'shards'"):
        export.verify(tmp_path / "a")
    write(without(manifest, "shards", 0, "sha256"), tmp_path / "b" / export.SHARDED_STATE_MANIFEST)
    with pytest.raises(stage.StageError, match=r"shards\[0\] missing key 'sha256'"):
        export.verify(tmp_path / "b", 2)
    hf_manifest = export.HUGGING_FACE_MANIFEST
    write({"format": "es-hf-export/1", "replayed_generations": 2}, tmp_path / "c" / hf_manifest)
    fileio.write_sha256sums(tmp_path / "c", [hf_manifest])  # intact files, a manifest without the digest
    with pytest.raises(stage.StageError, match=f"{hf_manifest}: missing key 'digest'"):
        export.verify(tmp_path / "c")


def evaluation(tmp_path, problems=2):
    """A finished 03_eval.py folder of the base model on the smoke problems, and its history beside it."""
    ids = [p["id"] for p in data.problems_from("smoke", SMOKE.run_seed)[:problems]]
    records = [{"problem_id": pid, "sample_index": i, "seed": common.request_seed(SMOKE.run_seed, pid, i, 0),
                "score": 0.0} for pid in ids for i in range(metrics.EVAL_SAMPLES)]
    eval16 = {"dataset": "dapo", "data": "smoke", "config": dataclasses.asdict(SMOKE), "records": records,
              "checkpoint": {"kind": "base", "model": SMOKE.model, "per_rank_digests": ["b0", "b1"]}}
    write(history(), tmp_path / HISTORY_FILE)
    write({"datasets": {"dapo": {}}}, tmp_path / "eval" / metrics.EVAL_METRICS)
    return eval16


@pytest.mark.parametrize("damage, message", [
    (lambda e: without(e, "records"), "dapo_eval16.json: missing key 'records'"),
    (lambda e: without(e, "checkpoint", "per_rank_digests"), "dapo_eval16.json: checkpoint missing key"),
    (lambda e: without(e, "records", 5, "seed"), r"dapo_eval16.json: records\[5\] missing key 'seed'"),
    (lambda e: dict(e, records=[r for r in e["records"] if r["sample_index"] != 13]),
     r"the evaluation of smoke has no records of \(problem, sample\)"),
])
def test_replay_refuses_eval_records_that_lack_a_key_before_any_engine(tmp_path, damage, message):
    write(damage(evaluation(tmp_path)), tmp_path / "eval" / "dapo_eval16.json")
    with pytest.raises(stage.StageError, match=message):
        replay_stage.main(["--preset=smoke", f"--run_dir={tmp_path}"])


def test_replay_refuses_metrics_or_transcripts_that_lack_a_key_before_any_engine(tmp_path):
    eval16 = evaluation(tmp_path)
    write(eval16, tmp_path / "eval" / "dapo_eval16.json")
    write({"dapo": {}}, tmp_path / "eval" / metrics.EVAL_METRICS)
    with pytest.raises(stage.StageError, match=f"{metrics.EVAL_METRICS}: missing key 'datasets'"):
        replay_stage.main(["--preset=smoke", f"--run_dir={tmp_path}"])
    write({"datasets": {"dapo": {}}}, tmp_path / "eval" / metrics.EVAL_METRICS)
    fileio.write_jsonl([{k: v for k, v in r.items() if k != "score"} for r in eval16["records"]],
                       tmp_path / "eval" / "dapo_episodes.jsonl")
    with pytest.raises(stage.StageError, match=r"dapo_episodes.jsonl: row\[0\] missing key 'messages'"):
        replay_stage.main(["--preset=smoke", f"--run_dir={tmp_path}"])
    write(without(history(), "generations", 0, "digests"), tmp_path / HISTORY_FILE)
    with pytest.raises(stage.StageError, match=rf"{HISTORY_FILE}: generations\[0\] missing key 'digests'"):
        replay_stage.main(["--preset=smoke", f"--run_dir={tmp_path}"])


def test_export_and_replay_refuse_a_history_of_another_base_before_any_engine(tmp_path, monkeypatch):
    """The base's weight files against the history's fingerprint: another base is refused by name before the
    engine starts (rebuilding compares the digests of the base too, once an engine holds it)."""
    base = tmp_path / "my-base"
    base.mkdir()
    (base / "model.safetensors").write_bytes(b"the base's weights")
    monkeypatch.setattr(models, "resolve_model", lambda name, *args, **kwargs: str(base))
    eval16 = evaluation(tmp_path)
    write(eval16, tmp_path / "eval" / "dapo_eval16.json")
    fileio.write_jsonl([dict(r, messages=[]) for r in eval16["records"]], tmp_path / "eval" / "dapo_episodes.jsonl")
    other = dict(history(), base_fingerprint="sha256:" + "0" * 64)
    write(other, tmp_path / HISTORY_FILE)
    for script, more in ((export_stage, [f"--out={tmp_path / 'export'}"]), (replay_stage, [])):
        with pytest.raises(stage.HistoryMismatch, match="base_fingerprint: history has 'sha256:000"):
            script.main(["--preset=smoke", f"--run_dir={tmp_path}", *more])
    assert not (tmp_path / "export").exists() and not (tmp_path / "export.partial").exists()
    write(dict(other, base_fingerprint=fileio.model_fingerprint(base)), tmp_path / HISTORY_FILE)  # the same base
    asked = []
    for script in (export_stage, replay_stage):
        monkeypatch.setattr(script, "EnginePool", lambda *args, **kwargs: asked.append(1) or 1 / 0)
    for script, more in ((export_stage, [f"--out={tmp_path / 'export'}"]), (replay_stage, [])):
        with pytest.raises(ZeroDivisionError):  # past the check: the stage asks for its engines
            script.main(["--preset=smoke", f"--run_dir={tmp_path}", *more])
    assert asked == [1, 1]


class PoolAsked(Exception):
    """Raised by a stand-in EnginePool once a stage has asked for its pool."""


@pytest.mark.parametrize("restore", ["patch --patch_capacity=0.3", "copy_host", "subtract"])
def test_export_evaluation_and_replay_ask_for_read_only_pools_under_any_restore_mode(tmp_path, monkeypatch, restore):
    """They never perturb: their pools hold no restore memory (perturbs=False), and the run's restore mode and patch
    capacity do not bind them (here a --restore=subtract run, whose training resume refuses an exact mode)."""
    asked = []

    def pool(cfg, model_path, **kwargs):
        asked.append((cfg.restore, kwargs.get("perturbs", True)))
        raise PoolAsked

    for stage in (export_stage, eval_stage, replay_stage):
        monkeypatch.setattr(stage, "EnginePool", pool)
    subtract = dict(history(), config=dataclasses.asdict(dataclasses.replace(SMOKE, restore="subtract")))
    eval16 = evaluation(tmp_path)
    write(subtract, tmp_path / HISTORY_FILE)
    write(eval16, tmp_path / "eval" / "dapo_eval16.json")
    argv = ["--preset=smoke", f"--run_dir={tmp_path}", *f"--restore={restore}".split()]
    for stage, more in ((export_stage, [f"--out={tmp_path / 'export'}"]), (eval_stage, ["--export=", f"--out={tmp_path / 'base'}"]),
                        (replay_stage, [])):
        with pytest.raises(PoolAsked):
            stage.main(argv + more)
    mode = restore.split()[0]
    assert asked == [(mode, False)] * 3


def written_export(folder, noise: str) -> dict:
    """An export folder as export.save leaves it for a run of this noise kind (stand-in bytes for the weights, a
    manifest written by export.write_manifest); returns the manifest."""
    folder.mkdir(parents=True)
    identity = {"config": dataclasses.asdict(dataclasses.replace(SMOKE, noise=noise)), "tensor_parallel_size": 2,
                "parameter_names_sha256": "layout", "devices": [], "base_model": SMOKE.model,
                "base_fingerprint": "sha256:base", "device_type": "cpu", "vllm_version": "v", "torch_version": "t"}
    if noise == "checkpoint":
        (folder / "model.safetensors").write_bytes(b"weights")
        weights = export.hugging_face_fields(identity, ["ckpt:trained"], {"model.norm.weight": 1}, {})
    else:
        for rank in range(2):
            (folder / f"model-rank-{rank}-part-0.safetensors").write_bytes(b"shard %d" % rank)
        weights = export.sharded_state_fields(folder, identity, ["rank0-trained", "rank1-trained"])
    write(history(), folder.parent / HISTORY_FILE)
    return export.write_manifest(folder, export.provenance(history(), folder.parent / HISTORY_FILE, []), identity,
                                 weights)


class LoadedExport:
    """A stand-in for engines that loaded an export: its digests and parameter layout."""

    def __init__(self, digests, layout="layout"):
        self.loaded, self.layout = digests, layout

    def digests(self):
        return self.loaded

    def parameter_names_sha256(self):
        return self.layout


@pytest.mark.parametrize("noise", settings.NOISE_MODES)
def test_the_evaluation_loads_an_export_in_its_format_and_checks_its_bits_in_its_noise(tmp_path, monkeypatch, noise):
    """03_eval.py starts its engines on an export as its format loads (sharded_state: vLLM's load format, the
    tokenizer beside the shards; a Hugging Face folder: as any model), with the noise whose digests its manifest
    records; loaded engines whose bits or layout differ from the manifest's are refused."""
    folder = tmp_path / "export"
    manifest = written_export(folder, noise)
    asked = []

    def pool(cfg, model_path, **kwargs):
        asked.append((cfg.noise, model_path, kwargs))
        raise PoolAsked

    monkeypatch.setattr(eval_stage, "EnginePool", pool)
    with pytest.raises(PoolAsked):
        eval_stage.main(["--preset=smoke", f"--run_dir={tmp_path / 'run'}", f"--export={folder}"])
    sharded_state = {} if noise == "checkpoint" else {"load_format": "sharded_state", "tokenizer": str(folder)}
    assert asked == [(noise, str(folder), {**sharded_state, "perturbs": False})]
    assert export.manifest_file(folder).name == ("es_export_manifest.json" if noise == "checkpoint"
                                                 else "es_sharded_export_manifest.json")

    trained = ["ckpt:trained"] if noise == "checkpoint" else ["rank0-trained", "rank1-trained"]
    assert export.check_loaded(LoadedExport(trained), folder, manifest) == trained
    with pytest.raises(stage.ExportError, match="loaded digests .* differ from the manifest's"):
        export.check_loaded(LoadedExport(["other"] * len(trained)), folder, manifest)
    if noise == "rank_salted":
        with pytest.raises(stage.ExportError, match="lays out the model's parameters differently"):
            export.check_loaded(LoadedExport(trained, layout="another vLLM's"), folder, manifest)


# ---- the data an evaluation and a replay run on: identified by content (sha256), not by path ----

def problems_file(path, problems):
    fileio.write_jsonl(problems, path)
    return path


def test_an_evaluation_resumes_only_on_the_data_it_began_with_and_an_older_marker_by_its_paths(tmp_path, monkeypatch,
                                                                                                capsys):
    """03_eval keeps the finished episodes of its --out folder: a data file changed at the same path since then is
    refused before any engine starts, naming the file; a marker written before markers recorded the sha256s is
    compared by its paths, as before, and says so."""
    smoke = data.problems_from("smoke", SMOKE.run_seed)
    dapo = problems_file(tmp_path / "dapo.jsonl", smoke[:4])
    out = tmp_path / "eval"
    argv = ["--preset=smoke", "--export=", f"--out={out}", f"--run_dir={tmp_path / 'run'}", f"--dapo={dapo}",
            f"--aime2026={dapo}"]
    marker = {"checkpoint": {"kind": "base"}, "config": {}, "data": {"dapo": str(dapo), "aime2026": str(dapo)},
              "data_sha256": {"dapo": fileio.sha256_file(dapo), "aime2026": fileio.sha256_file(dapo)}}
    write(marker, out / "eval_run.json")
    problems_file(dapo, [dict(smoke[0], answer="changed"), *smoke[1:4]])  # the same path, other data
    message = (f"{dapo}: sha256 {fileio.sha256_file(dapo)} differs from the {marker['data_sha256']['dapo']} that "
               f"{out / 'eval_run.json'} recorded for dapo: the data changed since this evaluation began")
    with pytest.raises(stage.DataError, match=re.escape(message)):
        eval_stage.main(argv)
    assert json.loads((out / "eval_run.json").read_text()) == marker  # nothing touched

    def pool(*args, **kwargs):
        raise PoolAsked

    monkeypatch.setattr(eval_stage, "EnginePool", pool)
    write(without(marker, "data_sha256"), out / "eval_run.json")  # an older marker: the paths only
    capsys.readouterr()
    with pytest.raises(PoolAsked):  # accepted: the paths are the same
        eval_stage.main(argv)
    assert "records its data by path only" in capsys.readouterr().out


def test_a_replay_runs_only_on_the_data_its_evaluation_used_and_an_older_eval16_on_its_path(tmp_path, monkeypatch,
                                                                                             capsys):
    """04_replay re-runs the reported group on the data named in the eval16 files: a file changed at the same path
    (its sha256 not the recorded one), or generated problems of another version, are refused before any engine
    starts, naming the data; an eval16 file written before they recorded the sha256 takes the data by its path and
    says so."""
    eval16 = evaluation(tmp_path)
    dapo = problems_file(tmp_path / "dapo.jsonl", data.problems_from("smoke", SMOKE.run_seed)[:4])
    recorded = dict(eval16, data=str(dapo), data_sha256=fileio.sha256_file(dapo))
    write(recorded, tmp_path / "eval" / "dapo_eval16.json")
    with open(dapo, "a") as f:
        f.write(json.dumps({"id": "new", "question": "1+1?", "answer": "2"}) + "\n")  # every evaluated id still there
    message = (f"{dapo}: sha256 {fileio.sha256_file(dapo)} differs from the {recorded['data_sha256']} that "
               f"{tmp_path / 'eval' / 'dapo_eval16.json'} recorded: the data changed since the evaluation")
    with pytest.raises(stage.DataError, match=re.escape(message)):
        replay_stage.main(["--preset=smoke", f"--run_dir={tmp_path}"])
    write(dict(eval16, data_sha256="smoke 0123"), tmp_path / "eval" / "dapo_eval16.json")
    with pytest.raises(stage.DataError, match="^smoke: sha256 smoke [0-9a-f]{64} differs from the smoke 0123"):
        replay_stage.main(["--preset=smoke", f"--run_dir={tmp_path}"])

    def pool(*args, **kwargs):
        raise PoolAsked

    monkeypatch.setattr(replay_stage, "EnginePool", pool)
    write(dict(eval16, data_sha256=data.problems_sha256("smoke", SMOKE.run_seed)), tmp_path / "eval" /
          "dapo_eval16.json")
    with pytest.raises(PoolAsked):  # the same generated problems
        replay_stage.main(["--preset=smoke", f"--run_dir={tmp_path}"])
    write(dict(eval16, data=str(dapo)), tmp_path / "eval" / "dapo_eval16.json")  # older: the path only
    capsys.readouterr()
    with pytest.raises(PoolAsked):
        replay_stage.main(["--preset=smoke", f"--run_dir={tmp_path}"])
    assert f"records its data by path only (written before data sha256s): {dapo} is taken by its path" in \
        capsys.readouterr().out


# ---- the reward's definition: an evaluation resumes, and a replay compares, only under the one that scored it ----

def test_a_replay_refuses_an_evaluation_scored_under_another_reward_definition(tmp_path, monkeypatch, capsys):
    """04_replay scores under this code's reward definition (common.reward_definition): an eval16 file that
    recorded another is refused before any engine starts, naming both values; one written before eval16 files
    recorded it is compared under this code's scorer on the agent's score, saying so, and refused on the shaped
    reward (its rules changed at 097270a)."""
    eval16 = evaluation(tmp_path)
    current = common.reward_definition("agent")
    other = dict(current, agent_score="agentic_es/scoring.py sha256:" + "0" * 64)
    write(dict(eval16, reward=other), tmp_path / "eval" / "dapo_eval16.json")
    message = (f"{tmp_path / 'eval' / 'dapo_eval16.json'} was scored under another reward definition: reward "
               f"agent_score: the evaluation has {other['agent_score']!r}, this code has {current['agent_score']!r}")
    with pytest.raises(stage.ConfigError, match=re.escape(message)):
        replay_stage.main(["--preset=smoke", f"--run_dir={tmp_path}"])

    def pool(*args, **kwargs):
        raise PoolAsked

    monkeypatch.setattr(replay_stage, "EnginePool", pool)
    write(dict(eval16, reward=current), tmp_path / "eval" / "dapo_eval16.json")
    with pytest.raises(PoolAsked):  # the same definition
        replay_stage.main(["--preset=smoke", f"--run_dir={tmp_path}"])
    write(eval16, tmp_path / "eval" / "dapo_eval16.json")  # older: none recorded
    capsys.readouterr()
    with pytest.raises(PoolAsked):
        replay_stage.main(["--preset=smoke", f"--run_dir={tmp_path}"])
    assert "records no reward definition (written before they were recorded): its scores are compared with this " \
           "code's" in capsys.readouterr().out
    shaped = dict(eval16, config=dict(eval16["config"], fitness="shaped"))
    write(shaped, tmp_path / "eval" / "dapo_eval16.json")
    with pytest.raises(stage.ConfigError, match="records no reward definition .* the shaped reward's rules changed"):
        replay_stage.main(["--preset=smoke", f"--run_dir={tmp_path}"])


def test_an_evaluation_resumes_only_under_the_reward_definition_that_scored_its_episodes(tmp_path, monkeypatch):
    """03_eval's marker records the reward definition its kept episodes were scored under: a resume under another
    is refused before any engine starts, naming both values; a marker written before markers recorded it resumes."""
    smoke = data.problems_from("smoke", SMOKE.run_seed)
    dapo = problems_file(tmp_path / "dapo.jsonl", smoke[:4])
    out = tmp_path / "eval"
    argv = ["--preset=smoke", "--export=", f"--out={out}", f"--run_dir={tmp_path / 'run'}", f"--dapo={dapo}",
            f"--aime2026={dapo}"]
    current = common.reward_definition("agent")
    marker = {"checkpoint": {"kind": "base"}, "config": {}, "data": {"dapo": str(dapo), "aime2026": str(dapo)},
              "data_sha256": {"dapo": fileio.sha256_file(dapo), "aime2026": fileio.sha256_file(dapo)},
              "reward": dict(current, agent_score="agentic_es/scoring.py sha256:" + "0" * 64)}
    write(marker, out / "eval_run.json")
    with pytest.raises(stage.ConfigError, match=re.escape(
            f"{out} holds episodes scored under another reward definition: reward agent_score: eval_run.json has "
            f"{marker['reward']['agent_score']!r}, this evaluation has {current['agent_score']!r}")):
        eval_stage.main(argv)

    def pool(*args, **kwargs):
        raise PoolAsked

    monkeypatch.setattr(eval_stage, "EnginePool", pool)
    for accepted in (dict(marker, reward=current), without(marker, "reward")):
        write(accepted, out / "eval_run.json")
        with pytest.raises(PoolAsked):
            eval_stage.main(argv)


# ---- the tier of the learn task: an evaluation of a run's weights is of the tier it trained on ----

def test_an_evaluation_of_a_learn_run_is_of_the_tier_it_trained_on(tmp_path, monkeypatch):
    """03_eval evaluates an export of a learn run (its manifest's config), or the base model in a run folder whose
    history trained on the learn task, on the tier the run trained on; an explicit --learn_digits of another tier is
    refused before any engine starts, naming both values and the file that recorded the run's."""
    strict = cli.parse_config(["--preset=strict", "--population=4"])  # learn_digits=4; history()'s members
    trained = dict(history(), config=dataclasses.asdict(strict), base_model=strict.model)
    folder = tmp_path / "run" / "export"
    folder.mkdir(parents=True)
    for rank in range(2):
        (folder / f"model-rank-{rank}-part-0.safetensors").write_bytes(b"shard %d" % rank)
    identity = {"config": trained["config"], "tensor_parallel_size": 2, "parameter_names_sha256": "layout",
                "devices": [], "base_model": strict.model, "base_fingerprint": "sha256:base", "device_type": "cpu",
                "vllm_version": "v", "torch_version": "t"}
    write(trained, tmp_path / "run" / HISTORY_FILE)
    export.write_manifest(folder, export.provenance(trained, tmp_path / "run" / HISTORY_FILE, []), identity,
                          export.sharded_state_fields(folder, identity, ["r0", "r1"]))
    manifest = export.manifest_file(folder)
    argv = ["--preset=learn", f"--model={strict.model}", "--tensor_parallel_size=2", f"--run_dir={tmp_path / 'run'}"]
    with pytest.raises(stage.ConfigError, match=re.escape(
            f"--learn_digits=3 (the run's is learn_digits=4, recorded in {manifest})")):
        eval_stage.main([*argv, "--learn_digits=3", f"--export={folder}"])
    with pytest.raises(stage.ConfigError, match=re.escape(
            f"--learn_digits=3 (the run's is learn_digits=4, recorded in {tmp_path / 'run' / HISTORY_FILE})")):
        eval_stage.main([*argv, "--learn_digits=3", "--export=", f"--out={tmp_path / 'base'}"])

    def pool(cfg, *args, **kwargs):
        assert cfg.learn_digits == 4  # the sets are those of the tier it trained on
        raise PoolAsked

    monkeypatch.setattr(eval_stage, "EnginePool", pool)
    for tier in ([], ["--learn_digits=4"]):  # the tier it trained on, named or not
        for more in ([f"--export={folder}"], ["--export=", f"--out={tmp_path / 'base'}"]):
            with pytest.raises(PoolAsked):
                eval_stage.main([*argv, *tier, *more])