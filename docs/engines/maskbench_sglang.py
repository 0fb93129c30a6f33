"""MaskBench through SGLang's grammar-backend registry (maskd) next to in-process llguidance.

    VLLM_TARGET_DEVICE=cpu .venv-engines/bin/python docs/engines/maskbench_sglang.py ../shared/maskbench-dev

Starts a maskd server (deepseek-v4, llguidance) on a free loopback port, builds SGLang's backend
from its registry and drives every MaskBench instance through SGLang's batch mask path
(``update_regex_vocab_mask``, batches of 64), then runs the same check on llguidance in process.
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "engines"))

from maskd.server import MaskServer, ServerConfig  # noqa: E402
from maskd.server.tokenizers import load_tokenizer  # noqa: E402
from maskd_tools import conformance  # noqa: E402


def main() -> None:
    data = sys.argv[1] if len(sys.argv) > 1 else "../shared/maskbench-dev"
    suite = conformance.load_suite(data)
    server = MaskServer(ServerConfig(port=0, tokenizer="deepseek-v4", threads=2)).start()
    try:
        os.environ["MASKD_TARGET"] = server.address
        from sglang_drive import backend_from_registry, run_conformance
        tok = load_tokenizer("deepseek-v4")
        backend = backend_from_registry(tok.ll.vocab_size, tok.eos_token_ids)
        via = run_conformance(backend, tok, suite, batch=64)
        via["maskd_steps"] = backend.steps
        via["server_compiles"] = server.cache.compiles
        backend.shutdown()
    finally:
        server.stop(grace=0.5)
    local = conformance.run_in_process("deepseek-v4", suite)
    for report in (via, local):
        print(conformance.summary_line(report))
    print(json.dumps({"sglang_maskd_steps": via["maskd_steps"], "server_compiles": via["server_compiles"],
                      "false_rejects": [(x["file"], x["test"]) for x in via["false_rejects"]]}))


if __name__ == "__main__":
    main()
