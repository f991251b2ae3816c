"""A model bigger than a rank's share: Transformers' `from_pretrained` under ZeRO-3 at
world 2, memory at each stage against the plan, fzero beside DeepSpeed, losses against a
plain unsharded run of the same weights.

    python benchmarks/big_model.py [--size small|probe] [--precisions fp32,bf16,bf16-states]
                                   [--systems fzero,deepspeed,plain] [--steps 3] [--dir DIR]

The model is Llama-shaped (`--size small`: 125M parameters; `probe`: 551M, the shape the
issue's probe used), its checkpoint generated here shard by shard from a `LlamaConfig`
(never whole in memory, nothing downloaded) and saved as `save_pretrained` saves one:
fp32 safetensors shards of `--shard` bytes (500MB) with `model.safetensors.index.json`.

Each row is one system at one precision on 2 ranks, launched as its users launch it:
fzero by `fzero run --as-deepspeed -n 2` (its `import deepspeed`), DeepSpeed 0.19.8 from
its own environment (`make .venv-deepspeed/.stamp`) by `torchrun`, the same worker
script: `HfDeepSpeedConfig(ds_config)` kept alive, `AutoModelForCausalLM.from_pretrained`,
`deepspeed.initialize`, `--steps` steps of one sequence per rank. Neither initialises
the process group first (`zero.Init` does). The `whole` row is fzero without
`HfDeepSpeedConfig` (so without `zero.Init`): `from_pretrained` builds and loads the
whole model on every rank and `deepspeed.initialize` shards it, as every rank did before
construction-time partitioning. Each rank reports its peak RSS above its own
base (RSS before `from_pretrained`, Transformers imported) within each stage: the
kernel's high-water mark is reset at each stage's start (/proc/self/clear_refs).

Precisions: `fp32`; `bf16` (bf16 compute, partitions and parameters; fp32 masters and
Adam states); `bf16-states` (bf16 masters, gradients and Adam states:
`bf16_master_weights_and_grads`, `bf16_optimizer_states`, with the optimizer on the host
as DeepSpeed's CPU build needs it). The plain row is one process with the whole model:
torch AdamW over the two ranks' sequences (their mean loss's gradient), clipped as the
engines clip (DeepSpeed's default `gradient_clipping` 1.0, the norm summed in float64),
masters in fp32 for fp32 and bf16 (a bf16 model, fp32 master copies), in bf16 for
bf16-states (torch rounds to nearest where fzero rounds stochastically: those losses
agree to the noise of rounding, not to 1e-5).

`--infinity` instead runs the largest Llama-shaped model this disk holds (`--size`
names one, or `fit` picks it from the free disk) from a bf16 checkpoint through
`from_pretrained` at ZeRO-3 with parameters, gradients, fp32 masters and bf16 Adam
moments on NVMe (`remote_device` "nvme" from the config's `offload_param`, partitions
written to disk as they are made; `commit: in_place`), a few steps of `--sequence`
tokens, and `save_16bit_model`; fzero only, world 2. Bytes on disk per parameter: the
bf16 checkpoint 2, the swap files 14 (fp32 master 4, bf16 moments 2 + 2, fp32 gradient
4, bf16 parameter 2), the saved model 2: 18 at the end, when all exist at once (the
construction's partitions, 2 more, are gone by then: adopted before the save). The disk
in use is sampled every second; each rank's peak RSS per stage as above, the steps'
also by phase (forward, backward, step), and with `--where` the fzero frames each
phase's highest RSS was seen in (a thread samples it every 10 ms). With `--ckpt` the
steps are followed by `save_checkpoint` and `load_checkpoint` of the engine's state
(fp32 master 4 + bf16 moments 2 + 2 bytes per parameter more on disk until the load is
done; each rank's peak RSS in each: "ckpt save MB", "ckpt load MB") and one more step
from the loaded state. `--bf16-masters` keeps the masters and the gradient sums in bf16
too (`bf16_master_weights_and_grads`, `data_types.grad_accum_dtype` "bf16", as
DeepSpeed's key names both): 2 + 2 bytes per parameter less in the swap files and 2 less
in a checkpoint (14 at the end, 18 at the peak with `--ckpt`).

Targets (fzero): after `from_pretrained`, at most the rank's share of the parameters
(in the partitions' dtype) plus one shard file, + 10%; after the steps, at most 1.1 x
the plan's model states per rank in memory (`engine.memory_planned()`, less `.nvme`:
bytes in swap files, which `--zero` may ask for, are not resident) plus the two largest units
gathered (in the compute dtype); rank 0's losses within 1e-5 of the plain run's. The
measured tables, and how far from these targets, are on the documentation's Benchmarks
page ("Models bigger than a rank's share"). `--zero '{...}'` merges keys into every
system's `zero_optimization` (smaller buckets, for instance).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness

ROOT = Path(__file__).resolve().parent.parent
DEEPSPEED_PYTHON = ROOT / ".venv-deepspeed" / "bin" / "python"
SIZES = {  # Llama-shaped: hidden, intermediate, layers, heads, kv heads, vocab
    "tiny": (128, 384, 2, 4, 2, 1000),  # a smoke test of the benchmark itself
    "small": (768, 2048, 12, 12, 4, 32000),
    "probe": (1536, 4096, 18, 12, 4, 32000),
    "1b": (2048, 5632, 22, 16, 4, 32000),  # TinyLlama's shape
    "2.4b": (2560, 6912, 32, 20, 4, 32000),
    "3b": (3072, 8192, 28, 24, 8, 32000),
    "5b": (3072, 8192, 48, 24, 8, 32000),  # 3b's layers, deeper: what fits with bf16 masters
    "8b": (4096, 14336, 32, 32, 8, 128256),  # Llama 3 8B's shape
}
DISK_PER_PARAM = 18  # --infinity: checkpoint 2 + swap files 14 + saved model 2
CKPT_PER_PARAM = 6  # --ckpt: the engine's checkpoint 8, deleted before the model's 2 is saved
BF16_SWAP_SAVE = 4  # --bf16-masters: master and gradient sum 2 bytes each, not 4
BF16_CKPT_SAVE = 2  # --bf16-masters --ckpt: the checkpoint's master 2 bytes, not 4
DISK_RESERVE = 8 * 10**9  # left free for everyone else on the machine
PRECISIONS = ("fp32", "bf16", "bf16-states")
SEQUENCE = 64
LR = 1e-4
CLIP = 1.0  # DeepSpeed's default gradient_clipping, which the engines apply


def llama_config(size: str) -> Any:
    from transformers import LlamaConfig

    hidden, intermediate, layers, heads, kv, vocab = SIZES[size]
    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
        max_position_embeddings=SEQUENCE, tie_word_embeddings=False,
    )  # fmt: skip


def parameters_of(config: Any) -> int:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(config).parameters())


def write_checkpoint(
    config: Any, directory: str, shard_bytes: int, dtype: torch.dtype = torch.float32
) -> int:
    """`config`'s Llama with random weights (normal(0, 0.02) matrices, unit norms) saved
    as `save_pretrained` saves it (in `dtype`), one shard at a time: the model is built
    on the meta device for its names and shapes, and only one shard's tensors exist at
    once. Returns the number of parameters."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        meta = LlamaForCausalLM(config)
    specs = [(k, tuple(v.shape)) for k, v in meta.state_dict().items()]
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    filled = 0
    for key, shape in specs:
        size = math.prod(shape) * dtype.itemsize
        if groups[-1] and filled + size > shard_bytes:
            groups.append([])
            filled = 0
        groups[-1].append((key, shape))
        filled += size
    os.makedirs(directory, exist_ok=True)
    weight_map, total = {}, 0
    for index, group in enumerate(groups):
        name = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for key, shape in group:
            generator = torch.Generator().manual_seed(len(weight_map))
            if len(shape) == 1:
                tensors[key] = torch.ones(shape, dtype=dtype)
            else:
                tensors[key] = (torch.randn(shape, generator=generator) * 0.02).to(dtype)
            weight_map[key] = name
            total += math.prod(shape)
        save_file(tensors, os.path.join(directory, name), metadata={"format": "pt"})
        del tensors
    index_path = os.path.join(directory, "model.safetensors.index.json")
    with open(index_path, "w") as f:
        size = total * dtype.itemsize
        json.dump({"metadata": {"total_size": size}, "weight_map": weight_map}, f)
    config.save_pretrained(directory)
    return total


def ds_config(precision: str, zero: str = "{}") -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3},
    }
    if precision != "fp32":
        config["bf16"] = {"enabled": True}
    if precision == "bf16-states":
        config["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    config["zero_optimization"].update(json.loads(zero))  # --zero: every system's
    return config


def batch(step: int, rank: int, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (1, SEQUENCE), generator=generator)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1])


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class _PeakWhere:
    """`--where`: a thread reading this process's RSS every 10 ms that records, for each
    phase (`enter`), the highest RSS it saw and the fzero frames the main thread was in
    then (a sample: a peak shorter than 10 ms may be missed)."""

    def __init__(self, base_kb: int) -> None:
        import threading

        self.base_kb = base_kb
        self.main = threading.main_thread().ident
        self.phase = "initialize"
        self.found: dict[str, dict[str, Any]] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def enter(self, phase: str) -> None:
        self.phase = phase

    def _sample(self) -> None:
        import traceback

        page_kb = os.sysconf("SC_PAGE_SIZE") // 1024
        with open("/proc/self/statm") as statm:
            while not self.done.wait(0.01):
                statm.seek(0)
                rss = int(statm.read().split()[1]) * page_kb - self.base_kb
                best = self.found.get(self.phase)
                if best is not None and best["rss_kb"] >= rss:
                    continue
                frame = sys._current_frames().get(self.main)
                stack = traceback.extract_stack(frame) if frame is not None else []
                mine = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in stack
                        if "/fzero/" in f.filename]  # fmt: skip
                self.found[self.phase] = {"rss_kb": rss, "stack": mine[-6:]}

    def stop(self) -> dict[str, dict[str, Any]]:
        self.done.set()
        self.thread.join()
        return self.found


# ---- one row's process ------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    """One rank of a fzero or DeepSpeed row (both run this under `import deepspeed`)."""
    import deepspeed
    import transformers.models.llama.modeling_llama  # noqa: F401 (before the base)
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    config = ds_config(args.precision, args.zero)
    # read by Transformers while alive; without it (`--whole`) no zero.Init
    keep = None if args.whole else HfDeepSpeedConfig(config)  # noqa: F841
    base = _status_kb("VmRSS")
    at_base = {f: _status_kb(f) for f in ("VmRSS", "RssAnon", "RssFile")}
    peaks, seconds = {}, {}
    reset_peak()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint)
    seconds["load"] = time.perf_counter() - start
    peaks["load"] = _status_kb("VmHWM") - base
    reset_peak()
    start = time.perf_counter()
    engine, *_ = deepspeed.initialize(
        model=model, config=config, model_parameters=model.parameters()
    )
    seconds["initialize"] = time.perf_counter() - start
    peaks["initialize"] = _status_kb("VmHWM") - base
    phases: dict[str, int] = {}  # the steps' peak, by where in a step it was reached
    where = _PeakWhere(base) if args.where else None

    def phase(name: str, call: Any) -> Any:
        reset_peak()
        if where is not None:
            where.enter(name)
        result = call()
        phases[name] = max(phases.get(name, 0), _status_kb("VmHWM") - base)
        return result

    start = time.perf_counter()
    losses = []
    for step in range(args.steps):
        x = batch(step, rank, model.config.vocab_size)
        loss = phase("forward", lambda x=x: engine(input_ids=x, labels=x).loss)
        phase("backward", lambda loss=loss: engine.backward(loss))
        phase("step", engine.step)
        losses.append(loss.item())
    seconds["steps"] = time.perf_counter() - start
    peaks["steps"] = max(phases.values())
    mine: dict[str, Any] = {"peaks_kb": peaks, "seconds": seconds, "losses": losses}
    mine["base_kb"] = at_base
    mine["rss_kb"] = {f: _status_kb(f) for f in ("VmRSS", "RssAnon", "RssFile")}
    mine["phases_kb"] = phases
    if where is not None:
        mine["where"] = where.stop()
    if hasattr(engine, "memory_planned"):  # fzero: what its plan says a rank holds
        planned = engine.memory_planned()
        mine["planned"] = planned.total - planned.nvme  # in memory: swap files are not RSS
        sizes = sorted((u.numel for u in engine.plan.units), reverse=True)[:2]
        mine["two_units"] = sum(sizes) * engine.compute_dtype.itemsize
    Path(f"{args.json}.rank{rank}").write_text(json.dumps(mine))
    torch.distributed.barrier()
    if rank == 0:
        ranks = [json.loads(Path(f"{args.json}.rank{r}").read_text()) for r in range(2)]
        _harness.write_row(args.json, {"ranks": ranks})


def infinity_config(swap: str, zero: str = "{}", bf16_masters: bool = False) -> dict[str, Any]:
    """The run's DeepSpeed config: everything on NVMe, bf16 moments (and with
    `bf16_masters` bf16 masters and gradient sums), `zero` merged into its ZeRO block."""
    nvme = {"device": "nvme", "nvme_path": swap}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "bf16": {
            "enabled": True,
            "bf16_optimizer_states": True,
            "bf16_master_weights_and_grads": bf16_masters,
        },
        "data_types": {"grad_accum_dtype": "bf16" if bf16_masters else None},
        "aio": {"block_size": 2**20, "thread_count": 2},
        "zero_optimization": {
            "stage": 3,
            "offload_param": nvme,
            "offload_optimizer": {**nvme, "commit": "in_place", "buffer_count": 8},
        },
    }
    config["zero_optimization"].update(json.loads(zero))  # --zero
    return config


def disk_in_use(directory: str) -> int:
    """Bytes allocated under `directory` (st_blocks, every file)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, name)).st_blocks * 512
    return total


def infinity_worker(args: argparse.Namespace) -> None:
    """One rank of `--infinity`: load, adopt, step and save with everything on NVMe."""
    import threading

    import deepspeed
    import transformers.models.llama.modeling_llama  # noqa: F401 (before the base)
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    work = os.path.dirname(args.checkpoint)
    config = infinity_config(os.path.join(work, "swap"), args.zero, args.bf16_masters)
    keep = HfDeepSpeedConfig(config)  # noqa: F841 (read by Transformers while alive)
    disk = {"peak": 0}
    done = threading.Event()

    def sample() -> None:  # rank 0: the disk everything here takes, every second
        while not done.wait(1.0):
            disk["peak"] = max(disk["peak"], disk_in_use(work))

    sampler = threading.Thread(target=sample, daemon=True)
    if rank == 0:
        sampler.start()
    if args.ckpt:
        ckpt = os.path.join(work, "engine_checkpoint")
    base = _status_kb("VmRSS")
    peaks, seconds = {}, {}

    def stage(name: str, call: Any) -> Any:
        reset_peak()
        start = time.perf_counter()
        result = call()
        seconds[name] = time.perf_counter() - start
        peaks[name] = _status_kb("VmHWM") - base
        return result

    model = stage("load", lambda: AutoModelForCausalLM.from_pretrained(args.checkpoint))
    engine, *_ = stage(
        "initialize",
        lambda: deepspeed.initialize(
            model=model, config=config, model_parameters=model.parameters()
        ),
    )
    losses, step_seconds = [], []
    phases: dict[str, int] = {}  # the steps' peak, by where in a step it was reached
    where = _PeakWhere(base) if args.where else None

    def phase(name: str, call: Any) -> Any:
        reset_peak()
        if where is not None:
            where.enter(name)
        result = call()
        phases[name] = max(phases.get(name, 0), _status_kb("VmHWM") - base)
        return result

    def steps() -> None:
        for step in range(args.steps):
            start = time.perf_counter()
            x = batch(step, rank, model.config.vocab_size)[:, : args.sequence]
            loss = phase("forward", lambda x=x: engine(input_ids=x, labels=x).loss)
            phase("backward", lambda loss=loss: engine.backward(loss))
            phase("step", engine.step)
            losses.append(loss.item())
            step_seconds.append(time.perf_counter() - start)

    stage("steps", steps)
    peaks["steps"] = max(phases.values())  # each phase reset the high-water mark
    if args.ckpt:  # the engine's state saved and loaded, then one more step from it
        for name, call in (
            ("ckpt save", lambda: engine.save_checkpoint(ckpt, tag="steps")),
            ("ckpt load", lambda: engine.load_checkpoint(ckpt, tag="steps")),
        ):
            if where is not None:
                where.enter(name)
            stage(name, call)
        if where is not None:
            where.enter("step after the load")
        x = batch(args.steps, rank, model.config.vocab_size)[:, : args.sequence]
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        torch.distributed.barrier()
        if rank == 0:
            shutil.rmtree(ckpt)
    if where is not None:
        where.enter("save")
    out = os.path.join(work, "saved")
    stage("save", lambda: engine.save_16bit_model(out, max_shard_size="2GB"))
    done.set()
    if rank == 0:
        sampler.join()
        disk["peak"] = max(disk["peak"], disk_in_use(work))
        model.config.save_pretrained(out)
    name = "model.embed_tokens.weight"  # one saved tensor against the engine's own
    with deepspeed.zero.GatheredParameters(model.get_parameter(name)):
        mine = model.get_parameter(name).detach().clone()
    if rank == 0:
        from safetensors import safe_open

        index = Path(out, "model.safetensors.index.json")  # one shard: no index
        file = json.loads(index.read_text())["weight_map"][name] if index.exists() else None
        with safe_open(os.path.join(out, file or "model.safetensors"), framework="pt") as f:
            same = bool(torch.equal(f.get_tensor(name), mine))
        disk["saved_equal"] = same
    mine = {"peaks_kb": peaks, "seconds": seconds, "losses": losses, "phases_kb": phases}
    mine.update(step_seconds=step_seconds, disk=disk)
    if where is not None:
        mine["where"] = where.stop()
    Path(f"{args.json}.rank{rank}").write_text(json.dumps(mine))
    torch.distributed.barrier()
    if rank == 0:
        ranks = [json.loads(Path(f"{args.json}.rank{r}").read_text()) for r in range(2)]
        _harness.write_row(args.json, {"ranks": ranks})


def infinity(args: argparse.Namespace) -> None:
    """`--infinity`: the arithmetic first, then one run (see the module docstring)."""
    from fzero.checkpoint import parse_size

    os.makedirs(args.dir, exist_ok=True)
    free = shutil.disk_usage(args.dir).free
    sizes = {name: parameters_of(llama_config(name)) for name in SIZES if name != "tiny"}
    per_param = DISK_PER_PARAM + (CKPT_PER_PARAM if args.ckpt else 0)
    if args.bf16_masters:
        per_param -= BF16_SWAP_SAVE + (BF16_CKPT_SAVE if args.ckpt else 0)
    print(f"{args.dir}: {free / 1e9:.1f} GB free; {DISK_RESERVE / 1e9:.0f} GB left to others")
    for name, count in sizes.items():
        need = count * per_param
        fits = "fits" if need <= free - DISK_RESERVE else "does not fit"
        print(f"  {name:>6}: {count / 1e9:.2f}B parameters x {per_param} B = "
              f"{need / 1e9:.1f} GB: {fits}")  # fmt: skip
    size = args.size
    if size == "fit":
        fitting = [n for n, c in sizes.items() if c * per_param <= free - DISK_RESERVE]
        size = max(fitting, key=sizes.__getitem__)
    count = sizes.get(size) or parameters_of(llama_config(size))
    if count * per_param > free - DISK_RESERVE:
        raise SystemExit(f"{size}: {count * per_param / 1e9:.1f} GB needed, too much")
    directory = tempfile.mkdtemp(prefix="fzero-infinity-", dir=args.dir)
    try:
        args.checkpoint = os.path.join(directory, "checkpoint")
        start = time.perf_counter()
        write_checkpoint(
            llama_config(size), args.checkpoint, parse_size(args.shard), torch.bfloat16
        )
        print(f"{size}: checkpoint written in {time.perf_counter() - start:.0f} s", flush=True)
        command = [
            sys.executable, "-m", "fzero.cli", "run", "--as-deepspeed", "-n", "2", __file__,
            "--checkpoint", args.checkpoint, "--steps", str(args.steps), "--sequence",
            str(args.sequence), "--role", "infinity", "--json", os.path.join(directory, "row.json"),
            "--zero", args.zero, *(["--where"] if args.where else []),
            *(["--ckpt"] if args.ckpt else []),
            *(["--bf16-masters"] if args.bf16_masters else []),
        ]  # fmt: skip
        done = subprocess.run(command, env=_harness.row_environment())
        if done.returncode != 0:
            raise SystemExit(f"the run failed: exit code {done.returncode}")
        row = json.loads(Path(directory, "row.json").read_text())
        _harness.report("big_model --infinity", infinity_table(row, size, count), args.results)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def infinity_table(row: dict[str, Any], size: str, count: int) -> _harness.Table:
    rows = []
    for rank, mine in enumerate(row["ranks"]):
        peaks = {k: v * 1024 / 1e6 for k, v in mine["peaks_kb"].items()}
        steps = mine["step_seconds"]
        ckpt = (peaks["ckpt save"], peaks["ckpt load"]) if "ckpt save" in peaks else ()
        cells = (peaks["load"], peaks["initialize"], peaks["steps"], *ckpt, peaks["save"],
                 statistics.median(steps), mine["losses"][0], mine["losses"][-1])  # fmt: skip
        rows.append((f"fzero:r{rank}", cells))
    ckpt_columns = (("ckpt save MB", ".0f"), ("ckpt load MB", ".0f")) if ckpt else ()
    disk = row["ranks"][0]["disk"]
    columns = (
        ("load MB", ".0f"), ("init MB", ".0f"), ("steps MB", ".0f"), *ckpt_columns,
        ("save MB", ".0f"), ("s/step", ".1f"), ("loss1", ".5f"), ("lossN", ".5f"),
    )  # fmt: skip
    seconds = row["ranks"][0]["seconds"]
    notes = [
        f"disk at its peak {disk['peak'] / 1e9:.1f} GB = {disk['peak'] / count:.1f} B/param "
        f"(checkpoint, swap files, saved model); saved embedding equal to the engine's: "
        f"{disk.get('saved_equal')}",
        "seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()),
    ]
    for rank, mine in enumerate(row["ranks"]):
        after = " (the last after --ckpt's load)" if ckpt_columns else ""
        notes.append(f"r{rank} losses{after}: {', '.join(repr(x) for x in mine['losses'])}")
    for rank, mine in enumerate(row["ranks"]):
        phases = mine.get("phases_kb", {})
        notes.append(
            f"r{rank} the steps' peak MB by phase: "
            + ", ".join(f"{k} {v * 1024 / 1e6:.0f}" for k, v in phases.items())
        )
        for phase, found in mine.get("where", {}).items():  # --where
            notes.append(
                f"r{rank} {phase}: {found['rss_kb'] * 1024 / 1e6:.0f} MB above base at "
                + " < ".join(reversed(found["stack"]))
            )
    title = (
        f"big_model --infinity: Llama-shaped {count / 1e9:.2f}B parameters ({size}), ZeRO-3, "
        "world 2, parameters + gradients + optimizer on NVMe, peak RSS above each rank's base"
    )
    return _harness.Table(title, "rank", columns, tuple(rows), tuple(notes))


def clip(masters: list[torch.Tensor]) -> None:
    """Clip the gradients as the engines do: at DeepSpeed's default `gradient_clipping`
    (1.0; Adam's first step moves a weight whose gradient is near eps by an amount the
    clip changes), the norm summed in float64 (torch's fp32 `clip_grad_norm_` is 3.6e-5
    off at 125M elements, which a bf16 run turns into other losses)."""
    total = math.sqrt(sum(float(m.grad.double().square().sum()) for m in masters))
    factor = CLIP / (total + 1e-6)
    if factor < 1.0:
        for m in masters:
            m.grad.mul_(factor)


def plain(args: argparse.Namespace) -> None:
    """The plain row: the whole model in one process, the two ranks' sequences each step."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    base = _status_kb("VmRSS")
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
    if args.precision == "fp32":
        params = list(model.parameters())
        masters = params
    else:
        model.to(torch.bfloat16)
        params = list(model.parameters())
        masters = (
            params
            if args.precision == "bf16-states"
            else [p.detach().float().requires_grad_() for p in params]
        )
    optimizer = torch.optim.AdamW(masters, lr=LR, weight_decay=0.0)
    losses = []
    for step in range(args.steps):
        grads = [torch.zeros(p.shape, dtype=torch.float32) for p in params]
        for rank in range(2):
            x = batch(step, rank, model.config.vocab_size)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            for g, p in zip(grads, params):
                g += p.grad.float()
                p.grad = None
            if rank == 0:
                losses.append(loss.item())
        for master, g in zip(masters, grads):
            master.grad = (g / 2).to(master.dtype)
        clip(masters)
        optimizer.step()
        optimizer.zero_grad()
        if masters is not params:
            with torch.no_grad():
                for p, master in zip(params, masters):
                    p.copy_(master)
    peak = _status_kb("VmHWM") - base
    _harness.write_row(args.json, {"losses": losses, "peak_kb": peak})


# ---- the benchmark ------------------------------------------------------------------------


def row_command(args: argparse.Namespace, name: str, out: str) -> list[str]:
    system, precision = name.split(":")
    common = [
        __file__, "--checkpoint", args.checkpoint, "--precision", precision,
        "--steps", str(args.steps), "--json", out, "--zero", args.zero,
        *(["--where"] if args.where else []),
    ]  # fmt: skip
    if system == "plain":
        return [sys.executable, *common, "--role", "plain"]
    if system in ("fzero", "whole"):
        whole = ["--whole"] if system == "whole" else []
        return [sys.executable, "-m", "fzero.cli", "run", "--as-deepspeed", "-n", "2",
                *common, "--role", "worker", *whole]  # fmt: skip
    return [str(DEEPSPEED_PYTHON), "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node=2", *common, "--role", "worker"]  # fmt: skip


def first3(losses: list[float]) -> list[float | None]:
    """The first three losses, None for steps not run (the table's three columns)."""
    return [*losses[:3], *[None] * (3 - len(losses[:3]))]


def table(
    results: dict[str, list[dict[str, Any]]], params: int, shard: int, size: str
) -> _harness.Table:
    mb = 1000**2
    rows = []
    notes = []
    for name, rounds in results.items():
        system, precision = name.split(":")
        result = rounds[0]
        reference = results.get(f"plain:{precision}", [{}])[0].get("losses")
        if system == "plain":
            losses = result["losses"]
            cells = (None, None, None, result["peak_kb"] * 1024 / mb, None, None, *first3(losses))
            rows.append((name, cells))
            continue
        itemsize = 4 if precision == "fp32" else 2
        load_target = 1.1 * (params * itemsize / 2 + shard) / mb
        fzero_row = results.get(f"fzero:{precision}", [{}])[0].get("ranks")
        for rank, mine in enumerate(result["ranks"]):
            peaks = {k: v * 1024 / mb for k, v in mine["peaks_kb"].items()}
            plan = fzero_row[rank] if fzero_row else mine if "planned" in mine else None
            step_target = (1.1 * plan["planned"] + plan["two_units"]) / mb if plan else None
            if system == "fzero":  # the targets are fzero's
                met = [
                    f"{stage} {peaks[stage]:.0f} MB {'<=' if peaks[stage] <= bound else '>'} "
                    f"{bound:.0f}"
                    for stage, bound in (("load", load_target), ("steps", step_target))
                    if bound is not None
                ]
                notes.append(f"{name}:r{rank} against the targets: " + ", ".join(met))
            if rank == 0 and "phases_kb" in mine:
                where = ", ".join(f"{k} {v * 1024 / mb:.0f}" for k, v in mine["phases_kb"].items())
                notes.append(f"{name}:r0 the steps' peak MB by phase: {where}")
            for phase, found in mine.get("where", {}).items():  # --where
                notes.append(
                    f"{name}:r{rank} {phase}: {found['rss_kb'] * 1024 / mb:.0f} MB above base "
                    "at " + " < ".join(reversed(found["stack"]))
                )
            losses = mine["losses"] if rank == 0 else []
            rows.append((f"{name}:r{rank}", (
                peaks["load"], load_target, peaks["initialize"], peaks["steps"], step_target,
                plan["planned"] / mb if plan else None, *first3(losses),
            )))  # fmt: skip
            if rank == 0 and reference:
                worst = max(abs(a - b) for a, b in zip(mine["losses"], reference))
                notes.append(f"{name}: rank 0's losses differ from plain's by at most {worst:.2e}")
    title = (
        f"big_model: Llama-shaped {params / 1e6:.0f}M parameters ({size}), from_pretrained of "
        f"{shard / mb:.0f} MB fp32 shards, ZeRO-3, world 2, MB above each rank's base"
    )
    columns = (
        ("load", ".0f"), ("target", ".0f"), ("init", ".0f"), ("steps", ".0f"),
        ("target", ".0f"), ("plan", ".0f"), ("loss1", ".6f"), ("loss2", ".6f"),
        ("loss3", ".6f"),
    )  # fmt: skip
    return _harness.Table(title, "system:precision:rank", columns, tuple(rows), tuple(notes))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=[*sorted(SIZES), "fit"], default=None)
    parser.add_argument("--infinity", action="store_true", help="the NVMe run (see above)")
    parser.add_argument("--sequence", type=int, default=16, help="--infinity's tokens")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--systems", default="fzero,whole,deepspeed,plain")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--shard", default="500MB", help="safetensors shard size")
    parser.add_argument(
        "--zero", default="{}", help="JSON merged into zero_optimization (every system's)"
    )
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--results", default=None, help="also append the table to this file")
    parser.add_argument("--role", choices=["worker", "plain", "infinity"], help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--precision", choices=PRECISIONS, help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument("--whole", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--where", action="store_true", help="where each phase's peak RSS was seen (fzero frames)"
    )
    parser.add_argument(
        "--ckpt", action="store_true", help="--infinity: save and load a checkpoint after the steps"
    )
    parser.add_argument(
        "--bf16-masters",
        action="store_true",
        help="--infinity: bf16 masters and gradient sums in the swap files",
    )
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # DeepSpeed's launcher
    args = parser.parse_args()
    if args.role == "worker":
        return worker(args)
    if args.role == "plain":
        return plain(args)
    if args.role == "infinity":
        return infinity_worker(args)
    if args.infinity:
        args.size = args.size or "fit"
        return infinity(args)
    args.size = args.size or "small"
    from fzero.checkpoint import parse_size

    systems = args.systems.split(",")
    if "deepspeed" in systems and not DEEPSPEED_PYTHON.exists():
        print(f"(DeepSpeed rows left out: no {DEEPSPEED_PYTHON}; make .venv-deepspeed/.stamp)")
        systems.remove("deepspeed")
    shard = parse_size(args.shard)
    directory = tempfile.mkdtemp(prefix="fzero-big-model-", dir=args.dir)
    try:
        args.checkpoint = os.path.join(directory, "checkpoint")
        params = write_checkpoint(llama_config(args.size), args.checkpoint, shard)
        names = [f"{s}:{p}" for p in args.precisions.split(",") for s in systems]
        results = _harness.run_rows(names, lambda name, out: row_command(args, name, out), 1)
        _harness.report("big_model", table(results, params, shard, args.size), args.results)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
