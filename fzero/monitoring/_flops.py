"""DeepSpeed's FLOPs profiler on `torch.utils.flop_counter.FlopCounterMode`.

DeepSpeed's `FlopsProfiler` patches `torch.nn.functional` and tensor methods with
hand-written counts and times each module's forward; fzero counts with PyTorch's own
`FlopCounterMode` (a dispatch mode: every matrix product, convolution and attention
kernel, by its shapes, attributed to the modules running it — in forward and, when the
profiled window includes it, in backward) and times each module's forward with hooks,
removed when profiling ends. The counted operations are products, whose FLOPs are
twice their multiply-accumulates (MACs = FLOPs / 2); element-wise work (activations,
norms, softmax), which DeepSpeed's counts add, is not counted.

The surface is DeepSpeed's: `FlopsProfiler(model).start_profile()`, `stop_profile()`,
`get_total_flops()` (forward), `get_total_macs()`, `get_total_params()`,
`get_total_duration()`, `print_model_profile(...)`, `end_profile()`, and
`get_model_profile(model, input_shape=...)`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fzero.monitoring._peak import Peak

__all__ = [
    "FlopsProfiler",
    "ModuleProfile",
    "ProfiledStep",
    "StepTimes",
    "format_number",
    "get_model_profile",
]


@dataclass(frozen=True)
class ModuleProfile:
    """One module's share of the profiled window."""

    name: str
    """Its name in the model ("" for the model itself)."""
    kind: str
    depth: int
    params: int
    forward_flops: int
    backward_flops: int
    forward_seconds: float

    @property
    def macs(self) -> int:
        """Forward multiply-accumulates: the counted products' FLOPs / 2."""
        return self.forward_flops // 2


@dataclass(frozen=True)
class StepTimes:
    """The profiled micro-step's latencies and sizes, from the engine (DeepSpeed reads
    its own timers for these lines)."""

    forward_seconds: float
    backward_seconds: float
    step_seconds: float
    world_size: int
    micro_batch_size: int | None


def format_number(value: float, unit: str = "", precision: int = 2) -> str:
    """`value` with an SI prefix (1.23 G, 4.5 ms): DeepSpeed's `number_to_string` and
    kin, decimal throughout."""
    if abs(value) < 1e3 and float(value).is_integer() and unit != "s":
        return f"{int(value)} {unit}".rstrip()
    if unit == "s":
        for scale, prefix in ((1, ""), (1e-3, "m"), (1e-6, "u")):
            if abs(value) >= scale or scale == 1e-6:
                return f"{value / scale:.{precision}f} {prefix}s"
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:.{precision}f} {prefix}{unit}"
    return f"{value:.{precision}f} {unit}".rstrip()


class FlopsProfiler:
    """FLOPs, MACs, parameters and forward latency per module of `model`, between
    `start_profile()` and `stop_profile()` (DeepSpeed's `FlopsProfiler`; `ds_engine` is
    accepted for DeepSpeed's signature and kept, not read: the engine's own profile is
    `ProfiledStep`'s). Parameters are counted whole
    (`ds_numel` where ZeRO-3 left a shard). `recompute_fwd_factor`: forwards that
    backward recomputes, for the estimated backward when the window had none."""

    def __init__(
        self,
        model: nn.Module,
        ds_engine: object | None = None,
        recompute_fwd_factor: float = 0.0,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"FlopsProfiler needs a torch.nn.Module, found {type(model).__name__}")
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self._counter: FlopCounterMode | None = None
        self._hooks: list[Any] = []
        self._forward_counts: dict[str, int] | None = None
        self._counts: dict[str, int] = {}
        self._seconds: dict[nn.Module, float] = {}
        self._began: dict[nn.Module, list[float]] = {}
        self._ignored: tuple[type, ...] = ()

    # ---- the window --------------------------------------------------------------------

    def start_profile(self, ignore_list: Sequence[type] | None = None) -> None:
        """Start counting and timing (modules of a type in `ignore_list` are not
        timed); a profile started before is reset."""
        if self._counter is not None:
            self.stop_profile()
        self.reset_profile()
        self._ignored = tuple(ignore_list or ())
        for module in self.model.modules():
            if isinstance(module, self._ignored):
                continue
            self._hooks.append(module.register_forward_pre_hook(self._enter))
            self._hooks.append(module.register_forward_hook(self._leave, always_call=True))
        self._counter = FlopCounterMode(display=False)
        self._counter.__enter__()
        self.started = True

    def forward_done(self) -> None:
        """The window's forward ended: what was counted so far is forward, the rest
        (until `stop_profile`) backward."""
        if self._counter is not None:
            self._forward_counts = _totals(self._counter)

    def stop_profile(self) -> None:
        """Stop counting and timing; the profile stays readable until `end_profile`."""
        if self._counter is None:
            return
        counter, self._counter = self._counter, None
        counter.__exit__(None, None, None)
        self._counts = _totals(counter)
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def reset_profile(self) -> None:
        self._counts, self._forward_counts = {}, None
        self._seconds.clear()
        self._began.clear()

    def end_profile(self) -> None:
        """Stop, and forget the profile."""
        self.stop_profile()
        self.reset_profile()
        self.started = False

    def _enter(self, module: nn.Module, args: Any) -> None:
        _synchronize(module)
        self._began.setdefault(module, []).append(time.perf_counter())

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        _synchronize(module)
        stack = self._began.get(module)
        if stack:
            elapsed = time.perf_counter() - stack.pop()
            self._seconds[module] = self._seconds.get(module, 0.0) + elapsed

    # ---- what was measured -------------------------------------------------------------

    def profiles(self) -> list[ModuleProfile]:
        """Each module (depth first, the model first) with its counts and latency."""
        root = type(self.model).__name__
        forward = self._forward_counts if self._forward_counts is not None else self._counts
        found = []
        for name, module in self.model.named_modules():
            key = f"{root}.{name}" if name else root
            total, ahead = self._counts.get(key, 0), forward.get(key, 0)
            found.append(
                ModuleProfile(
                    name=name,
                    kind=type(module).__name__,
                    depth=name.count(".") + 1 if name else 0,
                    params=_params(module),
                    forward_flops=ahead,
                    backward_flops=total - ahead,
                    forward_seconds=self._seconds.get(module, 0.0),
                )
            )
        return found

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """FLOPs of the window's forward (the whole window when `forward_done` was not
        called and no backward ran)."""
        flops = self.profiles()[0].forward_flops
        return format_number(flops) if as_string else flops

    def get_total_backward_flops(self) -> int:
        """FLOPs counted after `forward_done` (0 when the window was forward only)."""
        return self.profiles()[0].backward_flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        macs = self.profiles()[0].macs
        return format_number(macs, "MACs") if as_string else macs

    def get_total_duration(self, as_string: bool = False) -> float | str:
        seconds = self.profiles()[0].forward_seconds
        return format_number(seconds, "s") if as_string else seconds

    def get_total_params(self, as_string: bool = False) -> int | str:
        params = _params(self.model)
        return format_number(params) if as_string else params

    # ---- printing ----------------------------------------------------------------------

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
        *,
        times: StepTimes | None = None,
        peak: Peak | None = None,
    ) -> str:
        """Print (or write to `output_file`) the profile: the summary (with the engine's
        `times`: backward and step latency, fwd+bwd and step FLOP/s, and MFU against
        `peak`), the top modules per depth, and with `detailed` the module tree. Returns
        the text."""
        text = format_profile(
            self.profiles(),
            profile_step=profile_step,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
            model=self.model,
            times=times,
            peak=peak,
            recompute_fwd_factor=self.recompute_fwd_factor,
        )
        if output_file:
            path = Path(output_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n")
        else:
            print(text, flush=True)
        return text

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        print("\n".join(_aggregated(self.profiles(), module_depth, top_modules)), flush=True)


def _totals(counter: FlopCounterMode) -> dict[str, int]:
    return {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}


def _params(module: nn.Module) -> int:
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters())


def _synchronize(module: nn.Module) -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _aggregated(profiles: list[ModuleProfile], module_depth: int, top_modules: int) -> list[str]:
    """DeepSpeed's "Top N modules in terms of params, MACs or fwd latency at different
    model depths", by module type at each depth."""
    by_depth: dict[int, dict[str, list[float]]] = {}
    for p in profiles:
        row = by_depth.setdefault(p.depth, {}).setdefault(p.kind, [0, 0, 0.0])
        row[0] += p.macs
        row[1] += p.params
        row[2] += p.forward_seconds
    depth = max(by_depth) if module_depth == -1 else min(module_depth, max(by_depth))
    lines = [f"Top {top_modules} modules in terms of params, MACs or fwd latency per depth:"]
    for d in range(depth + 1):
        kinds = by_depth.get(d, {})

        def top(i: int, unit: str, kinds: dict[str, list[float]] = kinds) -> str:
            best = sorted(kinds.items(), key=lambda item: item[1][i], reverse=True)
            return str({k: format_number(v[i], unit) for k, v in best[:top_modules]})

        lines += [
            f"depth {d}:",
            f"    params      - {top(1, '')}",
            f"    MACs        - {top(0, 'MACs')}",
            f"    fwd latency - {top(2, 's')}",
        ]
    return lines


def format_profile(
    profiles: list[ModuleProfile],
    *,
    profile_step: int,
    module_depth: int,
    top_modules: int,
    detailed: bool,
    model: nn.Module,
    times: StepTimes | None,
    peak: Peak | None,
    recompute_fwd_factor: float = 0.0,
) -> str:
    """The profile as DeepSpeed lays it out, with fzero's counts (see the module doc)."""
    root = profiles[0]
    line = "{:<72}  {}".format
    out = [
        "",
        "-------------------------- fzero Flops Profiler --------------------------",
        f"Profile Summary at step {profile_step}:",
        "FLOPs counted by torch.utils.flop_counter.FlopCounterMode (matrix products, "
        "convolutions, attention; MACs = FLOPs / 2); latency measured with module hooks",
        "",
    ]
    if times is not None:
        out.append(line("world size: ", times.world_size))
        out.append(line("data parallel size: ", times.world_size))
        if times.micro_batch_size is not None:
            out.append(line("batch size per GPU: ", times.micro_batch_size))
    out += [
        line("params per GPU (whole tensors): ", format_number(root.params)),
        line("fwd MACs per GPU: ", format_number(root.macs, "MACs")),
        line("fwd flops per GPU: ", format_number(root.forward_flops)),
    ]
    forward = times.forward_seconds if times is not None else root.forward_seconds
    out.append(line("fwd latency: ", format_number(forward, "s")))
    out.append(
        line("fwd FLOPS per GPU = fwd flops / fwd latency: ", _rate(root.forward_flops, forward))
    )
    if root.backward_flops:
        backward_flops, how = root.backward_flops, "bwd flops (counted)"
    else:
        factor = 2 + recompute_fwd_factor
        backward_flops, how = int(factor * root.forward_flops), f"{factor:g} * fwd flops"
        out.append(line("bwd flops per GPU (estimated): ", format_number(backward_flops)))
    if root.backward_flops:
        out.append(line("bwd flops per GPU (counted): ", format_number(root.backward_flops)))
    total_flops = root.forward_flops + backward_flops
    if times is not None:
        fb = times.forward_seconds + times.backward_seconds
        iteration = fb + times.step_seconds
        out += [
            line("bwd latency: ", format_number(times.backward_seconds, "s")),
            line(
                f"bwd FLOPS per GPU = {how} / bwd latency: ",
                _rate(backward_flops, times.backward_seconds),
            ),
            line(
                "fwd+bwd FLOPS per GPU = fwd+bwd flops / (fwd+bwd latency): ",
                _rate(total_flops, fb),
            ),
            line("step latency: ", format_number(times.step_seconds, "s")),
            line("iter latency: ", format_number(iteration, "s")),
            line("FLOPS per GPU = fwd+bwd flops / iter latency: ", _rate(total_flops, iteration)),
        ]
        if times.micro_batch_size is not None and iteration > 0:
            samples = times.micro_batch_size * times.world_size / iteration
            out.append(line("samples/second: ", f"{samples:.2f}"))
        if peak is not None and iteration > 0:
            mfu = total_flops / iteration / peak.flops
            out.append(
                line(
                    "MFU = FLOPS per GPU / peak: ",
                    f"{100 * mfu:.2f}% of {format_number(peak.flops, 'FLOPS')} ({peak.source})",
                )
            )
    out += [
        "",
        "----------------------------- Aggregated Profile per GPU -----------------------------",
    ]
    out += _aggregated(profiles, module_depth, top_modules)
    if detailed:
        out += [
            "",
            "------------------------------ Detailed Profile per GPU "
            "------------------------------",
            "Each module: params, % of total params, fwd MACs, % of total MACs, fwd latency, "
            "% of total fwd latency, fwd FLOPS, bwd flops",
            "",
            _tree(model, {p.name: p for p in profiles}, root),
        ]
    out.append("------------------------------------------------------------------------------")
    return "\n".join(out)


def _rate(flops: float, seconds: float) -> str:
    return format_number(flops / seconds, "FLOPS") if seconds > 0 else "-"


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.2f}%" if whole else "0%"


def _tree(model: nn.Module, profiles: dict[str, ModuleProfile], root: ModuleProfile) -> str:
    """`repr(model)` with each module's profile in front of its own extra repr."""
    lines: list[str] = []

    def walk(name: str, module: nn.Module, indent: int, label: str) -> None:
        p = profiles[name]
        items = [
            f"{format_number(p.params)} = {_share(p.params, root.params)} Params",
            f"{format_number(p.macs, 'MACs')} = {_share(p.macs, root.macs)} MACs",
            f"{format_number(p.forward_seconds, 's')} = "
            f"{_share(p.forward_seconds, root.forward_seconds)} latency",
            _rate(p.forward_flops, p.forward_seconds),
            f"bwd {format_number(p.backward_flops, 'FLOPs')}",
        ]
        extra = module.extra_repr()
        head = f"{' ' * indent}{label}{type(module).__name__}({', '.join(items)}"
        children = list(module.named_children())
        if not children:
            lines.append(head + (f", {extra})" if extra else ")"))
            return
        lines.append(head + (f", {extra}" if extra else ""))
        for child, sub in children:
            walk(f"{name}.{child}" if name else child, sub, indent + 2, f"({child}): ")
        lines.append(f"{' ' * indent})")

    walk("", model, 0, "")
    return "\n".join(lines)


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


def get_model_profile(
    model: nn.Module,
    input_shape: tuple[int, ...] | None = None,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules: Sequence[type] | None = None,
    mode: str = "forward",
) -> tuple[Any, Any, Any]:
    """DeepSpeed's `get_model_profile`: the FLOPs, MACs and parameters of one forward
    (`mode="forward"`) or `model.generate` call (`mode="generate"`) of `model` in eval
    mode on `args`/`kwargs`, or on one tensor of `input_shape` (uninitialised, of the
    model's dtype and device), after `warm_up` calls; printed unless `print_profile` is
    false. Returns `(flops, macs, params)`, as strings when `as_string`."""
    if mode not in ("forward", "generate"):
        raise ValueError(f"get_model_profile mode is {mode!r}; allowed: 'forward', 'generate'")
    kwargs = dict(kwargs or {})
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise ValueError(f"input_shape must be a non-empty tuple, found {input_shape!r}")
        first = next(model.parameters(), None)
        args = [
            torch.empty(
                input_shape,
                dtype=first.dtype if first is not None else None,
                device=first.device if first is not None else None,
            )
        ]
    if not args and not kwargs:
        raise ValueError("get_model_profile needs input_shape, args or kwargs")
    call: Callable[..., Any] = model.generate if mode == "generate" else model  # type: ignore[assignment]
    profiler = FlopsProfiler(model)
    with _eval_mode(model), torch.no_grad():
        for _ in range(warm_up):
            call(*args, **kwargs)
        profiler.start_profile(ignore_list=ignore_modules)
        try:
            call(*args, **kwargs)
        finally:
            profiler.stop_profile()
    flops, macs, params = (
        profiler.get_total_flops(),
        profiler.get_total_macs(),
        profiler.get_total_params(),
    )
    if print_profile:
        profiler.print_model_profile(
            profile_step=warm_up,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
            output_file=output_file,
        )
    profiler.end_profile()
    if as_string:
        return format_number(flops), format_number(macs, "MACs"), format_number(params)
    return flops, macs, params


class ProfiledEngine(Protocol):
    """What a profiled step reads of its engine (`fzero.engine.Engine`)."""

    timers: Any  # fzero.engine.telemetry.Timers: `totals` and `timers(name)`
    world_size: int
    compute_dtype: torch.dtype
    device: torch.device


class ProfiledStep:
    """The engine's `flops_profiler` block: at optimizer step `profile_step` (counted
    as `global_steps` before it, from 0, as DeepSpeed's), the first micro-batch is
    profiled from its forward through the end of its backward, and printed (or written
    to `output_file`) when that step ends, with the engine's latencies of that
    micro-step and MFU against the device's peak. Rank 0 only, as DeepSpeed's."""

    def __init__(self, module: nn.Module, config: Any, engine: ProfiledEngine) -> None:
        self.config, self.engine = config, engine
        self.profiler = FlopsProfiler(module, engine, config.recompute_fwd_factor)
        with FlopCounterMode(display=False):  # its first use imports for seconds: not
            torch.mm(torch.ones(2, 2), torch.ones(2, 2))  # inside the profiled step
        self.state = "waiting"  # -> "counting" -> "counted" -> "done"
        self.samples: int | None = None
        self._timers: dict[str, float] = {}
        self._times: dict[str, float] = {}

    @contextlib.contextmanager
    def forward(self, step: int, samples: int | None) -> Iterator[None]:
        if self.state != "waiting" or step != self.config.profile_step:
            yield
            return
        self.state, self.samples = "counting", samples
        self._timers = dict(self.engine.timers.totals)
        self.profiler.start_profile()
        try:
            yield
        finally:
            self.profiler.forward_done()
            self._times["forward"] = self._elapsed("forward")

    def backward_done(self) -> None:
        if self.state == "counting":
            self.profiler.stop_profile()
            self._times["backward"] = self._elapsed("backward")
            self.state = "counted"

    def step_done(self, step: int) -> float | None:
        """The optimizer step `step` (its `global_steps` before it) ended: print the
        profile if it was taken in it; returns the counted FLOPs per sample then."""
        if self.state not in ("counting", "counted") or step != self.config.profile_step:
            return None
        if self.state == "counting":  # a plain loss.backward(): the window ends here
            self.profiler.stop_profile()
            self._times["backward"] = self._elapsed("backward")
        self._times["step"] = self._elapsed("step")
        from fzero.monitoring._peak import peak_flops

        engine = self.engine
        times = StepTimes(
            forward_seconds=self._times["forward"],
            backward_seconds=self._times["backward"],
            step_seconds=self._times["step"],
            world_size=engine.world_size,
            micro_batch_size=self.samples,
        )
        self.profiler.print_model_profile(
            profile_step=step + 1,  # DeepSpeed's label: `global_steps` after the step
            module_depth=self.config.module_depth,
            top_modules=self.config.top_modules,
            detailed=self.config.detailed,
            output_file=self.config.output_file,
            times=times,
            peak=peak_flops(engine.device, engine.compute_dtype),
        )
        root = self.profiler.profiles()[0]
        flops = root.forward_flops + (
            root.backward_flops or (2 + self.config.recompute_fwd_factor) * root.forward_flops
        )
        self.profiler.end_profile()
        self.state = "done"
        return flops / self.samples if self.samples else None

    def _elapsed(self, timer: str) -> float:
        """Seconds the engine's `timer` ran since the last reading of it."""
        now = self.engine.timers.totals.get(timer, 0.0)
        before = self._timers.get(timer, 0.0)
        self._timers[timer] = now
        return max(0.0, now - before)
