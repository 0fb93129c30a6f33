"""maskd_client: what a GPU inference worker imports to use maskd.

Depends on grpcio, protobuf and numpy (torch where tensors are used); never on Ray or a grammar
engine. Modules, one concern each: ``types`` (inputs, results, errors), ``connection`` (channel,
TLS, credentials), ``ledger`` (sequence history, undo, restores), ``stream`` (one Session stream),
``core`` (what both clients share: steps, closes, recovery), ``client`` (MaskClient),
``routing`` and ``cluster`` (ClusterClient), ``protocol`` (the API as a type), ``apply``
(bitmasks on logits), ``health`` (is a server there, and if not, why), engine adapters: ``hf``
(transformers), ``sglang`` (a grammar backend named ``maskd``, registered on import), ``vllm``
(logits processors).
"""
from maskd_client.client import MaskClient
from maskd_client.protocol import MaskdClient
from maskd_client.types import MaskClientError, SeqResult, SeqStatus, ServerInfo, StepInput, StepResult

__all__ = ["BitmaskBuffers", "ClusterClient", "MaskClient", "MaskClientError", "MaskdClient", "SeqResult",
           "SeqStatus", "ServerInfo", "StepInput", "StepResult", "apply_packed_token_bitmask_inplace",
           "apply_token_bitmask_inplace"]


def __getattr__(name: str):
    if name in ("apply_token_bitmask_inplace", "apply_packed_token_bitmask_inplace", "BitmaskBuffers"):
        # needs torch: imported on use
        from maskd_client import apply
        return getattr(apply, name)
    if name in ("MaskdLogitsProcessor", "MaskdSequenceFailed"):      # needs transformers: imported on use
        from maskd_client import hf
        return getattr(hf, name)
    if name == "ClusterClient":
        from maskd_client.cluster import ClusterClient
        return ClusterClient
    raise AttributeError(name)
