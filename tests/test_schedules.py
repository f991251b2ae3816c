"""Schedules against closed-form values; loss scaling step by step."""

from __future__ import annotations

import math

import pytest

import fzero.optim as fo


def test_warmup_lr_log_and_linear():
    log = fo.WarmupLR(warmup_min_lr=0.0, warmup_max_lr=1e-3, warmup_num_steps=1000)
    assert log(0, 9.0) == 0.0  # value set at construction, before any scheduler step
    assert log(1, 9.0) == 0.0  # iteration 0: log(1) = 0
    assert log(11, 9.0) == pytest.approx(1e-3 * math.log(11) / math.log(1000))
    assert log(5000, 9.0) == 1e-3
    linear = fo.WarmupLR(
        warmup_min_lr=1e-4, warmup_max_lr=1e-3, warmup_num_steps=1000, warmup_type="linear"
    )
    assert linear(501, 0.0) == pytest.approx(1e-4 + 9e-4 * 0.5)


def test_warmup_lr_without_a_max_warms_up_to_the_group_lr_as_deepspeed_019():
    """DeepSpeed 0.19's WarmupLR defaults `warmup_max_lr` to each group's lr (its
    WarmupDecayLR keeps 1e-3); checked against DeepSpeed running in
    tests/deepspeed_reference/parity.py."""
    s = fo.WarmupLR(warmup_num_steps=4, warmup_type="linear")
    assert s(3, 0.2) == pytest.approx(0.1)  # iteration 2 of 4
    assert s(10, 0.2) == 0.2 and s(10, 0.05) == 0.05
    assert fo.WarmupDecayLR(warmup_num_steps=2, total_num_steps=10)(2, 0.2) == pytest.approx(1e-3)


def test_warmup_decay_lr():
    s = fo.WarmupDecayLR(warmup_max_lr=1e-3, warmup_num_steps=1000, total_num_steps=10_000)
    assert s(5001, 0.0) == pytest.approx(1e-3 * 5000 / 9000)
    assert s(10_001, 0.0) == 0.0
    assert s(20_000, 0.0) == 0.0


def test_warmup_cosine_lr_scales_the_group_lr():
    s = fo.WarmupCosineLR(
        total_num_steps=100, warmup_num_steps=10, cos_min_ratio=0.0, warmup_type="linear"
    )
    assert s(0, 0.1) == 0.0
    assert s(6, 0.1) == pytest.approx(0.05)
    assert s(11, 0.1) == pytest.approx(0.1 * (1 + math.cos(math.pi / 90)) / 2)
    assert s(11, 0.2) == pytest.approx(2 * s(11, 0.1))


def test_warmup_cosine_lr_holds_its_floor_past_the_end():
    """DeepSpeed clamps the cosine's progress at 1: past `total_num_steps` the ratio stays
    at `cos_min_ratio` (it used to climb back up)."""
    s = fo.WarmupCosineLR(total_num_steps=6, warmup_num_steps=2, cos_min_ratio=0.01)
    assert s(6, 1.0) == pytest.approx(0.01)
    assert [s(step, 1.0) for step in (7, 9, 30)] == [pytest.approx(0.01)] * 3


def test_deepspeeds_scheduler_classes_over_a_script_optimizer():
    """`deepspeed.runtime.lr_schedules`' classes write the pure schedules' lrs into each
    group, and OneCycle its cycled betas (checked against DeepSpeed in
    tests/deepspeed_reference/schedulers.py)."""
    import torch

    from fzero.compat.deepspeed.runtime import lr_schedules

    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))]
    optimizer = torch.optim.Adam([{"params": [params[0]], "lr": 0.2}, {"params": [params[1]]}])
    warmup = lr_schedules.WarmupLR(optimizer, warmup_num_steps=4, warmup_type="linear")
    assert [g["lr"] for g in optimizer.param_groups] == [0.0, 0.0]
    for _ in range(3):
        warmup.step()
    assert warmup.get_last_lr() == [pytest.approx(0.1), pytest.approx(0.5e-3)]
    assert warmup.state_dict() == {"last_batch_iteration": 2}
    cycled = lr_schedules.OneCycle(optimizer, 0.01, 0.1, cycle_first_step_size=2)
    assert [g["betas"] for g in optimizer.param_groups] == [(0.8, 0.99)] * 2  # DeepSpeed's
    cycled.step()
    assert cycled.get_mom() == [(pytest.approx(0.85), 0.99)] * 2
    assert optimizer.param_groups[0]["betas"] == cycled.get_mom()[0]
    sgd = torch.optim.SGD(params, lr=0.1)  # no betas: DeepSpeed turns the cycling off
    cycle = lr_schedules.OneCycle(sgd, 0.01, 0.1, cycle_first_step_size=2)
    cycle.step()
    assert cycle.get_last_lr() == [pytest.approx(0.055)] and cycle.get_mom() is None
    with pytest.raises(ValueError, match="expected 2 value for max_lr, got 1"):
        lr_schedules.WarmupLR(optimizer, warmup_max_lr=[1.0])


def test_one_cycle_lr_and_momentum():
    s = fo.OneCycle(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=10)
    assert s(0, 0.0) == 0.01
    assert s(5, 0.0) == pytest.approx(0.055)  # x = 0.25 of the cycle, halfway up
    assert s(10, 0.0) == pytest.approx(0.1)  # the peak
    assert s(15, 0.0) == pytest.approx(0.055)
    assert s.momentum(5) == pytest.approx(0.85)
    assert s.momentum(10) == pytest.approx(0.8)
    decaying = fo.OneCycle(
        cycle_min_lr=0.01,
        cycle_max_lr=0.1,
        cycle_first_step_size=10,
        decay_lr_rate=1.0,
        decay_step_size=5,
    )
    assert decaying(30, 0.0) == pytest.approx(0.01 / (1 + 10 / 5))
    assert fo.OneCycle(cycle_momentum=False).momentum(3) is None
    # DeepSpeed's OneCycle writes (momentum, 0.99) as an Adam's betas, whatever beta2 was
    assert s.betas(5) == (pytest.approx(0.85), 0.99)
    assert fo.OneCycle(cycle_momentum=False).betas(3) is None


def test_one_cycle_stairs():
    """With stair counts the lr climbs in equal stairs: 2 up over 4 steps, 1 down over 2
    (DeepSpeed's `_get_scale_factor`)."""
    s = fo.OneCycle(
        cycle_min_lr=0.0,
        cycle_max_lr=1.0,
        cycle_first_step_size=4,
        cycle_second_step_size=2,
        cycle_first_stair_count=2,
        cycle_second_stair_count=1,
    )
    assert [s(step, 0.0) for step in range(1, 7)] == [0.0, 0.5, 0.5, 1.0, 0.0, 0.0]
    assert s.momentum(2) == pytest.approx(0.85) and s.momentum(4) == pytest.approx(0.8)


def test_lr_range_test():
    s = fo.LRRangeTest(lr_range_test_min_lr=1e-3, lr_range_test_step_size=10)
    assert s(5, 0.0) == pytest.approx(1.5e-3)
    stair = fo.LRRangeTest(
        lr_range_test_min_lr=1e-3, lr_range_test_step_size=10, lr_range_test_staircase=True
    )
    assert stair(5, 0.0) == 1e-3
    assert stair(10, 0.0) == pytest.approx(2e-3)


def test_bert_warmup_exp_decay_exp():
    s = fo.WarmupExpDecayExp(
        total_steps=1000, warmup_proportion=0.1, decay_rate=0.5, decay_steps=100
    )
    assert s(0, 2.0) == 0.0
    assert s(50, 2.0) == pytest.approx(2.0 * 0.25)
    assert s(300, 2.0) == pytest.approx(2.0 * 0.25)


def test_schedule_from_name():
    s = fo.schedule_from_name("warmuplr", {"warmup_max_lr": 0.5, "warmup_num_steps": 2})
    assert s(10, 0.0) == 0.5
    with pytest.raises(ValueError, match="allowed: WarmupLR"):
        fo.schedule_from_name("cosine", {})


def test_dynamic_loss_scale_hysteresis_and_window():
    scaler = fo.DynamicLossScale(initial_scale_power=4, window=3, hysteresis=2, min_scale=4.0)
    s = scaler.init()
    assert s == fo.LossScaleState(16.0, 2, 0, -1)
    s = scaler.update(s, True)  # first overflow absorbed by hysteresis
    assert (s.scale, s.hysteresis) == (16.0, 1)
    s = scaler.update(s, True)  # second halves the scale
    assert (s.scale, s.hysteresis) == (8.0, 1)
    for _ in range(3):
        s = scaler.update(s, False)
    assert s.scale == 8.0
    s = scaler.update(s, False)  # after a window of 3 good iterations: grow, restore hysteresis
    assert (s.scale, s.hysteresis) == (16.0, 2)
    for _ in range(6):
        s = scaler.update(s, True)
    assert s.scale == 4.0  # never below min_scale


def test_dynamic_loss_scale_grows_after_first_window():
    """DeepSpeed 0.19's rule: a clean step grows the scale when `window` clean steps came
    before it (`make test-deepspeed` steps DeepSpeed's `DynamicLossScaler` the same way)."""
    scaler = fo.DynamicLossScale(initial_scale_power=1, window=2)
    s = scaler.init()
    scales = []
    for _ in range(5):
        s = scaler.update(s, False)
        scales.append(s.scale)
    assert scales == [2.0, 2.0, 4.0, 4.0, 8.0]


def test_consecutive_hysteresis_restores_after_each_good_step():
    scaler = fo.DynamicLossScale(
        initial_scale_power=4, window=100, hysteresis=2, consecutive_hysteresis=True
    )
    s = scaler.update(scaler.init(), True)
    s = scaler.update(s, False)
    s = scaler.update(s, True)
    assert (s.scale, s.hysteresis) == (16.0, 1)


def test_static_loss_scale_never_changes():
    scaler = fo.StaticLossScale(128.0)
    s = scaler.update(scaler.init(), True)
    assert s.scale == 128.0 and not scaler.dynamic
