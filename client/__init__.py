"""maskd_client: what a GPU inference worker imports to use maskd.

Depends on grpcio, protobuf and numpy (torch where tensors are used); never on Ray
or a grammar engine.
"""
from maskd_client.client import (MaskClient, MaskClientError, SeqResult, SeqStatus, ServerInfo, StepInput,
                                 StepResult)

__all__ = ["MaskClient", "MaskClientError", "SeqResult", "SeqStatus", "ServerInfo", "StepInput", "StepResult",
           "apply_token_bitmask_inplace", "BitmaskBuffers"]


def __getattr__(name):
    if name in ("apply_token_bitmask_inplace", "BitmaskBuffers"):
        from maskd_client import apply
        return getattr(apply, name)
    raise AttributeError(name)
