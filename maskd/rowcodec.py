"""Mask rows on the wire: encoder (server) and decoder (client), numpy only.

Both ends of a stream hold one RowEncoder / RowDecoder; the decoder always yields the
dense int32 rows (n_rows, words_per_row), whatever the encoding on the wire.
"""
from __future__ import annotations

import numpy as np

from maskd.v1 import maskd_pb2 as pb

DENSE = pb.ROW_ENCODING_DENSE


class RowCodecError(ValueError):
    """A reply whose rows cannot be decoded (corrupt or from a mismatched server)."""


class RowEncoder:
    """Encodes the rows of one stream. This version sends dense words."""

    def __init__(self, words_per_row: int, width: int) -> None:
        self.words_per_row = words_per_row
        self.width = width

    def encode(self, rows: np.ndarray, reply: pb.StepResponse) -> list[int]:
        """Appends one MaskRow per row to reply.rows; returns the bytes per row sent."""
        add = reply.rows.add
        sizes = []
        for row in rows:
            data = row.tobytes()
            add(data=data)
            sizes.append(len(data))
        return sizes


class RowDecoder:
    def __init__(self, words_per_row: int, width: int) -> None:
        self.words_per_row = words_per_row
        self.width = width

    def decode(self, reply: pb.StepResponse, out: np.ndarray | None = None) -> np.ndarray:
        n = len(reply.rows)
        if out is None:
            out = np.empty((n, self.words_per_row), dtype=np.int32)
        row_bytes = self.words_per_row * 4
        for i, row in enumerate(reply.rows):
            if row.encoding != DENSE:
                raise RowCodecError(f"row {i}: encoding {row.encoding} is not supported by this client")
            if len(row.data) != row_bytes:
                raise RowCodecError(f"row {i}: {len(row.data)} bytes, expected {row_bytes}")
            out[i] = np.frombuffer(row.data, dtype=np.int32)
        return out
