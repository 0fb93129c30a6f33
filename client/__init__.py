"""maskd_client: what a GPU inference worker imports to use maskd.

Depends on grpcio, protobuf and numpy (torch where tensors are used); never on Ray
or a grammar engine.
"""
from maskd_client.client import (MaskClient, MaskClientError, SeqResult, SeqStatus, ServerInfo, StepInput,
                                 StepResult)

__all__ = ["MaskClient", "MaskClientError", "SeqResult", "SeqStatus", "ServerInfo", "StepInput", "StepResult",
           "apply_token_bitmask_inplace", "BitmaskBuffers", "ClusterClient"]


def __getattr__(name):
    if name in ("apply_token_bitmask_inplace", "BitmaskBuffers"):
        from maskd_client import apply
        return getattr(apply, name)
    if name in ("MaskdLogitsProcessor", "MaskdSequenceFailed"):  # needs transformers: imported on use
        from maskd_client import hf
        return getattr(hf, name)
    if name == "ClusterClient":  # cluster mode: MaskClient("directory:HOST:PORT") returns one
        from maskd_client.cluster import ClusterClient
        return ClusterClient
    raise AttributeError(name)
