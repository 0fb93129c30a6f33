"""Host time of apply_packed_token_bitmask_inplace with list indices behind ~0.1 s of queued GPU
work: a call that synchronized would take the 0.1 s. Run on a GPU machine:
python3 docs/benchmarks/scripts/gpu_apply_waits.py [OTHER_APPLY_PY ...] (other versions of
client/apply.py to compare, each loaded from its file)."""
import importlib.util
import pathlib
import sys
import time

import torch


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


HERE = pathlib.Path(__file__).resolve().parents[3] / "client" / "apply.py"
for name, path in [(p, p) for p in sys.argv[1:]] + [("client/apply.py", str(HERE))]:
    m = load(path, "apply_" + str(abs(hash(name))))
    lg = torch.randn(256, 129280, device="cuda", dtype=torch.bfloat16)
    bm = torch.zeros((128, 4040), dtype=torch.int32, device="cuda")
    idx = list(range(0, 256, 2))
    m.apply_packed_token_bitmask_inplace(lg, bm, idx)
    torch.cuda.synchronize()
    hosts = []
    for _ in range(5):
        torch.cuda._sleep(200_000_000)
        t = time.perf_counter()
        m.apply_packed_token_bitmask_inplace(lg, bm, idx)
        hosts.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
    t = time.perf_counter()
    torch.cuda._sleep(200_000_000)
    torch.cuda.synchronize()
    sleep_ms = (time.perf_counter() - t) * 1e3
    print(f"{name}: host ms per call behind {sleep_ms:.0f} ms of queued GPU work:", [round(h, 3) for h in hosts], flush=True)
