"""Tokens per verification step from forced drafts alone, for documents written the tokenizer's way.

    .venv/bin/python docs/benchmarks/scripts/forced_drafts_replay.py

The server's drafter (maskd.server.drafts.DraftModel, nothing learned) proposes 4 drafts at each
step of eight random valid documents of the real-engine tests' ACCOUNT schema (compact JSON,
deepseek-v4); the "model" writes the document's own tokenization, so a step keeps the drafts that
agree with it plus one token. No engine, no model: an upper bound for a model that writes JSON the
way the tokenizer does, and a lower bound for drafts once counts are learned.
"""
import json
import random

from maskd.server.drafts import DraftModel
from maskd.server.engines import create_engine
from maskd.server.tokenizers import load_tokenizer
from maskd.specs import GrammarSpec
from maskd.tools.bench.vllm_workloads import ACCOUNT

tok = load_tokenizer("deepseek-v4")
engine = create_engine("llguidance", tok, threads=1)
grammar = engine.compile(GrammarSpec.from_dict({"json_schema": ACCOUNT, "whitespace": "compact"}))
drafter = DraftModel()
for n in range(8):
    rng = random.Random(n)
    doc = {"id": rng.randint(0, 999), "status": rng.choice(["active", "inactive", "pending"]),
           "verified": rng.random() < 0.5, "role": rng.choice(["administrator", "user", "guest"]),
           "country": rng.choice(["France", "Germany", "Japan"]),
           "plan": rng.choice(["free", "professional", "enterprise"])}
    tokens = tok.encode(json.dumps(doc, separators=(",", ":")))
    matcher = engine.new_matcher(grammar)
    at = steps = 0
    while at < len(tokens):
        drafts = drafter.propose("account", matcher, tokens[max(0, at - 2):at], 4).drafts
        kept = 0
        for d, t in zip(drafts, tokens[at:]):
            if d != t:
                break
            kept += 1
        took = tokens[at:at + kept + 1]
        assert matcher.consume(took) is None
        at += len(took)
        steps += 1
    print(f"document {n}: {len(tokens)} tokens in {steps} steps: {len(tokens) / steps:.2f} tokens per step")
