"""What fzero's collectives move, by the group they ran on and by operation, and the
process subgroups of a mesh (`fzero.comm` re-exports both; this module holds the
counters so that `comm` stays one screenful per concern)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["count", "labels", "mesh_group", "traffic", "traffic_by_group"]


_traffic: dict[tuple[str, str], list[int]] = {}  # (group's axes, operation) -> [calls, bytes]
labels: dict[Any, str] = {}  # a mesh subgroup -> the axes it runs along ("local")


def count(operation: str, tensor: torch.Tensor, group: Any = None) -> None:
    label = "world" if group is None else labels.get(group, "other")
    entry = _traffic.setdefault((label, operation), [0, 0])
    entry[0] += 1
    entry[1] += tensor.numel() * tensor.element_size()


def traffic() -> dict[str, tuple[int, int]]:
    """The collectives fzero has issued in this process, by operation (`all_gather`,
    `reduce_scatter`, `all_reduce`, `all_to_all`): (calls, bytes), a collective's bytes
    being its whole buffer (an all-gather's output, a reduce-scatter's or an
    all-to-all's input, an all-reduce's tensor), as
    `fzero.partition.comm_volume` predicts them. Differences of two calls give a span."""
    total: dict[str, tuple[int, int]] = {}
    for (_, name), (calls, size) in _traffic.items():
        before = total.get(name, (0, 0))
        total[name] = (before[0] + calls, before[1] + size)
    return total


def traffic_by_group() -> dict[str, dict[str, tuple[int, int]]]:
    """`traffic()` by the group each collective ran on: "world" for every process, a mesh
    subgroup by its axes joined with "+" ("local", "node+local"; `mesh_group`)."""
    found: dict[str, dict[str, tuple[int, int]]] = {}
    for (label, name), (calls, size) in _traffic.items():
        found.setdefault(label, {})[name] = (calls, size)
    return found


_mesh_groups: dict[tuple[Any, ...], Any] = {}


def mesh_group(axes: tuple[tuple[str, int], ...], along: tuple[str, ...]) -> Any:
    """This process's subgroup along the axes `along` of the mesh `axes` (names and
    sizes, row-major, as `fzero.partition.Mesh`): None (the default group) when it is
    every process. Collective on first use for a pair: every process creates every
    group along `along`, in one order (`Mesh.groups`). Its collectives are counted under
    `"+".join(along)` (`traffic_by_group`)."""
    from fzero.partition import Mesh  # pure data, below this module

    mesh = Mesh(axes)
    mesh.check_world(dist.get_world_size() if dist.is_initialized() else 1)
    key = (mesh.axes, tuple(along))
    if key not in _mesh_groups:
        mine = None
        members = mesh.groups(tuple(along))
        if len(members) > 1 or len(members[0]) != mesh.size:
            for ranks in members:
                group = dist.new_group(list(ranks))
                if dist.get_rank() in ranks:
                    mine = group
            labels[mine] = "+".join(along) or "self"
        _mesh_groups[key] = mine
    return _mesh_groups[key]


def forget() -> None:
    """Drop the counts and the mesh subgroups of destroyed process groups
    (`comm.forget_process_groups`)."""
    _traffic.clear()
    labels.clear()
    _mesh_groups.clear()
