"""A Lightning training script as its users write one: a `LightningModule` whose
`configure_optimizers` returns AdamW and a per-step scheduler, `Trainer.fit`,
`trainer.save_checkpoint`, and a second `fit` that resumes from it (`ckpt_path=`) at
an epoch's end (Lightning restarts a resumed epoch's data from its first batch).
`--stage N` trains with `DeepSpeedStrategy(stage=N)`; 0 trains with Lightning's DDP.
Tiny model, data made here. Writes the final weights (safetensors) and each step's lr
and loss (JSON).

Lightning's DeepSpeed strategy refuses any accelerator but CUDA in `setup_environment`;
the CPU subclass here drops only that check (everything else is Lightning's own).
`devices=2` on CPU: Lightning starts the second process itself, so the script calls
`fzero.compat.install()` before Lightning imports `deepspeed`."""

import argparse
import json

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--stage", type=int, default=0)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--save_at", type=int, default=0, help="stop here, save, resume")
parser.add_argument("--out", required=True)
parser.add_argument("--deepspeed_itself", action="store_true", help="not fzero's (reference)")
ARGS = parser.parse_args()
if ARGS.stage and not ARGS.deepspeed_itself:
    import fzero.compat

    fzero.compat.install()

import lightning as L  # noqa: E402 - after `deepspeed` is fzero's
from lightning.fabric.utilities.seed import reset_seed  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy  # noqa: E402
from safetensors.torch import save_file  # noqa: E402


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """DeepSpeedStrategy minus its two CUDA checks (the accelerator's type, and that
    device indices equal local ranks: CPU devices have no index), and with an index on
    its CPU device (DeepSpeed's engine compares `args.device_rank` with 0)."""

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu", 0)

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
        self.record: list[dict] = []

    def training_step(self, batch, _index):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        self.record.append({"step": self.global_step, "lr": lr, "loss": loss.item()})
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-2, weight_decay=0.01)
        warm_decay = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / 3) * 0.8**s
        )  # a new lr every step: a resume that restarts or skips the schedule shows
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": warm_decay, "interval": "step"},
        }


def loader() -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(24, 8, generator=gen)  # 3 steps an epoch on 2 ranks
    data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
    return torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)


def trainer(steps: int) -> L.Trainer:
    strategy = (
        CPUDeepSpeedStrategy(stage=ARGS.stage, process_group_backend="gloo")
        if ARGS.stage
        else DDPStrategy(process_group_backend="gloo")
    )
    return L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, precision="32-true",
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, gradient_clip_val=0.0,
    )  # fmt: skip


def full_weights(model: Model) -> dict[str, torch.Tensor]:
    """Every rank gathers (ZeRO-3 shards them); rank 0 writes."""
    if ARGS.stage == 3:
        from deepspeed import zero

        with zero.GatheredParameters(list(model.parameters())):
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def main() -> None:
    L.seed_everything(0, verbose=False)
    model = Model()
    if ARGS.save_at:
        first = trainer(ARGS.save_at)
        first.fit(model, loader())
        first.save_checkpoint(f"{ARGS.out}.ckpt")
        at_save = full_weights(model)
        if ARGS.stage and not ARGS.deepspeed_itself and first.global_rank == 0:
            # the checkpoint's weights, converted
            save_file(at_save, f"{ARGS.out}.at_save.safetensors")
            from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

            convert_zero_checkpoint_to_fp32_state_dict(f"{ARGS.out}.ckpt", f"{ARGS.out}.fp32")
        record = model.record
        model = Model()  # a fresh process's model: everything comes from the checkpoint
        last = trainer(ARGS.steps)
        last.fit(model, loader(), ckpt_path=f"{ARGS.out}.ckpt")
        model.record = record + model.record
    else:
        last = trainer(ARGS.steps)
        last.fit(model, loader())
    weights = full_weights(model)
    if last.global_rank == 0:
        save_file(weights, f"{ARGS.out}.safetensors")
        with open(f"{ARGS.out}.json", "w") as f:
            json.dump(model.record, f)
    # Without this a gloo process may abort at interpreter teardown ("terminate called
    # without an active exception"): torch's advice.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
