"""Qwen3-30B-A3B's shape without its weights: a folder with its config.json, for vLLM's load_format="dummy"
(random weights of the real layout). The real weights cannot be fetched on the GPU machine."""

import json
import math
import os
import shutil
from pathlib import Path

import torch

QWEN3_30B_A3B = {  # the published config.json of Qwen/Qwen3-30B-A3B
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "torch_dtype": "bfloat16",
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 40960, "max_window_layers": 48, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "decoder_sparse_step": 1,
    "norm_topk_prob": True, "mlp_only_layers": [], "output_router_logits": False, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "use_sliding_window": False, "use_cache": True, "initializer_range": 0.02,
    "bos_token_id": 151643, "eos_token_id": 151645,
}


def write_config(folder, tokenizer_from=None, layers: int = 0) -> str:
    """config.json of Qwen3-30B-A3B in `folder`. With tokenizer_from (a tiny model folder), its tokenizer files are
    copied in and the vocabulary is cut to the tokenizer's size (the agent loop needs a chat template; the real
    tokenizer is not available offline). That removes ~0.3B embedding/lm_head parameters, ~2% of the model.
    layers: keep only the first `layers` decoder layers (0: all 48)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(QWEN3_30B_A3B)
    if layers:  # the same layer shapes, fewer of them (co-location measurements on one GPU)
        config.update(num_hidden_layers=layers, max_window_layers=layers)
    if tokenizer_from is not None:
        for f in Path(tokenizer_from).iterdir():
            if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
                shutil.copy2(f, folder / f.name)
        tiny = json.loads((Path(tokenizer_from) / "config.json").read_text())
        config.update(vocab_size=tiny["vocab_size"], bos_token_id=None, eos_token_id=tiny["eos_token_id"])
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return str(folder)


def checkpoint_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The tensor names and shapes of a Qwen3-MoE checkpoint on the Hub (per-expert projections, untied head)."""
    h, heads, kv, d = (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
                       config["head_dim"])
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], h), "model.norm.weight": (h,),
              "lm_head.weight": (config["vocab_size"], h)}
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        shapes.update({layer + "input_layernorm.weight": (h,), layer + "post_attention_layernorm.weight": (h,),
                       layer + "self_attn.q_proj.weight": (heads * d, h), layer + "self_attn.k_proj.weight": (kv * d, h),
                       layer + "self_attn.v_proj.weight": (kv * d, h), layer + "self_attn.o_proj.weight": (h, heads * d),
                       layer + "self_attn.q_norm.weight": (d,), layer + "self_attn.k_norm.weight": (d,),
                       layer + "mlp.gate.weight": (config["num_experts"], h)})
        for e in range(config["num_experts"]):
            expert, inner = f"{layer}mlp.experts.{e}.", config["moe_intermediate_size"]
            shapes.update({expert + "gate_proj.weight": (inner, h), expert + "up_proj.weight": (inner, h),
                           expert + "down_proj.weight": (h, inner)})
    return shapes


def write_random_checkpoint(folder, seed: int = 0, shard_bytes: int = 4 << 30) -> str:
    """Random bf16 safetensors for the config.json in `folder` (write_config first), N(0, 0.02) with norms at 1.
    Checkpoint noise reads the checkpoint's tensors, so load_format="dummy" will not do for it. Made on the GPU
    when there is one."""
    from safetensors.torch import save_file

    folder = Path(folder)
    shapes = checkpoint_shapes(json.loads((folder / "config.json").read_text()))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(seed)
    shard, size, index = {}, 0, {}
    for i, (name, shape) in enumerate(shapes.items()):
        if name.endswith("norm.weight"):
            shard[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            w = torch.randn(shape, generator=generator, device=device, dtype=torch.float32) * 0.02
            shard[name] = w.to(torch.bfloat16).cpu()
        size += math.prod(shape) * 2
        if size >= shard_bytes or i == len(shapes) - 1:
            file = f"model-{len(set(index.values())) + 1:05d}.safetensors"
            save_file(shard, str(folder / file), metadata={"format": "pt"})
            index.update({n: file for n in shard})
            shard, size = {}, 0
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return str(folder)


NORMAL_STD = 0.02  # the initializer_range of the config: what write_random_checkpoint draws


def allow_normal_weights() -> None:
    """normal_weights travels to the workers by value (a function, not a worker method): vLLM must allow pickling."""
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"


def normal_weights(worker, std: float, seed: int) -> int:
    """Run in each worker (engine.rpc(normal_weights, ...)): every ES parameter redrawn N(0, std), norms 1, as
    write_random_checkpoint writes them. vLLM's dummy weights (uniform in +-1e-3, below the noise) would make an
    exact restore by subtraction miss far more often than trained weights do. An exact-restore copy already taken
    is made the new weights' copy. Returns the elements redrawn."""
    device = worker.es_params[0][1].device
    g = torch.Generator(device=device).manual_seed(seed + worker.es_rank)
    for name, t in worker.es_params:
        flat = t.view(-1)
        if name.endswith("norm.weight"):
            flat.fill_(1.0)
            continue
        for start in range(0, flat.numel(), 1 << 26):
            piece = flat[start:start + (1 << 26)]
            piece.copy_(torch.randn(piece.numel(), generator=g, device=device) * std)
    for (_, t), saved in zip(worker.es_params, worker.es_copy or []):
        saved.copy_(t)
    return sum(t.numel() for _, t in worker.es_params)
