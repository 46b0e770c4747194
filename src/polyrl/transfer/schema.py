"""The manifest of a weight version as data: which tensor lies where in the flat buffer.

Pydantic only, no torch, so the processes that serve and receive versions
(`transfer/serve.py`, `transfer/pull_proc.py`) start without importing it;
`transfer/manifest.py` packs and unpacks the buffers with torch.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

ALIGN_BYTES = 64  # every tensor starts on a 64-byte boundary (safe for any dtype and SIMD copies)

ITEMSIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "uint8": 1}
"""The dtypes a version may hold (torch's names), with their sizes in bytes."""
_Size = Annotated[int, Field(ge=0, lt=2**63)]


class TensorEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    dtype: str
    shape: list[_Size]
    offset: _Size
    nbytes: _Size

    @property
    def itemsize(self) -> int:
        return ITEMSIZES.get(self.dtype, 1)


class Manifest(BaseModel):
    """Checked whole when parsed (it comes over the network): every entry has a known
    dtype, matches its shape, starts aligned to its dtype and lies inside the buffer, so
    `unflatten` cannot fail halfway through a version."""

    model_config = ConfigDict(extra="forbid")
    version: int
    total_bytes: _Size
    tensors: list[TensorEntry]

    @model_validator(mode="after")
    def _entries_fit(self) -> Manifest:
        names = set()
        for e in self.tensors:
            itemsize = ITEMSIZES.get(e.dtype)
            if itemsize is None:
                raise ValueError(f"{e.name}: unknown dtype {e.dtype!r}")
            misaligned = e.offset % itemsize != 0  # a view of another dtype needs it
            if e.nbytes != itemsize * numel(e.shape) or misaligned or e.offset + e.nbytes > self.total_bytes:
                raise ValueError(f"{e.name}: entry does not fit its shape or the buffer")
            if e.name in names:
                raise ValueError(f"{e.name}: named twice")
            names.add(e.name)
        return self


def numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
