"""Draws the concept page's pictures from real plans (`partition.plot_plan`), so they show
what fzero computes, not what someone drew:

    python docs/_hooks/pictures.py     # writes docs/images/plan_*.png (needs matplotlib)
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from fzero import partition

IMAGES = Path(__file__).resolve().parent.parent / "images"


def model() -> nn.Module:
    """A small model of three blocks: an embedding, two MLP blocks and a head."""
    return nn.Sequential(
        nn.Embedding(96, 32),
        nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)),
        nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)),
        nn.Linear(32, 96),
    )


def main() -> None:
    manifest = partition.describe(model())
    pictures = {
        f"plan_stage{stage}.png": partition.plan(manifest, world_size=4, stage=stage)
        for stage in (1, 2, 3)
    }
    pictures["plan_whole_tensors.png"] = partition.plan(
        manifest, world_size=4, stage=3, strategy=partition.whole_tensors
    )
    mesh = partition.Mesh({"node": 2, "local": 2})
    pictures["plan_mics.png"] = partition.mesh_plan(manifest, mesh, "mics")
    IMAGES.mkdir(exist_ok=True)
    for name, plan in pictures.items():
        (IMAGES / name).write_bytes(partition.plot_plan(plan))
        print(IMAGES / name)


if __name__ == "__main__":
    main()
