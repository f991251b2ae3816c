"""Uneven inputs (DDP's `Join`) for an engine: ranks may run different numbers of
micro-steps inside `engine.join()`. A rank that leaves the block keeps serving the others'
gradient reductions and steps with zero gradients until every rank has left, so the
result is a run where a rank out of data contributes nothing (gradients are still
averaged over the whole world, as DDP's default). Each micro-step's first forward inside
costs one one-element all-reduce (who still trains). The loop must be forward, backward,
`step()` per micro-step. At stage 3 the others' forward and backward gather parameters,
so a rank that has left runs `replay()` — one forward through the engine returning a
loss, e.g. on its last batch — and a backward of it weighted 0: the same gathers in the
same order (a model whose program does not depend on its data), no contribution."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import Tensor

from fzero.engine._reduction import GradientReduction

__all__ = ["Join"]


class Join:
    """An engine's join state: `flagged` is None outside the block, else the micro-step
    whose "still training" flag this rank sent (-1: none yet)."""

    def __init__(self, reduction: GradientReduction, stage: int) -> None:
        self.reduction, self.stage = reduction, stage
        self.flagged: int | None = None

    def forward(self, micro_step: int) -> None:
        """A forward starts: inside the block, this rank says (once per micro-step) that it
        still trains (collective)."""
        if self.flagged is not None and self.flagged != micro_step:
            self.flagged = micro_step
            self.reduction.still_training(True)

    @contextlib.contextmanager
    def block(
        self,
        replay: Callable[[], Tensor] | None,
        *,
        serve: Callable[[], None],
        backward: Callable[[Tensor], Tensor],
        step: Callable[[], None],
        micro_step: Callable[[], int],
    ) -> Iterator[None]:
        """The `join()` block; after it, out of data, serve the others' micro-steps
        (`serve`: a backward's reductions with zero gradients; stage 3: `replay()`
        through `backward` weighted 0) and `step` until no rank trains."""
        if self.stage == 3 and replay is None:
            raise NotImplementedError(
                "engine.join() at ZeRO stage 3 needs replay=: a function running one "
                "forward through the engine and returning its loss (e.g. on the rank's last "
                "batch), which a rank out of data runs, weighted 0, to serve the others' "
                "all-gathers; or give every rank the same number of micro-batches"
            )
        if self.flagged is not None:
            raise RuntimeError("engine.join() is already active; it cannot be re-entered")
        self.flagged = -1
        try:
            yield
            while self.reduction.still_training(False):  # out of data: serve the others
                if replay is None:
                    serve()
                else:  # stage 3: the others' gathers, by the same program
                    self.flagged = micro_step()  # this micro-step's flag is sent
                    backward(replay() * 0.0)
                step()
        finally:
            self.flagged = None
