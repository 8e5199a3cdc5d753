"""Qwen3-30B-A3B's shape without its weights: a folder with its config.json, for vLLM's load_format="dummy"
(random weights of the real layout). The real weights cannot be fetched on the GPU machine."""

import json
import shutil
from pathlib import Path

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
