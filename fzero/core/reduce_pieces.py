"""A large unit's gradient reduced in pieces of `reduce_bucket_size` elements.

DeepSpeed's `zero_optimization.reduce_bucket_size` is the number of elements reduced at
a time. A bucket holds consecutive units up to that size, and a unit larger than it is
a bucket of its own (`fzero.partition.reduction_buckets`). Reduced as one collective,
such a unit needs fp32 copies of its whole gradient: the bucket that backward fills,
and beside it (`overlap_comm`) the one still being reduced. Then at stages 2-3 with
the gradients on NVMe come the host buffers that write this rank's part. For Llama 3
8B's embedding at world 2 that is 2.1 GB per fp32 copy and 1.05 GB per write buffer.

[Note: gradients reduced in pieces]

A unit at stages 2-3 with even shards whose gradient part on this rank
(`Plan.grads_size`) is larger than the piece (`reduction_piece`) is reduced in pieces
instead:

- its bucket buffer holds the gradients as they arrive, in their dtype (bf16 under bf16
  compute: half the fp32 copy, the same values); a unit of one tensor (an embedding, an
  output layer) needs no buffer: its pieces are read from the gradient autograd made;
- piece k takes elements [k*p, (k+1)*p) of every rank's part, widened to the wire dtype
  into one buffer of world x p elements, and reduces it as a bucket is (gloo: an
  all-reduce, each rank keeping its part; else a reduce-scatter), then over the
  replicas (MiCS/HSDP);
- this rank's piece goes to `keep(part, at)` at offset `at` of its part, in order:
  into the in-memory accumulator, or read, added and written at that offset of the swap
  file, with the norm's float64 sum carried from piece to piece (`update.grad_stats`'s
  `into`);
- at most two pieces are in flight. Each unit whose gradients complete later in
  backward moves the chain on by one piece (`advance`: at points every rank reaches in
  the same order, so the ranks' collectives pair), and the end of backward finishes it.

Every element is summed by the same collective operation as in the whole unit's bucket,
so at world 2 the kept gradient and the clipping norm are bitwise those of a whole-unit
reduction. The piece is `reduce_bucket_size` elements over the ranks, rounded down to a
multiple of 2^20 per rank, at least 2^20: each piece starts on a 4 KiB boundary of the
swap file and on a chunk of the norm's float64 sum. Units with uneven shards (their
parts travel to their owners at their sizes), qgZ's quantized reductions and the ZeRO-1
reduction at the accumulation boundary reduce whole units, as before.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from fzero import comm
from fzero.core.reduce_bucket import scatter_by_all_reduce
from fzero.partition import Plan

__all__ = ["PIECE_ALIGN", "Pieces", "reduction_piece"]

PIECE_ALIGN = 1 << 20  # elements: the norm's float64 chunk, a multiple of 4 KiB in fp32
_IN_FLIGHT = 2


def reduction_piece(plan: Plan, bucket_numel: int) -> int:
    """Elements of each rank's part a piece reduces ([Note: gradients reduced in pieces]):
    `bucket_numel` (`reduce_bucket_size`) over the gradients' group, rounded down to a
    multiple of 2^20, at least 2^20."""
    world = max(plan.grads_world_size, 1)
    return max(PIECE_ALIGN, bucket_numel // world // PIECE_ALIGN * PIECE_ALIGN)


class Pieces:
    """One unit's gradient reduced piece by piece ([Note: gradients reduced in pieces]).

    `source`: the unit's gradient (its bucket buffer, or the one tensor's gradient, the
    rest of the unit zeros; None: a unit this pass did not use, reduced as zeros);
    `starts`: where each rank's part of it starts (in the gradients' group's rank order)
    and `size` its elements; `rank`: this process's index there; `keep(part, at)`: this
    rank's averaged fp32 piece at offset `at` of its part. Starts the first pieces at
    once; `advance` and `wait` move it on."""

    def __init__(
        self,
        source: Tensor | None,
        starts: Sequence[int],
        size: int,
        piece: int,
        keep: Callable[[Tensor, int], None],
        *,
        rank: int,
        group: Any,
        replicas: Any,
        wire_dtype: torch.dtype,
        device: torch.device,
        what: str,
    ) -> None:
        self.source, self.starts, self.size, self.piece = source, list(starts), size, piece
        self.keep, self.rank, self.group, self.replicas = keep, rank, group, replicas
        self.wire_dtype, self.device, self.what = wire_dtype, device, what
        self.world = len(self.starts)
        self.next = 0  # offset in the part of the next piece to launch
        self.flight: deque[tuple[Any, Tensor, int, Tensor]] = deque()
        while len(self.flight) < _IN_FLIGHT and self.next < self.size:
            self._launch()

    def _launch(self) -> None:
        at = self.next
        n = min(self.piece, self.size - at)
        self.next += n
        send = torch.empty(self.world * n, dtype=self.wire_dtype, device=self.device)
        held = 0 if self.source is None else self.source.numel()
        for r, start in enumerate(self.starts):
            row = send[r * n : (r + 1) * n]
            given = max(0, min(n, held - start - at))  # past a tensor's end: padding
            row[:given].copy_(self.source[start + at : start + at + given])
            row[given:].zero_()
        what = f"{self.what} (elements {at}-{at + n} of each part)"
        if self.world == 1:
            self.flight.append((None, send, at, send))
        elif scatter_by_all_reduce():  # gloo: an all-reduce, each keeping its part
            work = comm.all_reduce(send, op="avg", async_op=True, what=what, group=self.group)
            mine = send[self.rank * n : (self.rank + 1) * n]
            self.flight.append((work, mine, at, send))
        else:
            mine = torch.empty(n, dtype=self.wire_dtype, device=self.device)
            work = comm.reduce_scatter_into(mine, send, async_op=True, what=what, group=self.group)
            self.flight.append((work, mine, at, send))

    def advance(self, block: bool = False) -> None:
        """Keep the oldest piece in flight (waiting for it) and launch the next one; with
        `block`, every piece (then the chain is done). Called where every rank calls it
        in the same order (`Reduction.launch_ready`: a unit's gradients complete), never
        on whether a piece has landed: the ranks' collectives must pair in order."""
        while self.flight:
            work, mine, at, _send = self.flight.popleft()
            if work is not None:
                work.wait()
            if self.replicas is not None:
                what = f"{self.what} across replicas"
                comm.all_reduce(mine, op="avg", group=self.replicas, what=what)
            self.keep(mine if mine.dtype == torch.float32 else mine.float(), at)
            del mine, _send
            if self.next < self.size:
                self._launch()
            if not block:
                return
        self.source = None

    @property
    def done(self) -> bool:
        return not self.flight

    def wait(self) -> None:
        """Finish every piece (`reduce.finish` waits on this as on a collective)."""
        self.advance(block=True)
