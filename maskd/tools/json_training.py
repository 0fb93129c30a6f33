"""The tiny Llama, trained briefly on real JSON: a model whose choices mean something for drafts.

    maskd tiny-model --out .cache/tiny-llama-deepseek-json --train-json ../shared/maskbench-dev

A random-weight model picks among the tokens a grammar allows at random, so the share of grammar
drafts it accepts says nothing about a real model (which writes the tokenizer's own tokenization of
JSON: ``{"`` rather than ``{`` then ``"``). This trains the tiny model (``tiny_model.build``) for a
few minutes on two CPU cores on the valid instances of the MaskBench files of the *train half*
(every other file by name, ``train_files``; benchmarks measure on the other half), written as
compact JSON, one document after another with EOS between. Nothing is downloaded.

Training uses a softmax over the corpus's own tokens (a few thousand of the 129,280): the output
layer is the tied embedding, so this is the full model on a restricted output set, ~10x cheaper per
step on a CPU; other tokens keep their random embeddings and lose to the trained ones. The model is
saved in bf16 safetensors like the random one, with its recipe (``maskd-recipe.json``): the same
recipe on the same corpus is not trained again.
"""
from __future__ import annotations

import hashlib
import json
import pathlib
import shutil
import time
from typing import Any

from maskd.tools.tiny_model import RECIPE_FILE, build


def train_files(data_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """The MaskBench files whose valid instances the model is trained on: every other file by name
    (the rest are held out for measurements)."""
    return sorted(pathlib.Path(data_dir).glob("*.json"))[0::2]


def held_out_files(data_dir: str | pathlib.Path) -> list[pathlib.Path]:
    return sorted(pathlib.Path(data_dir).glob("*.json"))[1::2]


def held_out_schemas(data_dir: str | pathlib.Path, n: int, max_chars: int = 4000) -> list[dict]:
    """``n`` schemas of the held-out half spread over it (object schemas of at most ``max_chars``
    characters of JSON): what measurements with the trained model write for."""
    out = []
    for path in held_out_files(data_dir):
        schema = json.loads(path.read_text(encoding="utf-8"))["schema"]
        if isinstance(schema, dict) and len(json.dumps(schema)) < max_chars:
            out.append(schema)
    step = max(1, len(out) // max(1, n))
    return out[::step][:n]


def corpus(files: list[pathlib.Path]) -> list[str]:
    """Compact JSON text of every valid instance in ``files``."""
    docs = []
    for path in files:
        for test in json.loads(path.read_text(encoding="utf-8")).get("tests", []):
            if test.get("valid"):
                docs.append(json.dumps(test["data"], separators=(",", ":"), ensure_ascii=False))
    return docs


def train(out: str | pathlib.Path, data_dir: str | pathlib.Path, *, base: pathlib.Path | None = None,
          steps: int = 300, seq_len: int = 256, batch: int = 8, lr: float = 2e-3, seed: int = 0,
          log: Any = print) -> pathlib.Path:
    """Writes the trained model to ``out`` (unless the same recipe is there) and returns its path.
    ``base``: the random tiny model to start from (built next to ``out`` when not given)."""
    import torch
    import transformers

    from maskd.tools.demo import hf_tokenizer

    out = pathlib.Path(out)
    files = train_files(data_dir)
    if not files:
        raise FileNotFoundError(f"no MaskBench files (*.json) in {data_dir}")
    docs = corpus(files)
    digest = hashlib.sha256("\n".join(docs).encode()).hexdigest()[:16]
    base = base or build(out.with_name(out.name + ".base"), seed=seed)
    want = {**json.loads((base / RECIPE_FILE).read_text()), "trained_on": f"maskbench train half, {len(files)} files",
            "corpus_sha256": digest, "steps": steps, "seq_len": seq_len, "batch": batch, "lr": lr}
    marker = out / RECIPE_FILE
    if marker.exists() and json.loads(marker.read_text()) == want:
        return out
    tok = hf_tokenizer()
    ids: list[int] = []
    for d in docs:
        ids += tok.encode(d, add_special_tokens=False) + [tok.eos_token_id]
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    model.train()
    vocab = torch.tensor(sorted(set(ids)))
    remap = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    remap[vocab] = torch.arange(len(vocab))
    stream = torch.tensor(ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)
    log(f"training on {len(docs)} documents ({len(ids)} tokens, {len(vocab)} distinct) for {steps} steps")
    began = time.monotonic()
    for step in range(steps):
        starts = torch.randint(0, len(stream) - seq_len - 1, (batch,))
        x = torch.stack([stream[s:s + seq_len] for s in starts])
        y = torch.stack([stream[s + 1:s + seq_len + 1] for s in starts])
        hidden = model.model(input_ids=x).last_hidden_state
        logits = hidden @ model.lm_head.weight[vocab].T
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, len(vocab)), remap[y].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"step {step}: loss {loss.item():.3f} ({time.monotonic() - began:.0f} s)")
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base, tmp)
    model.to(torch.bfloat16).eval().save_pretrained(tmp, safe_serialization=True)
    (tmp / RECIPE_FILE).write_text(json.dumps(want, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
