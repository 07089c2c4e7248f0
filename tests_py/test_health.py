"""Training health monitoring: metric values against float64 references written
from the definitions, collapse/explosion/throughput alerts, non-finite steps,
the lesson's dict API, and no host synchronisation in observe()."""

import logging
import math

import pytest
import torch
from dino_opt.config import Config, ConfigError, default_config
from dino_opt.observe import (
    HealthAlert,
    HealthThresholds,
    NonFiniteError,
    TrainingHealthMonitor,
    step_is_finite,
)

# ---------------------------------------------------------------------------
# float64 references, from the definitions
# ---------------------------------------------------------------------------


def softmax64(z):
    z = z.double()
    e = torch.exp(z - z.max(dim=-1, keepdim=True).values)
    return e / e.sum(dim=-1, keepdim=True)


def entropy64(p):
    # -sum p log p, with 0 log 0 = 0
    safe = torch.where(p > 0, p, torch.ones_like(p))
    return -(p * torch.log(safe)).sum(dim=-1)


def reference_teacher(teacher, student, teacher_temp, student_temp, center):
    k = teacher.shape[1]
    p = softmax64((teacher.double() - center.double().reshape(1, k)) / teacher_temp)
    q = softmax64(student.double() / student_temp)
    h = entropy64(p).mean().item()
    h_mean = entropy64(p.mean(dim=0)).item()
    safe = torch.where(p > 0, p, torch.ones_like(p))
    kl = (p * (torch.log(safe) - torch.log(q))).sum(dim=-1).mean().item()
    return {
        "teacher_entropy": h,
        "teacher_entropy_normalised": h / math.log(k),
        "teacher_mean_entropy": h_mean,
        "teacher_mean_entropy_normalised": h_mean / math.log(k),
        "kl_teacher_student": kl,
    }


def reference_feature_std(features):
    f = features.double()
    f = f / f.norm(dim=1, keepdim=True)
    mean = f.mean(dim=0)
    std = ((f - mean) ** 2).mean(dim=0).sqrt().mean().item()
    return std, std * math.sqrt(f.shape[1])


def random_inputs(gen, n_images=None, k=None):
    n_images = n_images or int(torch.randint(8, 33, (1,), generator=gen))
    k = k or int(torch.randint(64, 513, (1,), generator=gen))
    n = 2 * n_images  # two global views
    return {
        "teacher_logits": torch.randn(n, k, generator=gen) * 2,
        "student_logits": torch.randn(n, k, generator=gen) * 2,
        "teacher_temp": float(torch.empty(1).uniform_(0.03, 0.08, generator=gen)),
        "student_temp": float(torch.empty(1).uniform_(0.08, 0.2, generator=gen)),
        "center": torch.randn(1, k, generator=gen) * 0.5,
        "features": torch.randn(n_images, 48, generator=gen),
    }


def names(alerts):
    return {a.name for a in alerts}


# ---------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------


def test_teacher_metrics_match_float64_reference(gen):
    monitor = TrainingHealthMonitor()
    steps = [random_inputs(gen, k=300) for _ in range(3)]
    refs = []
    for x in steps:
        monitor.observe(**x)
        refs.append(
            reference_teacher(
                x["teacher_logits"],
                x["student_logits"],
                x["teacher_temp"],
                x["student_temp"],
                x["center"],
            )
        )
    s = monitor.summary()
    for key in refs[0]:
        expected = sum(r[key] for r in refs) / len(refs)
        assert s[key] == pytest.approx(expected, rel=1e-4, abs=1e-5), key
    assert s["observations"] == 3
    # A new window: nothing observed since.
    s = monitor.summary()
    assert "teacher_entropy" not in s and s["observations"] == 0


def test_kl_is_zero_for_identical_distributions_and_uses_first_rows(gen):
    x = random_inputs(gen)
    t = x["teacher_logits"]
    n = t.shape[0]
    # A student whose first n rows give exactly the teacher's distribution
    # (same tempered logits, no center); the rest is noise that must be ignored.
    student = torch.cat([t * (0.1 / 0.05), torch.randn(3 * n, t.shape[1], generator=gen) * 9])
    monitor = TrainingHealthMonitor()
    monitor.observe(teacher_logits=t, student_logits=student, teacher_temp=0.05, student_temp=0.1)
    assert monitor.summary()["kl_teacher_student"] == pytest.approx(0.0, abs=1e-5)
    # and a different student is > 0, equal to the reference on the first rows
    other = torch.randn(4 * n, t.shape[1], generator=gen)
    monitor.observe(teacher_logits=t, student_logits=other, teacher_temp=0.05, student_temp=0.1)
    ref = reference_teacher(t, other[:n], 0.05, 0.1, torch.zeros(t.shape[1]))
    assert monitor.summary()["kl_teacher_student"] == pytest.approx(
        ref["kl_teacher_student"], rel=1e-4
    )
    with pytest.raises(ValueError, match="student_logits must be"):
        monitor.observe(teacher_logits=t, student_logits=other[:-1], teacher_temp=0.05)


def test_feature_std_matches_reference_and_is_zero_for_a_constant(gen):
    monitor = TrainingHealthMonitor()
    feats = torch.randn(24, 96, generator=gen) * 3 + torch.randn(96, generator=gen)
    monitor.observe(features=feats)
    s = monitor.summary()
    std, std_norm = reference_feature_std(feats)
    assert s["feature_std"] == pytest.approx(std, rel=1e-4)
    assert s["feature_std_normalised"] == pytest.approx(std_norm, rel=1e-4)
    # Scaled copies of one vector normalise to the same point: no diversity.
    row = torch.randn(96, generator=gen)
    monitor.observe(features=row * torch.rand(24, 1, generator=gen).add(0.5))
    s = monitor.summary()
    assert s["feature_std"] == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="at least 2 rows"):
        monitor.observe(features=row[None])


def test_bad_arguments_are_named():
    monitor = TrainingHealthMonitor()
    t = torch.randn(4, 8)
    with pytest.raises(ValueError, match="teacher_temp"):
        monitor.observe(teacher_logits=t)
    with pytest.raises(ValueError, match="teacher_temp must be a number > 0"):
        monitor.observe(teacher_logits=t, teacher_temp=0)
    with pytest.raises(ValueError, match=r"center must be \[8\] or \[1, 8\]"):
        monitor.observe(teacher_logits=t, teacher_temp=0.04, center=torch.zeros(7))
    with pytest.raises(ValueError, match=r"teacher_logits must be \[rows, out_dim\]"):
        monitor.observe(teacher_logits=torch.randn(8), teacher_temp=0.04)
    with pytest.raises(ValueError, match="loss must be a scalar"):
        monitor.observe(loss=torch.ones(3))
    with pytest.raises(ValueError, match="unknown health threshold"):
        TrainingHealthMonitor({"grad_norm_maxx": 3})
    with pytest.raises(ValueError, match="entropy_uniform_max must be in"):
        HealthThresholds(entropy_uniform_max=1.5)


# ---------------------------------------------------------------------------
# Alerts from observed tensors
# ---------------------------------------------------------------------------


def healthy_step(gen, n_images=32, k=256):
    t = torch.randn(2 * n_images, k, generator=gen)
    return {
        "teacher_logits": t,
        "student_logits": t + torch.randn(2 * n_images, k, generator=gen),
        "teacher_temp": 0.04,
        "center": t.mean(dim=0, keepdim=True),
        "features": torch.randn(n_images, 64, generator=gen),
        "grad_norm": torch.tensor(1.5),
        "loss": torch.tensor(5.0),
        "throughput": 100.0,
    }


def test_healthy_training_gives_no_alert(gen):
    monitor = TrainingHealthMonitor()
    for _ in range(3):
        monitor.observe(**healthy_step(gen))
    assert monitor.check_training_health() == []


def test_constant_features_trigger_constant_collapse(gen, caplog):
    monitor = TrainingHealthMonitor()
    step = healthy_step(gen)
    step["features"] = torch.randn(1, 64, generator=gen).expand(32, 64)
    monitor.observe(**step)
    with caplog.at_level(logging.WARNING, logger="dino_opt.observe.health"):
        alerts = monitor.check_training_health()
    assert names(alerts) == {"collapse_constant"}
    (a,) = alerts
    assert isinstance(a, HealthAlert) and a.severity == "error"
    assert a.value == pytest.approx(0.0, abs=1e-5) and a.threshold == 0.1
    assert any(
        r.name == "dino_opt.observe.health" and "collapse_constant" in r.message
        for r in caplog.records
    )


def test_uniform_teacher_triggers_uniform_collapse(gen):
    monitor = TrainingHealthMonitor()
    step = healthy_step(gen)
    # Logits far smaller than the temperature: a nearly uniform teacher.
    step["teacher_logits"] = torch.randn(64, 256, generator=gen) * 1e-4
    step["center"] = None
    monitor.observe(**step)
    alerts = monitor.check_training_health()
    assert names(alerts) == {"collapse_uniform"}
    assert alerts[0].value > 0.999


def test_one_dominant_dimension_triggers_dominant_collapse(gen):
    monitor = TrainingHealthMonitor()
    step = healthy_step(gen)
    t = torch.randn(64, 256, generator=gen)
    t[:, 17] += 5.0  # every row puts its mass on prototype 17
    step["teacher_logits"], step["center"] = t, None
    monitor.observe(**step)
    assert names(monitor.check_training_health()) == {"collapse_dominant"}


def test_gradient_explosion_from_observed_grad_norm(gen):
    monitor = TrainingHealthMonitor({"grad_norm_max": 5.0})
    step = healthy_step(gen)
    step["grad_norm"] = torch.tensor(7.0)
    monitor.observe(**step)
    alerts = monitor.check_training_health()
    assert names(alerts) == {"gradient_explosion"}
    assert (alerts[0].value, alerts[0].threshold, alerts[0].severity) == (7.0, 5.0, "warning")


# ---------------------------------------------------------------------------
# Non-finite steps
# ---------------------------------------------------------------------------


def test_step_is_finite():
    nan, inf = float("nan"), float("inf")
    for loss, grad, expected in [
        (1.0, 2.0, True),
        (nan, 2.0, False),
        (1.0, inf, False),
        (torch.tensor(1.0), None, True),
        (None, torch.tensor(-inf), False),
        (torch.tensor([1.0, nan]), torch.tensor(1.0), False),
    ]:
        ok = step_is_finite(loss, grad)
        assert isinstance(ok, torch.Tensor) and ok.dtype == torch.bool and ok.dim() == 0
        assert bool(ok) is expected, (loss, grad)
    with pytest.raises(ValueError):
        step_is_finite(None, None)


def test_nan_loss_is_counted_and_too_many_in_a_row_raise(caplog):
    monitor = TrainingHealthMonitor(max_nonfinite_steps=3)
    monitor.observe(loss=torch.tensor(2.0), grad_norm=torch.tensor(1.0))  # step 0
    for _ in range(3):  # steps 1-3
        monitor.observe(loss=torch.tensor(float("nan")), grad_norm=torch.tensor(1.0))
    with caplog.at_level(logging.WARNING, logger="dino_opt.observe.health"):
        alerts = monitor.check_training_health()  # 3 in a row: tolerated
    assert names(alerts) == {"nonfinite"}
    assert alerts[0].value == 3 and alerts[0].severity == "warning"
    assert "nonfinite" in caplog.text
    monitor.observe(loss=torch.tensor(float("nan")))  # step 4: the 4th in a row
    with pytest.raises(NonFiniteError) as e:
        monitor.check_training_health()
    err = e.value
    assert (err.consecutive, err.first_step, err.last_step, err.limit) == (4, 1, 4, 3)
    msg = str(err)
    assert "4 consecutive non-finite steps" in msg and "steps 1-4" in msg
    assert "learning rate" in msg and "bf16" in msg


def test_finite_step_ends_the_run_and_loss_mean_skips_nan():
    monitor = TrainingHealthMonitor(max_nonfinite_steps=3)
    nan = torch.tensor(float("nan"))
    for loss in [nan, nan, nan, torch.tensor(4.0), nan, nan, nan, torch.tensor(2.0)]:
        monitor.observe(loss=loss, grad_norm=torch.tensor(float("inf")) if loss is nan else 1.0)
    s = monitor.summary()
    assert s["nonfinite_steps"] == 6 and s["nonfinite_streak_max"] == 3
    assert s["nonfinite_streak"] == 0
    assert s["loss"] == pytest.approx(3.0)  # the finite losses only
    assert s["grad_norm"] == pytest.approx(1.0) and s["grad_norm_max"] == pytest.approx(1.0)
    # Each run of 3 is tolerated.
    monitor.observe(loss=nan)
    monitor.observe(loss=1.0)
    assert names(monitor.check_training_health()) == {"nonfinite"}


def test_record_nonfinite_with_device_counts_and_across_windows():
    monitor = TrainingHealthMonitor(max_nonfinite_steps=2)
    ok = step_is_finite(torch.tensor(float("nan")), torch.tensor(1.0))
    monitor.record_nonfinite((~ok).int(), step=10)
    monitor.record_nonfinite(1, step=11)
    assert names(monitor.check_training_health()) == {"nonfinite"}  # 2 in a row
    monitor.record_nonfinite(1, step=12)  # the run goes on in the next window
    with pytest.raises(NonFiniteError, match="3 consecutive.*steps 10-12"):
        monitor.check_training_health()
    monitor.record_nonfinite(0, step=13)  # a finite step ends it
    assert monitor.check_training_health() == []
    with pytest.raises(ValueError, match="count must be"):
        monitor.record_nonfinite(-1)


# ---------------------------------------------------------------------------
# The lesson's dict API and the thresholds
# ---------------------------------------------------------------------------


def test_lesson_dict_gives_the_three_alerts(caplog):
    monitor = TrainingHealthMonitor(throughput_baseline=100)
    with caplog.at_level(logging.WARNING, logger="dino_opt.observe.health"):
        alerts = monitor.check_training_health(
            {"feature_diversity": 0.05, "grad_norm": 20.0, "throughput": 50}
        )
    by_name = {a.name: a for a in alerts}
    assert set(by_name) == {"collapse_constant", "gradient_explosion", "throughput_degradation"}
    assert (by_name["collapse_constant"].value, by_name["collapse_constant"].threshold) == (
        0.05,
        0.1,
    )
    assert by_name["gradient_explosion"].threshold == 10.0
    assert by_name["throughput_degradation"].threshold == pytest.approx(80.0)
    assert len([r for r in caplog.records if r.name == "dino_opt.observe.health"]) == 3
    assert monitor.last_alerts == alerts
    healthy = {"feature_diversity": 0.5, "grad_norm": 2.0, "throughput": torch.tensor(95.0)}
    assert monitor.check_training_health(healthy) == []


def test_throughput_first_window_against_last_window_and_nan_loss_in_a_dict():
    # Without a baseline, the profiler's PerformanceMonitor rule: the mean of
    # the last 2 values against the mean of the first 2, after 4 values.
    monitor = TrainingHealthMonitor({"throughput_window": 2})
    for value in (210.0, 190.0, 120.0, 200.0, 150.0):  # a dip inside the window is fine
        assert monitor.check_training_health({"throughput": value}) == []
    assert monitor.throughput_baseline is None
    (a,) = monitor.check_training_health({"throughput": 140.0})  # last two: 145 < 0.8 x 200
    assert a.name == "throughput_degradation" and a.threshold == pytest.approx(160.0)
    assert a.value == pytest.approx(145.0)
    (a,) = monitor.check_training_health({"loss": float("nan"), "grad_norm": 1.0})
    assert a.name == "nonfinite" and a.severity == "error"
    with pytest.raises(NonFiniteError, match="25 consecutive"):
        monitor.check_training_health({"nonfinite_streak": 25})


def test_thresholds_from_config():
    assert HealthThresholds.from_config(default_config().health) == HealthThresholds()
    assert HealthThresholds.from_config(default_config()) == HealthThresholds()
    cfg = Config.from_dict({"health": {"grad_norm_max": 3, "max_nonfinite_steps": 5}})
    th = HealthThresholds.from_config(cfg.health)
    assert (th.grad_norm_max, th.max_nonfinite_steps) == (3.0, 5)
    assert cfg.health.enabled is True
    monitor = TrainingHealthMonitor(th, max_nonfinite_steps=7)
    assert monitor.max_nonfinite_steps == 7 and monitor.thresholds.grad_norm_max == 3.0
    with pytest.raises(ConfigError, match=r"health.entropy_uniform_max must be in \[0, 1\]"):
        Config.from_dict({"health": {"entropy_uniform_max": 1.5}})
    with pytest.raises(ConfigError, match="health.max_nonfinite_steps must be >= 0"):
        Config.from_dict({"health": {"max_nonfinite_steps": -1}})


# ---------------------------------------------------------------------------
# No host synchronisation
# ---------------------------------------------------------------------------


class _Synced(AssertionError):
    pass


def _forbid_host_reads(monkeypatch):
    def fail(name):
        def method(self, *args, **kwargs):
            raise _Synced(f"Tensor.{name} called")

        return method

    for name in ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, fail(name))


def test_observe_reads_no_tensor_value_on_the_host(gen, monkeypatch):
    monitor = TrainingHealthMonitor()
    steps = [healthy_step(gen) for _ in range(3)]
    steps[1]["loss"] = torch.tensor(float("nan"))
    with monkeypatch.context() as m:
        _forbid_host_reads(m)
        for i, step in enumerate(steps):
            monitor.observe(**step, step=i)
        monitor.record_nonfinite(step_is_finite(steps[0]["loss"]).logical_not().int())
        # The guard works: reading the results does read values.
        with pytest.raises(_Synced):
            monitor.summary()
    s = monitor.summary()
    assert s["nonfinite_steps"] == 1 and s["observations"] == 3


def test_summary_is_one_host_transfer(gen, monkeypatch):
    monitor = TrainingHealthMonitor()
    monitor.observe(**healthy_step(gen))
    calls = []
    tolist = torch.Tensor.tolist

    def counting_tolist(self):
        calls.append(self.shape)
        return tolist(self)

    with monkeypatch.context() as m:
        _forbid_host_reads(m)
        m.setattr(torch.Tensor, "tolist", counting_tolist)
        s = monitor.summary()
    assert len(calls) == 1 and "teacher_entropy" in s


@pytest.mark.cuda
def test_observe_does_not_synchronise_on_cuda(gen):
    device = torch.device("cuda")
    monitor = TrainingHealthMonitor()
    steps = []
    for _ in range(3):
        step = healthy_step(gen)
        steps.append(
            {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in step.items()}
        )
    monitor.observe(**steps[0])  # first call allocates the sums
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in steps[1:]:
            monitor.observe(**step)
            monitor.record_nonfinite((~step_is_finite(step["loss"], step["grad_norm"])).int())
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    s = monitor.summary()
    assert s["observations"] == 3 and s["nonfinite_steps"] == 0
    cpu = TrainingHealthMonitor()
    for step in steps:
        cpu.observe(**{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in step.items()})
    ref = cpu.summary()
    for key in ("teacher_entropy", "kl_teacher_student", "feature_std", "grad_norm"):
        assert s[key] == pytest.approx(ref[key], rel=1e-4), key
