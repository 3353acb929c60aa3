"""Exact streaming top-k over columns of a matrix that arrives in row chunks.

Trigger examples need, for every memory (column), the k positions (rows) with the largest
coefficient over a whole corpus. The corpus's coefficient matrix ``[T, M]`` is never built: each
chunk ``[N, M]`` is merged into a running ``[M, k]`` state and dropped.

Order: value descending, ties broken by the smaller position. To make ``torch.topk`` exact under
ties each entry gets a unique int64 key: the float32 bits mapped to an order-preserving integer
in the high 32 bits, ``2**32 - 1 - position`` in the low 32 bits. ``topk_reference`` is the
obvious full-matrix stable sort, kept for the tests.
"""

from __future__ import annotations

import torch

__all__ = ["StreamingTopK", "topk_reference"]

_LOW = (1 << 32) - 1


def _order_keys(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Unique int64 keys whose order is (value desc, position asc) when sorted descending.

    values: float32 ``[..., N]``; positions: int64 broadcastable to it, in ``[0, 2**32)``.
    """
    bits = (values + 0.0).contiguous().view(torch.int32).to(torch.int64)  # +0.0 folds -0.0
    # Negative floats: flipping the 31 magnitude bits makes the integer order the float order.
    monotone = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (monotone << 32) | (_LOW - positions)


class StreamingTopK:
    """Running top-k per column over row chunks; exact, ties to the earlier position.

    Args:
        columns: M, the number of columns (memories).
        k: how many rows to keep per column.
    """

    def __init__(self, columns: int, k: int) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if columns < 1:
            raise ValueError(f"columns must be >= 1, got {columns}")
        self.k = k
        self.columns = columns
        self.rows_seen = 0
        self._keys = torch.empty(columns, 0, dtype=torch.int64)
        self._values = torch.empty(columns, 0, dtype=torch.float32)

    def update(self, chunk: torch.Tensor, positions: torch.Tensor) -> None:
        """Merge a chunk.

        chunk: ``[N, M]`` values (converted to float32); positions: ``[N]`` int64 global row ids,
        each seen once over the stream, in ``[0, 2**32)``.
        """
        if chunk.dim() != 2 or chunk.shape[1] != self.columns:
            raise ValueError(f"chunk must be [N, {self.columns}], got {list(chunk.shape)}")
        if positions.shape != chunk.shape[:1]:
            raise ValueError("positions must have one entry per chunk row")
        if chunk.shape[0] == 0:
            return
        chunk = chunk.detach().to(torch.float32)
        positions = positions.to(torch.int64)[None, :]
        # amax propagates NaN, so one pass both rejects NaN and finds each column's best value.
        best = chunk.amax(dim=0)  # [M]
        if torch.isnan(best).any():
            raise ValueError("chunk contains NaN")
        self.rows_seen += chunk.shape[0]
        if self._keys.shape[1] < self.k:
            self._merge(slice(None), chunk.T.contiguous(), positions)
            return
        # Full state: only columns with a value >= their current k-th best can change (ties may
        # still win on position, hence >=).
        columns = (best >= self._values[:, -1]).nonzero().flatten()
        if len(columns):
            self._merge(columns, chunk[:, columns].T.contiguous(), positions)

    def _merge(self, columns: slice | torch.Tensor, values: torch.Tensor,
               positions: torch.Tensor) -> None:
        """Merge ``values`` [C, N] of the selected state columns into the state."""
        if values.shape[1] > self.k:
            values, keys = self._chunk_topk(values, positions)
        else:
            keys = _order_keys(values, positions)
        keys = torch.cat([self._keys[columns], keys], dim=1)
        values = torch.cat([self._values[columns], values], dim=1)
        keys, index = keys.topk(min(self.k, keys.shape[1]), dim=1)
        values = values.gather(1, index)
        if isinstance(columns, slice):
            self._keys, self._values = keys, values
        else:
            self._keys[columns], self._values[columns] = keys, values

    def _chunk_topk(self, values: torch.Tensor, positions: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact top-k of each row of ``values`` [C, N > k]: ``(values, keys)`` [C, k].

        A float top-k finds the k-th value; where exactly k entries are >= it, that set is the
        answer whatever the tie order. Rows with ties across the k-th place take the key path.
        """
        top, index = values.topk(self.k, dim=1)
        keys = _order_keys(top, positions[0][index])
        tied = ((values >= top[:, -1:]).sum(dim=1) > self.k).nonzero().flatten()
        if len(tied):
            exact, exact_index = _order_keys(values[tied], positions).topk(self.k, dim=1)
            keys[tied] = exact
            top[tied] = values[tied].gather(1, exact_index)
        return top, keys

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values [M, k'], positions [M, k'])``, best first; ``k' = min(k, rows seen)``."""
        return self._values.clone(), _LOW - (self._keys & _LOW)


def topk_reference(matrix: torch.Tensor, positions: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-matrix reference: stable sort of each column by value desc, ties by position asc.

    matrix: ``[T, M]``; positions: ``[T]``. Returns ``(values [M, k'], positions [M, k'])``.
    """
    order = torch.argsort(positions, stable=True)
    values = matrix.to(torch.float32)[order].T  # [M, T], rows by ascending position
    sorted_values, index = torch.sort(values, dim=1, descending=True, stable=True)
    take = min(k, matrix.shape[0])
    return sorted_values[:, :take], positions[order][index[:, :take]]
