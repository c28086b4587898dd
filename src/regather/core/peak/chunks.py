"""How LoRA's full-width work is cut into row chunks, so no full-width LoRA buffer exists at once.

A LoRA adapter's full-width tensors — its output before it is added to the base's, its input-gradient
contribution before it is added to the base's — are made one row chunk at a time into one buffer and
added in place (:mod:`.output`, :mod:`.junction`). The chunk rule, for a full-width tensor of ``total``
bytes over ``rows`` rows (tokens):

``min(MAX_CHUNKS, total // MIN_CHUNK_BYTES)`` equal chunks (at least one), that is:

* at most :data:`MAX_CHUNKS` (8), so at long context a chunk is ``total / 8`` (the peak goal: what LoRA
  keeps + ``W/4``, docs/design.md §3.7);
* none under :data:`MIN_CHUNK_BYTES` (16 MiB; ``REGATHER_MIN_CHUNK_BYTES`` overrides it), so each
  chunk's GEMM stays large enough for a GPU: 16 MiB of Qwen3-8B's fc1 output at TP2 (12,288 bf16
  columns) is 683 rows, a [683, r] x [r, 12288] GEMM of 6 x 96 tiles of 128 x 128 — over four waves on
  an H100's 132 SMs. A tensor under two minimum chunks is made in one piece (it is small in bytes).

fc1 of Qwen3-8B at TP2, bf16: 201 MB at 8k tokens, eight chunks of 25 MB; 25 MB at 1k tokens, one piece.
"""

from __future__ import annotations

import os

#: No more chunks than this: one chunk is at most 1/8 of the full-width tensor.
MAX_CHUNKS = 8
#: No chunk smaller than this many bytes (``REGATHER_MIN_CHUNK_BYTES`` overrides it, read per call).
MIN_CHUNK_BYTES = 16 << 20
_ENV = "REGATHER_MIN_CHUNK_BYTES"


def min_chunk_bytes() -> int:
    """:data:`MIN_CHUNK_BYTES`, or the environment's ``REGATHER_MIN_CHUNK_BYTES`` (a clear error if it is not
    a positive integer)."""
    value = os.environ.get(_ENV)
    if value is None:
        return MIN_CHUNK_BYTES
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n <= 0:
        raise ValueError(f"{_ENV} must be a positive number of bytes, got {value!r}")
    return n


def chunk_count(total_bytes: int, rows: int) -> int:
    """How many chunks the rule gives for ``total_bytes`` over ``rows`` rows (module doc)."""
    if rows <= 1:
        return 1
    return max(1, min(MAX_CHUNKS, rows, total_bytes // min_chunk_bytes()))


def row_chunks(rows: int, row_bytes: int) -> list[slice]:
    """Consecutive row slices covering ``range(rows)`` by the rule (equal sizes, the last one smaller)."""
    if rows <= 0:
        return []
    n = chunk_count(rows * row_bytes, rows)
    step = -(-rows // n)
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]
