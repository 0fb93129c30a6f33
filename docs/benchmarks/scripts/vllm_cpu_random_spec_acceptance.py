"""vLLM 0.32's CPU engine under random sampling accepts speculative drafts at the first draft position only.

    .venv-vllm/bin/python docs/benchmarks/scripts/vllm_cpu_random_spec_acceptance.py

No maskd in it: vLLM's own guidance backend and its n-gram drafts on a regex that forces every token
("(maskd rocks ){8}", the prompt repeats it, so the n-gram drafts are the forced tokens). Greedy, the
drafts are accepted at every position; at temperature 0.8, where the masked distribution at a forced
position is one token with probability 1, the acceptance counter per position stays where greedy left
it for positions 1-3. Prints vLLM's accepted-tokens-per-position counters after each temperature.
"""
import pathlib
import sys
import tempfile
import urllib.request

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parents[3] / "tests" / "vllm_engine")]
from harness import ENGINE_OPTIONS, vllm_engine  # noqa: E402

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'

with tempfile.TemporaryDirectory() as logs, \
        vllm_engine(pathlib.Path(logs), *ENGINE_OPTIONS, "--speculative-config", NGRAM, name="ngram") as engine:
    for temperature in (0.0, 0.8):
        for _ in range(3):
            engine.post({"prompt": "maskd rocks maskd rocks maskd rocks", "max_tokens": 64,
                         "temperature": temperature, "structured_outputs": {"regex": "(maskd rocks ){8}"}})
        text = urllib.request.urlopen(engine.url + "/metrics").read().decode()
        per_position = [line.split("position=")[1] for line in text.splitlines()
                        if "accepted_tokens_per_pos_total" in line and not line.startswith("#")]
        print(f"temperature {temperature}: accepted per position {per_position}; steps with drafts "
              f"{engine.metric('vllm:spec_decode_num_drafts_total'):.0f}, drafts "
              f"{engine.metric('vllm:spec_decode_num_draft_tokens_total'):.0f}")
