"""Rectified-flow formulas, timestep samplers and the loss, checked numerically."""

import math

import pytest
import torch

from ugpum.diffusion.flow import (
    flow_loss,
    flux2_image_seq_len,
    flux2_mu,
    flux2_shift,
    loss_weight,
    noisy,
    sample_timesteps,
    shift_timesteps,
    target,
)


def tensors(batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 4, 3, 5, generator=g), torch.randn(batch, 4, 3, 5, generator=g)


# ---------------------------------------------------------------- noising and target


def test_noisy_endpoints_and_per_sample_mix():
    x0, noise = tensors()
    assert torch.equal(noisy(x0, noise, torch.zeros(2)), x0)
    assert torch.equal(noisy(x0, noise, torch.ones(2)), noise)
    mixed = noisy(x0, noise, torch.tensor([0.25, 0.75]))
    assert torch.allclose(mixed[0], 0.75 * x0[0] + 0.25 * noise[0])
    assert torch.allclose(mixed[1], 0.25 * x0[1] + 0.75 * noise[1])
    assert torch.allclose(noisy(x0, noise, 0.5), (x0 + noise) / 2)


def test_noisy_rejects_wrong_number_of_timesteps():
    x0, noise = tensors()
    with pytest.raises(ValueError, match="one value per sample"):
        noisy(x0, noise, torch.tensor([0.1, 0.2, 0.3]))


def test_target_is_the_time_derivative_of_noisy():
    x0, noise = (x.double() for x in tensors())
    t, h = torch.tensor([0.3, 0.6], dtype=torch.float64), 1e-6
    finite_difference = (noisy(x0, noise, t + h) - noisy(x0, noise, t - h)) / (2 * h)
    assert torch.allclose(finite_difference, target(x0, noise), atol=1e-8)
    assert torch.equal(target(x0, noise), noise - x0)


# ---------------------------------------------------------------- shift


def test_shift_values():
    t = torch.tensor([0.0, 0.25, 0.5, 1.0])
    assert torch.allclose(shift_timesteps(t, 3.0), torch.tensor([0.0, 0.5, 0.75, 1.0]))
    assert torch.allclose(shift_timesteps(t, 1.0), t)
    dense = torch.linspace(0, 1, 101)
    assert torch.all(torch.diff(shift_timesteps(dense, 5.0)) > 0)  # order kept
    with pytest.raises(ValueError, match="> 0"):
        shift_timesteps(t, 0.0)


def test_shift_equals_time_snr_form():
    t = torch.linspace(0.01, 0.99, 50, dtype=torch.float64)
    mu = 1.3
    snr_form = math.exp(mu) / (math.exp(mu) + (1 / t - 1))
    assert torch.allclose(shift_timesteps(t, math.exp(mu)), snr_form)


def test_flux2_image_seq_len():
    assert flux2_image_seq_len(1024, 1024) == 4096
    assert flux2_image_seq_len(768, 1360) == 48 * 85


def test_flux2_mu_reference_values():
    # Hand-evaluated from BFL's two lines (a1=8.73809524e-05, b1=1.89833333 at 10 steps;
    # a2=1.6927e-4, b2=0.45666666 at 200 steps) at 4096 tokens:
    at_200, at_10 = 1.6927e-4 * 4096 + 0.45666666, 8.73809524e-05 * 4096 + 1.89833333
    assert flux2_mu(4096, 200) == pytest.approx(at_200)
    assert flux2_mu(4096, 10) == pytest.approx(at_10)
    assert flux2_mu(4096, 50) == pytest.approx(at_10 + (at_200 - at_10) * 40 / 190)
    # ComfyUI's default FLUX.2 sampling shift (its mu) is 2.02: 1024x1024 at 50 steps.
    assert flux2_mu(4096, 50) == pytest.approx(2.02, abs=0.01)
    # past 4300 tokens only the 200-step line counts
    assert flux2_mu(8192, 4) == flux2_mu(8192, 50) == pytest.approx(1.6927e-4 * 8192 + 0.45666666)
    assert flux2_shift(4096, 50) == pytest.approx(math.exp(flux2_mu(4096, 50)))


def test_flux2_shift_grows_with_resolution_at_many_steps():
    shifts = [flux2_shift(flux2_image_seq_len(s, s), 200) for s in (256, 512, 1024, 2048)]
    assert shifts == sorted(shifts) and shifts[0] < shifts[-1]


def test_flux2_mu_rejects_nonsense():
    with pytest.raises(ValueError):
        flux2_mu(0)


# ---------------------------------------------------------------- sampling


@pytest.mark.parametrize("method", ["uniform", "logit_normal", "sigmoid", "shift", "flux2", "flux2_shift"])
def test_samples_lie_in_unit_interval(method):
    g = torch.Generator().manual_seed(0)
    t = sample_timesteps(10000, method, g, image_seq_len=4096)
    assert t.shape == (10000,) and t.dtype == torch.float32
    assert t.min() >= 0 and t.max() <= 1


def test_sampler_distributions():
    def draw(method, **kw):
        return sample_timesteps(50000, method, torch.Generator().manual_seed(1), **kw)

    uniform = draw("uniform")
    assert abs(uniform.mean() - 0.5) < 0.01 and abs(uniform.std() - math.sqrt(1 / 12)) < 0.01
    logit = draw("logit_normal")
    assert abs(logit.median() - 0.5) < 0.01
    assert logit.std() < uniform.std()  # concentrated in the middle
    assert abs(draw("logit_normal", logit_mean=1.0).median() - 1 / (1 + math.exp(-1))) < 0.01
    shifted = draw("shift", shift=3.0)
    assert shifted.mean() > logit.mean() + 0.1
    assert draw("shift", shift=6.0).mean() > shifted.mean()
    assert draw("shift", shift=3.0, base="uniform").mean() > uniform.mean() + 0.1
    small = draw("flux2", image_seq_len=256, num_steps=200)
    large = draw("flux2", image_seq_len=8192)
    assert large.mean() > small.mean() > logit.mean()


def test_flux2_shift_is_musubi_tuners_default_per_bucket():
    """musubi-tuner's FLUX.2 default: median sigma 0.76 and 2.3 % below 0.3 at 1024² (4096 tokens),
    against 0.88 and 0.2 % for BFL's sampling mu; a smaller bucket is shifted less."""
    def draw(method, tokens):
        return sample_timesteps(200_000, method, torch.Generator().manual_seed(5), image_seq_len=tokens)
    musubi, bfl = draw("flux2_shift", 4096), draw("flux2", 4096)
    assert abs(musubi.median() - 0.76) < 0.005 and abs((musubi < 0.3).float().mean() - 0.023) < 0.003
    assert abs(bfl.median() - 0.88) < 0.005 and (bfl < 0.3).float().mean() < 0.004
    assert abs(draw("flux2_shift", 1024).median() - 0.653) < 0.005         # 512²: mu 0.63, shift 1.88
    assert draw("sigmoid", 4096).median() == draw("logit_normal", 4096).median()
    with pytest.raises(ValueError, match="needs image_seq_len"):
        sample_timesteps(4, "flux2_shift")


def test_sampler_is_reproducible_with_a_seeded_generator():
    a = sample_timesteps(8, "flux2", torch.Generator().manual_seed(3), image_seq_len=4096)
    b = sample_timesteps(8, "flux2", torch.Generator().manual_seed(3), image_seq_len=4096)
    c = sample_timesteps(8, "flux2", torch.Generator().manual_seed(4), image_seq_len=4096)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_sampler_errors():
    with pytest.raises(ValueError, match="unknown timestep method 'sigma'"):
        sample_timesteps(4, "sigma")
    with pytest.raises(ValueError, match="image_seq_len"):
        sample_timesteps(4, "flux2")
    with pytest.raises(ValueError, match="base"):
        sample_timesteps(4, "shift", base="cosine")
    with pytest.raises(ValueError, match=">= 1"):
        sample_timesteps(0, "uniform")


# ---------------------------------------------------------------- weighting and loss


def test_loss_weights():
    t = torch.tensor([0.0, 0.25, 0.5, 1.0])
    assert torch.equal(loss_weight(t, "none"), torch.ones(4))
    sigma_sqrt = loss_weight(t, "sigma_sqrt")
    assert torch.allclose(sigma_sqrt[1:], torch.tensor([16.0, 4.0, 1.0]))
    assert sigma_sqrt[0] == pytest.approx(400.0)  # clamped, not infinite
    cosmap = loss_weight(t, "cosmap")
    assert cosmap[2] == pytest.approx(4 / math.pi) and cosmap[0] == pytest.approx(2 / math.pi)
    with pytest.raises(ValueError, match="unknown loss weighting 'snr'"):
        loss_weight(t, "snr")


def test_flow_loss_is_mse_to_velocity():
    x0, noise = tensors()
    t = torch.tensor([0.2, 0.9])
    assert flow_loss(noise - x0, x0, noise, t).item() == pytest.approx(0.0)
    pred = torch.zeros_like(x0)
    expected = ((noise - x0) ** 2).mean()
    assert flow_loss(pred, x0, noise, t).item() == pytest.approx(expected.item(), rel=1e-6)


def test_flow_loss_weights_each_sample():
    x0, noise = tensors()
    pred = torch.zeros_like(x0)
    t = torch.tensor([0.5, 0.25])
    per_sample = ((noise - x0) ** 2).flatten(1).mean(1)
    expected = (torch.tensor([4.0, 16.0]) * per_sample).mean()
    assert flow_loss(pred, x0, noise, t, "sigma_sqrt").item() == pytest.approx(expected.item(), rel=1e-6)


def test_flow_loss_is_float32_scalar_with_gradient_and_checks_shapes():
    x0, noise = tensors()
    pred = torch.zeros_like(x0, dtype=torch.bfloat16, requires_grad=True)
    loss = flow_loss(pred, x0.bfloat16(), noise.bfloat16(), torch.tensor([0.1, 0.2]))
    assert loss.ndim == 0 and loss.dtype == torch.float32
    loss.backward()
    assert pred.grad is not None and pred.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="one shape"):
        flow_loss(torch.zeros(2, 4), x0, noise, torch.zeros(2))
