"""Expert routes on the wire: which experts each position of a sample went through in a
mixture-of-experts model, for routing replay (R3, `algo.router_replay`).

Rows are positions of prompt + completion, each `moe_layers * k` expert ids; a sample of
P prompt tokens and C completion tokens has P + C - 1 of them (the last token is never
fed). On the wire they travel as SGLang sends `meta_info.routed_experts`: the base64 of
little-endian int32s, row after row; a reader who knows the row count knows the width.
"""

from __future__ import annotations

import base64

import numpy as np


def encode_routes(rows: np.ndarray) -> str:
    """[rows, ...] integer array -> base64 of its int32s."""
    return base64.b64encode(np.ascontiguousarray(rows, dtype="<i4").tobytes()).decode("ascii")


def decode_routes(text: str, num_rows: int) -> np.ndarray:
    """The inverse, as [num_rows, width] int32. ValueError: the bytes do not split into
    `num_rows` rows."""
    flat = np.frombuffer(base64.b64decode(text, validate=True), dtype="<i4")
    if num_rows < 0 or (num_rows == 0 and flat.size) or (num_rows and flat.size % num_rows):
        raise ValueError(f"{flat.size} expert ids do not make {num_rows} rows")
    return flat.reshape(num_rows, -1 if num_rows else 0).astype(np.int32)


def rows_through(prompt_tokens: int, num_tokens: int) -> int:
    """Positions with routes once `num_tokens` tokens have been generated after a prompt of
    `prompt_tokens`: every position but the newest token's (none before the first)."""
    return prompt_tokens + num_tokens - 1 if num_tokens else 0
