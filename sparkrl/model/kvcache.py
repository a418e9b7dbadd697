"""The ragged KV cache: a separate committed length per sequence. A forward appends T new tokens per sequence
*speculatively* (written after the committed length, under any boolean mask among the new tokens, e.g. a draft
tree); `commit` then keeps a chosen subset of them and everything else is dropped (a rollback is a commit of
nothing). Finished sequences leave the batch with `keep_rows`."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    """Every layer's K/V in one buffer (2, L, B, H_kv, capacity, D) and a committed length per sequence.

    Positions >= `lengths[b]` are the speculative region: forwards append to it (`pending` grows) and may
    attend to what earlier forwards put there (a draft tree built level by level). One buffer lets a commit
    move the kept tokens of every layer in one gather and one copy instead of two per layer
    (docs/experiments/kv-cache.md); `k[i]` and `v[i]` are views of it.
    """

    kv: torch.Tensor  # (2, L, B, H_kv, capacity, D), contiguous; after `keep_rows` a view of the first B rows
    lengths: torch.Tensor  # (B,) int64, committed tokens per sequence
    pending: int = 0  # speculative tokens written after lengths[b] by forwards since the last commit

    def __post_init__(self):
        assert self.kv.is_contiguous(), "KVCache: a contiguous buffer"
        self.store = self.kv  # the whole buffer, of which kv holds the first B rows
        self._views()

    def _views(self) -> None:
        # per layer (B, H_kv, capacity, D), contiguous; one `select` each (unbind's views may not be written to)
        L = self.kv.shape[1]
        self.k, self.v = [self.kv[0, i] for i in range(L)], [self.kv[1, i] for i in range(L)]

    @classmethod
    def empty(cls, args, batch: int, capacity: int, device, dtype) -> "KVCache":
        shape = (2, args.num_layers, batch, args.num_kv_heads, capacity, args.head_dim)
        return cls(
            kv=torch.zeros(shape, device=device, dtype=dtype),
            lengths=torch.zeros(batch, dtype=torch.long, device=device),
        )

    def clone(self) -> "KVCache":
        return KVCache(self.kv.clone(memory_format=torch.contiguous_format), self.lengths.clone(), self.pending)

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self.kv.shape[4]

    def commit(self, keep: torch.Tensor | None = None, n_keep: torch.Tensor | None = None) -> None:
        """Make speculative tokens permanent and drop the rest of the speculative region.

        keep: (B, K) indices into the speculative region (0-based, ascending), of which the first
        `n_keep[b]` are kept for sequence b; the kept tokens are moved to consecutive positions.
        With keep=None the first n_keep[b] speculative tokens are kept where they are (a chain).
        """
        if keep is not None and keep.shape[1] > 0:
            base = self.lengths[:, None]
            src = self.rows(base + keep)
            dst = self.rows(base + torch.arange(keep.shape[1], device=keep.device))
            # rows of the whole buffer viewed as (2L * B' * H_kv * capacity, D): one gather and one copy on a
            # contiguous 2-D tensor (gathering along the merged rows of the strided view `keep_rows` leaves takes
            # a slow path: a 6-row tree round 4x as long)
            flat = self.store.view(-1, self.kv.shape[-1])
            per = flat.shape[0] // (2 * self.kv.shape[1])  # rows of one layer's K or V
            offsets = torch.arange(0, flat.shape[0], per, device=keep.device)[:, None]
            flat.index_copy_(0, (offsets + dst).flatten(), flat.index_select(0, (offsets + src).flatten()))
        self.lengths = self.lengths + n_keep
        self.pending = 0

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        """(B * H_kv * T,) indices into a layer's buffer viewed as (B * H_kv * capacity, D) rows, of the
        cache positions slots (B, T), in (b, head, t) order. K/V are written and moved with index_copy_
        on these rows: a bfloat16 `scatter_` along the position dimension costs time in proportion to the
        whole buffer (docs/experiments/kv-cache.md)."""
        B, T = slots.shape
        H = self.kv.shape[3]
        seq = torch.arange(B * H, device=slots.device).view(B, H, 1) * self.capacity
        return (seq + slots[:, None, :]).flatten()

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (B, H_kv, T, D) at the rows `rows(slots)` of one layer."""
        D = k.shape[-1]
        self.k[layer].view(-1, D).index_copy_(0, rows, k.reshape(-1, D))
        self.v[layer].view(-1, D).index_copy_(0, rows, v.reshape(-1, D))

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the sequences `rows` (1-D indices), in that order; drops the others.

        Finished responses leaving the batch (rows ascending, fewer than before): each kept sequence moves
        down to its new row in place, those before the first dropped one stay where they are, and the cache
        keeps a view of its first rows (copying the whole cache into new buffers at every drop costs 9% of a
        64-response rollout: docs/experiments/kv-cache.md). Any other selection (a prompt's rows repeated
        for its group) gathers into a new buffer."""
        idx = rows.tolist()
        if len(idx) < self.batch and all(a < b for a, b in zip(idx, idx[1:])):
            for i, r in enumerate(idx):  # r >= i: no source is written before it is read
                if i != r:
                    self.kv[:, :, i].copy_(self.kv[:, :, r])
            self.kv = self.kv[:, :, : len(idx)]
        else:
            self.kv = self.store = self.kv.index_select(2, rows)
        self._views()
        self.lengths = self.lengths.index_select(0, rows)
