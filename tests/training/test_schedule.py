"""transformer/training/schedule.py: the paper's Adam and its learning-rate schedule (§5.3), against the formulas."""

import math

import pytest
import torch

from transformer.training.schedule import make_optimizer, make_scheduler, noam_lambda


def _noam(n, d_model, warmup, scale):
    return scale * d_model**-0.5 * min(n**-0.5, n * warmup**-1.5)


def test_lr_used_by_optimizer_follows_the_noam_formula():
    d_model, warmup, scale = 512, 4000, 2.0
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = make_optimizer([weight], fused=False)
    scheduler = make_scheduler(optimizer, d_model=d_model, warmup_steps=warmup, lr_scale=scale)
    seen = []  # the lr of each update, read when optimizer.step() runs
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(opt.param_groups[0]["lr"]))
    weight.grad = torch.ones(2)
    for _ in range(4001):
        optimizer.step()
        scheduler.step()
    for _ in range(4002, 100000):  # fast-forward the schedule alone to update 100000
        scheduler.step()
    optimizer.step()
    lr = dict(enumerate(seen[:4001], start=1)) | {100000: seen[-1]}
    for n in (1, 2, 100, 3999, 4000, 4001, 100000):
        assert lr[n] == pytest.approx(_noam(n, d_model, warmup, scale), rel=1e-12), n
    assert lr[1] == pytest.approx(scale * 512**-0.5 * 4000**-1.5)
    assert max(lr.values()) == lr[4000] == pytest.approx(scale * 512**-0.5 * 4000**-0.5)


def test_noam_lambda_indexes_updates_from_one():
    fn = noam_lambda(d_model=1024, warmup_steps=10, lr_scale=1.0)
    assert [fn(i) for i in (0, 9, 99)] == [pytest.approx(_noam(n, 1024, 10, 1.0)) for n in (1, 10, 100)]
    with pytest.raises(ValueError, match="warmup_steps"):
        noam_lambda(d_model=512, warmup_steps=0, lr_scale=1.0)


def test_schedule_resumes_from_state_dicts():
    def build():
        weight = torch.nn.Parameter(torch.ones(3))
        optimizer = make_optimizer([weight], fused=False)
        return weight, optimizer, make_scheduler(optimizer, d_model=64, warmup_steps=5, lr_scale=1.0)

    weight, optimizer, scheduler = build()
    for _ in range(7):
        weight.grad = torch.ones(3)
        optimizer.step()
        scheduler.step()
    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    weight2, optimizer2, scheduler2 = build()
    optimizer2.load_state_dict(state["optimizer"])
    scheduler2.load_state_dict(state["scheduler"])
    assert optimizer2.param_groups[0]["lr"] == pytest.approx(_noam(8, 64, 5, 1.0))
    scheduler.step()
    scheduler2.step()
    assert optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == pytest.approx(_noam(9, 64, 5, 1.0))


def test_optimizer_is_the_papers_adam():
    optimizer = make_optimizer([torch.nn.Parameter(torch.zeros(1))], fused=False)
    group = optimizer.param_groups[0]
    assert isinstance(optimizer, torch.optim.Adam)
    assert group["betas"] == (0.9, 0.98) and group["eps"] == 1e-9 and group["lr"] == 1.0
    assert group["weight_decay"] == 0


@pytest.mark.parametrize("fused", [True, False])
def test_adam_steps_follow_the_adam_formula(fused):
    """Two updates of both implementations against Adam written out (Kingma & Ba, bias-corrected)."""
    weight = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))
    optimizer = make_optimizer([weight], fused=fused)
    group = optimizer.param_groups[0]
    assert group["fused"] if fused else group["foreach"]  # fused Adam runs on CPU since torch 2.4
    for group in optimizer.param_groups:
        group["lr"] = 0.1
    value, m, v = [0.5, -1.0, 2.0], [0.0] * 3, [0.0] * 3
    for n, grad in enumerate(([0.3, -0.2, 1.0], [-0.1, 0.4, 0.5]), start=1):
        weight.grad = torch.tensor(grad)
        optimizer.step()
        for i, g in enumerate(grad):
            m[i] = 0.9 * m[i] + 0.1 * g
            v[i] = 0.98 * v[i] + 0.02 * g * g
            m_hat, v_hat = m[i] / (1 - 0.9**n), v[i] / (1 - 0.98**n)
            value[i] -= 0.1 * m_hat / (math.sqrt(v_hat) + 1e-9)
        assert weight.tolist() == pytest.approx(value, rel=1e-6)
