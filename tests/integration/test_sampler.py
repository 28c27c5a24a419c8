"""ugpum.diffusion.flow_sampler with the families' schedules and model functions (ugpum/arch/<family>/sampler.py)
against ComfyUI's own sampling (FLUX.2, Wan 2.1), and on its own.

What is compared with a ComfyUI present (packaged copy by default, or COMFYUI_PATH):

1. Sigmas, bit for bit: ``flux2_sigmas(schedule="simple")`` and ``wan_sigmas`` against
   ``comfy.samplers.calculate_sigmas(<model_sampling>, "simple", steps)`` on the
   ``model_sampling`` object that ComfyUI's own ``model_base.Flux2`` / ``model_base.WAN21`` builds
   from ``supported_models.Flux2`` / ``WAN21_T2V`` (shift 2.02 resp. 8.0) for 1..100 steps and
   more; ``flux2_sigmas(schedule="flux2")`` against the ``Flux2Scheduler`` node
   (``comfy_extras.nodes_flux``) over steps x resolutions.
2. The whole ComfyUI sampling path on a tiny FLUX.2 / Wan: the tiny diffusion module is put into
   ComfyUI's ``model_base.Flux2`` / ``WAN21`` (real model_config from ``supported_models``),
   wrapped in a ``ModelPatcher`` and sampled with ``comfy.samplers.KSampler`` ("euler",
   "simple"; for the Flux2Scheduler route ``KSampler.sample(sigmas=...)``): conditioning
   conversion, FLUX.2's 512-token text padding, guidance conds, CFG batching,
   ``sampling_function``/``cfg_function``, CONST noise scaling and denoised, ``sample_euler``,
   ``process_latent_out``. ComfyUI casts the latent to float32 for this path (and the model output
   with ``.float()``), so our sampler runs on the same float32 noise and the two latents are compared
   at float32 tolerance.
3. Float64, tight: the same ingredients without the float32 casts: ComfyUI's
   ``comfy.k_diffusion.sampling.sample_euler`` driven by a denoiser made of ComfyUI's
   ``model_sampling`` (``noise_scaling``, ``timestep``, ``calculate_denoised``), ComfyUI's
   ``cfg_function`` and the conds from ComfyUI's ``model_base.extra_conds`` (padded context,
   guidance), with ComfyUI's sigmas; ours runs with its own default sigmas. Agreement to 1e-12.
"""
from __future__ import annotations

import math

import pytest
import torch

from support import comfy_models as cm
from ugpum.arch.flux2 import sampler as FLUX2
from ugpum.arch.wan import sampler as WAN
from ugpum.diffusion import flow_sampler as S
from ugpum.diffusion.flow import flux2_mu

F64 = torch.float64


# ------------------------------------------------------------------------------------------
# Without ComfyUI
# ------------------------------------------------------------------------------------------

def _all_schedules(steps):
    return {
        "flux2 1024^2": FLUX2.flux2_sigmas(steps, 4096),
        "flux2 256^2": FLUX2.flux2_sigmas(steps, 256),
        "flux2 simple": FLUX2.flux2_sigmas(steps, schedule="simple"),
        "wan": WAN.wan_sigmas(steps),
        "wan shift 1": WAN.wan_sigmas(steps, shift=1.0),
    }


@pytest.mark.parametrize("steps", [1, 2, 4, 7, 20, 50])
def test_schedules_start_at_one_end_at_zero_and_decrease(steps):
    for name, s in _all_schedules(steps).items():
        assert s.dtype == torch.float32 and s.shape == (steps + 1,), name
        # 1 up to float32 rounding: ComfyUI's Flux2Scheduler gives e^mu * (1 / e^mu) = 1 - 2^-24
        # for some mu, and we reproduce its float32 values exactly
        assert abs(s[0].item() - 1.0) <= 2.0 ** -24 and s[-1].item() == 0.0, name
        assert bool((s[1:] < s[:-1]).all()), f"{name} not strictly decreasing: {s}"


def test_shift_one_is_the_plain_linear_schedule():
    assert torch.equal(WAN.wan_sigmas(4, shift=1.0), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))
    assert torch.allclose(FLUX2.flux2_sigmas(4, mu=0.0), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))


def test_shift_moves_steps_towards_high_noise():
    steps = 10
    linear = WAN.wan_sigmas(steps, shift=1.0)
    prev = linear
    for shift in (2.0, 5.0, 8.0):  # larger shift: every inner sigma higher
        s = WAN.wan_sigmas(steps, shift=shift)
        assert bool((s[1:-1] > prev[1:-1]).all()), shift
        prev = s
    wan = WAN.wan_sigmas(steps)
    assert (wan[1:-1] > 0.5).sum() > (linear[1:-1] > 0.5).sum()
    # FLUX.2: more image tokens -> larger mu -> more of the steps spent at high noise
    small, big = FLUX2.flux2_sigmas(steps, 256), FLUX2.flux2_sigmas(steps, 4096)
    assert flux2_mu(4096, steps) > flux2_mu(256, steps) > 0
    assert bool((small[1:-1] > linear[1:-1]).all()) and bool((big[1:-1] > small[1:-1]).all())
    # the model's own fixed shift (mu 2.02, factor e^2.02) equals the flow shift with that factor
    t = torch.linspace(1, 0, steps + 1, dtype=F64)[:-1]
    assert torch.allclose(FLUX2.flux_time_shift(t, 2.02), math.exp(2.02) * t / (1 + (math.exp(2.02) - 1) * t))


def test_flux2_model_shift_is_the_1024_50_step_flux2_schedule_shift():
    # ComfyUI's fixed FLUX.2 shift 2.02 is the resolution-dependent mu at 1024^2, 50 steps
    assert abs(flux2_mu(4096, 50) - FLUX2.FLUX2_SHIFT_MU) < 5e-3


def test_euler_lands_on_the_data_point_for_an_exact_velocity():
    # one data point x0: the exact velocity at (x, sigma) is (x - x0) / sigma; straight paths
    # make Euler exact for any sigmas
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 3, 4, 4, generator=g, dtype=F64)
    noise = torch.randn(2, 3, 4, 4, generator=g, dtype=F64)
    ctx = torch.zeros(2, 1, 1, dtype=F64)
    fn = lambda x, s, c: (x - x0) / s.view(-1, 1, 1, 1)  # noqa: E731
    for sig in (WAN.wan_sigmas(5), FLUX2.flux2_sigmas(3, 1024), FLUX2.flux2_sigmas(1, schedule="simple")):
        out = S.sample(fn, noise, ctx, sigmas=sig)
        assert torch.allclose(out, x0, atol=1e-12), sig


def test_cfg_mix_and_cfg_one_skips_the_negative_pass():
    calls = []
    a, b = 0.3, -0.7

    def fn(x, s, c):  # velocity = the context value
        calls.append(float(c.flatten()[0]))
        return torch.full_like(x, float(c.flatten()[0]))

    noise = torch.zeros(1, 2, 2, 2, dtype=F64)
    pos, neg = torch.full((1, 1, 1), a, dtype=F64), torch.full((1, 1, 1), b, dtype=F64)
    sig = WAN.wan_sigmas(4)
    out = S.sample(fn, noise, pos, neg, sigmas=sig, cfg=3.0)
    assert torch.allclose(out, torch.full_like(out, -(b + 3.0 * (a - b))))  # sum of dt = -1
    assert calls.count(b) == 4
    calls.clear()
    out = S.sample(fn, noise, pos, neg, sigmas=sig, cfg=1.0)
    assert calls == [a] * 4 and torch.allclose(out, torch.full_like(out, -a))


def test_sample_keeps_float32_state_for_low_precision_noise_and_reports_steps():
    seen = []
    noise = S.comfy_noise((1, 2, 2, 2), seed=3, dtype=torch.bfloat16)
    out = S.sample(lambda x, s, c: torch.zeros_like(x), noise, torch.zeros(1, 1, 1),
                   sigmas=WAN.wan_sigmas(3), callback=lambda i, sg, x: seen.append((i, sg)))
    assert out.dtype == torch.float32 and [i for i, _ in seen] == [0, 1, 2] and seen[0][1] == 1.0


def test_comfy_noise_is_seeded_normal():
    a, b = S.comfy_noise((1, 4, 8, 8), 7), S.comfy_noise((1, 4, 8, 8), 7)
    assert a.dtype == torch.float32 and torch.equal(a, b)
    assert not torch.equal(a, S.comfy_noise((1, 4, 8, 8), 8))
    torch.manual_seed(7)
    assert torch.equal(a, torch.randn(1, 4, 8, 8))  # what ComfyUI's prepare_noise draws


def test_errors():
    ctx = torch.zeros(1, 1, 1)
    fn = lambda x, s, c: x  # noqa: E731
    with pytest.raises(ValueError, match="negative"):
        S.sample(fn, torch.zeros(1, 1), ctx, sigmas=WAN.wan_sigmas(2), cfg=4.0)
    with pytest.raises(ValueError, match="sigmas or steps"):
        S.sample(fn, torch.zeros(1, 1), ctx)
    with pytest.raises(ValueError, match="no default schedule"):
        S.sample(fn, torch.zeros(1, 1), ctx, steps=4)
    with pytest.raises(ValueError, match="image_seq_len"):
        FLUX2.flux2_sigmas(4)
    with pytest.raises(ValueError, match="steps"):
        WAN.wan_sigmas(0)
    with pytest.raises(ValueError, match="schedule"):
        FLUX2.flux2_sigmas(4, 16, schedule="karras")


def test_defaults_table():
    d = FLUX2.SAMPLING_DEFAULTS
    assert (d["flux2-klein"].steps, d["flux2-klein"].cfg) == (4, 1.0)
    assert d["flux2-klein-base"].cfg > 1 and d["flux2-klein-base"].steps >= 28
    assert d["flux2-dev"].cfg == 1.0 and d["flux2-dev"].guidance == 4.0


# ------------------------------------------------------------------------------------------
# With ComfyUI
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def comfy(comfy):
    """The shared `comfy` fixture (conftest.py), with ComfyUI's sampling modules imported."""
    import comfy.k_diffusion.sampling  # noqa: F401
    import comfy.model_base  # noqa: F401
    import comfy.model_patcher  # noqa: F401
    import comfy.model_sampling  # noqa: F401
    import comfy.samplers  # noqa: F401
    import comfy.supported_models  # noqa: F401
    return comfy


def _tiny_flux2(guidance=False, seed=0):
    # small on purpose: ComfyUI pads FLUX.2 text to 512 tokens, so every call sees 512 + h*w tokens
    return cm.build_tiny_flux2(depth=1, depth_single=1, hidden=32, heads=1, context_dim=16,
                               guidance=guidance, seed=seed)


def _tiny_wan(seed=0):
    return cm.build_tiny_wan(dim=32, heads=1, ffn_dim=64, num_layers=1, text_dim=16, seed=seed)


def _model_base(comfy, kind, dm):
    """ComfyUI's own BaseModel (model_sampling, conds, latent format from supported_models) around
    our tiny diffusion module; ComfyUI builds the same module class itself when loading a file."""
    if kind == "flux2":
        config = comfy.supported_models.Flux2({
            "image_model": "flux2", "disable_unet_model_creation": True, "in_channels": 128,
            "out_channels": 128, "patch_size": 1, "hidden_size": dm.hidden_size,
            "guidance_embed": dm.params.guidance_embed})
        base = comfy.model_base.Flux2(config, device=torch.device("cpu"))
    else:
        config = comfy.supported_models.WAN21_T2V({
            "image_model": "wan2.1", "model_type": "t2v", "disable_unet_model_creation": True,
            "dim": dm.dim, "in_dim": dm.in_dim, "out_dim": dm.out_dim})
        base = comfy.model_base.WAN21(config, device=torch.device("cpu"))
    base.diffusion_model = dm
    return base


def _patcher(comfy, base):
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(base, load_device=cpu, offload_device=cpu)


def _cond(ctx, guidance=None):
    extra = {"pooled_output": None}  # ComfyUI 0.3.75's Flux.encode_adm reads this key
    if guidance is not None:
        extra["guidance"] = guidance
    return [[ctx, extra]]


def test_sigmas_bit_identical_to_comfyui(comfy):
    flux_ms = _model_base(comfy, "flux2", _tiny_flux2()).model_sampling
    wan_ms = _model_base(comfy, "wan", _tiny_wan()).model_sampling
    assert isinstance(flux_ms, comfy.model_sampling.ModelSamplingFlux) and flux_ms.shift == FLUX2.FLUX2_SHIFT_MU
    assert isinstance(wan_ms, comfy.model_sampling.ModelSamplingDiscreteFlow)
    assert (wan_ms.shift, wan_ms.multiplier) == (WAN.WAN21_SHIFT, WAN.WAN21_MULTIPLIER)
    for steps in list(range(1, 101)) + [150, 333, 1000]:
        assert torch.equal(comfy.samplers.calculate_sigmas(flux_ms, "simple", steps),
                           FLUX2.flux2_sigmas(steps, schedule="simple")), steps
        assert torch.equal(comfy.samplers.calculate_sigmas(wan_ms, "simple", steps), WAN.wan_sigmas(steps)), steps
    import comfy_extras.nodes_flux as nodes_flux
    for steps in (1, 4, 20, 28, 50, 100):
        for w, h in ((64, 64), (512, 512), (768, 512), (1024, 1024), (1360, 768), (2048, 2048)):
            theirs = nodes_flux.Flux2Scheduler.execute(steps, w, h).args[0]
            ours = FLUX2.flux2_sigmas(steps, (h // 16) * (w // 16))
            assert theirs.dtype == ours.dtype and torch.equal(theirs, ours), (steps, w, h)


FLUX2_CASES = {
    # name: (guidance_embed, steps, cfg, guidance, schedule)
    "klein-distilled": (False, 4, 1.0, None, "flux2"),
    "klein-base": (False, 3, 4.0, None, "simple"),
    "dev": (True, 3, 1.0, 4.0, "simple"),
}


@pytest.mark.parametrize("case", list(FLUX2_CASES))
def test_flux2_matches_comfyui_ksampler(comfy, case):
    guidance_embed, steps, cfg, guidance, schedule = FLUX2_CASES[case]
    dm = _tiny_flux2(guidance=guidance_embed)
    base = _model_base(comfy, "flux2", dm)
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(1, 128, 4, 6, generator=g)  # float32, as ComfyUI samples
    pos = torch.randn(1, 7, dm.params.context_in_dim, generator=g, dtype=F64)
    neg = torch.randn(1, 5, dm.params.context_in_dim, generator=g, dtype=F64)
    ks = comfy.samplers.KSampler(_patcher(comfy, base), steps=steps, device=torch.device("cpu"),
                                 sampler="euler", scheduler="simple", model_options={})
    sigmas = None
    if schedule == "flux2":  # ComfyUI's FLUX.2 workflows: Flux2Scheduler -> custom sigmas
        import comfy_extras.nodes_flux as nodes_flux
        sigmas = nodes_flux.Flux2Scheduler.execute(steps, 6 * 16, 4 * 16).args[0]
    theirs = ks.sample(noise.clone(), _cond(pos, guidance), _cond(neg, guidance), cfg=cfg,
                       latent_image=torch.zeros_like(noise), sigmas=sigmas, disable_pbar=True, seed=0)
    fn = FLUX2.flux2_model_fn(dm, guidance=guidance, schedule=schedule)
    ours = S.sample(fn, noise, pos, neg if cfg != 1 else None, steps=steps, cfg=cfg)
    ours = base.latent_format.process_out(ours)  # identity for FLUX.2
    assert ours.dtype == theirs.dtype == torch.float32
    assert theirs.abs().max() > 0.1
    torch.testing.assert_close(ours, theirs, rtol=2e-5, atol=2e-5)


def test_wan_matches_comfyui_ksampler(comfy):
    dm = _tiny_wan()
    base = _model_base(comfy, "wan", dm)
    g = torch.Generator().manual_seed(2)
    noise = torch.randn(1, 16, 2, 4, 4, generator=g)
    pos = torch.randn(1, 6, dm.text_dim, generator=g, dtype=F64)
    neg = torch.randn(1, 6, dm.text_dim, generator=g, dtype=F64)
    steps, cfg = 4, 6.0
    ks = comfy.samplers.KSampler(_patcher(comfy, base), steps=steps, device=torch.device("cpu"),
                                 sampler="euler", scheduler="simple", model_options={})
    theirs = ks.sample(noise.clone(), _cond(pos), _cond(neg), cfg=cfg,
                       latent_image=torch.zeros_like(noise), disable_pbar=True, seed=0)
    ours = S.sample(WAN.wan_model_fn(dm), noise, pos, neg, steps=steps, cfg=cfg)
    ours = base.latent_format.process_out(ours)  # KSampler returns process_latent_out(x)
    assert theirs.abs().max() > 0.1
    torch.testing.assert_close(ours, theirs, rtol=2e-5, atol=2e-5)


def _comfy_float64_reference(comfy, base, noise, sigmas, pos, neg, cfg, guidance=None):
    """ComfyUI's Euler + CFG + CONST parametrisation in float64 (no float32 casts)."""
    ms, dm = base.model_sampling, base.diffusion_model
    b = noise.shape[0]

    def conds(ctx):
        c = base.extra_conds(cross_attn=ctx, noise=noise, device=noise.device, pooled_output=None,
                             **({} if guidance is None else {"guidance": guidance}))
        kw = {"context": c["c_crossattn"].cond.to(F64).expand(b, -1, -1)}
        if guidance is not None and dm.params.guidance_embed:
            kw["guidance"] = c["guidance"].cond.to(F64).expand(b)
        return kw

    kw_pos, kw_neg = conds(pos), (conds(neg) if neg is not None else None)

    def denoised(x, sigma, kw):
        out = dm(x, ms.timestep(sigma).float(), transformer_options={}, **kw)
        return ms.calculate_denoised(sigma, out, x)

    def denoiser(x, sigma):
        d_pos = denoised(x, sigma, kw_pos)
        if kw_neg is None:
            return d_pos
        return comfy.samplers.cfg_function(None, d_pos, denoised(x, sigma, kw_neg), cfg, x, sigma, model_options={})

    x = ms.noise_scaling(sigmas[0].to(F64), noise, torch.zeros_like(noise))
    return comfy.k_diffusion.sampling.sample_euler(denoiser, x, sigmas.to(F64), disable=True)


def test_float64_euler_cfg_timestep_match_comfyui(comfy):
    g = torch.Generator().manual_seed(3)
    # klein base with CFG, on the model's 'simple' sigmas
    dm = _tiny_flux2()
    base = _model_base(comfy, "flux2", dm)
    noise = torch.randn(2, 128, 3, 4, generator=g, dtype=F64)
    pos = torch.randn(2, 7, dm.params.context_in_dim, generator=g, dtype=F64)
    neg = torch.randn(1, 3, dm.params.context_in_dim, generator=g, dtype=F64)
    sig = comfy.samplers.calculate_sigmas(base.model_sampling, "simple", 3)
    theirs = _comfy_float64_reference(comfy, base, noise, sig, pos, neg.expand(2, -1, -1), 4.0)
    ours = S.sample(FLUX2.flux2_model_fn(dm, schedule="simple"), noise, pos, neg, steps=3, cfg=4.0)
    assert ours.dtype == F64
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    # FLUX.2 dev: guidance embedder, no CFG
    dm = _tiny_flux2(guidance=True, seed=1)
    base = _model_base(comfy, "flux2", dm)
    theirs = _comfy_float64_reference(comfy, base, noise, sig, pos, None, 1.0, guidance=4.0)
    fn = FLUX2.flux2_model_fn(dm, schedule="simple")  # guidance 4 by default for dev
    ours = S.sample(fn, noise, pos, steps=3)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    half = torch.full((2,), 0.5, dtype=F64)
    v2 = FLUX2.flux2_model_fn(dm, guidance=2.0)(noise, half, pos)
    assert (v2 - fn(noise, half, pos)).abs().max() > 1e-6  # guidance reaches the model
    # Wan 2.1 with CFG: timestep = 1000 sigma, shift 8
    dm = _tiny_wan()
    base = _model_base(comfy, "wan", dm)
    noise = torch.randn(1, 16, 2, 4, 4, generator=g, dtype=F64)
    pos = torch.randn(1, 6, dm.text_dim, generator=g, dtype=F64)
    neg = torch.randn(1, 6, dm.text_dim, generator=g, dtype=F64)
    sig = comfy.samplers.calculate_sigmas(base.model_sampling, "simple", 4)
    theirs = _comfy_float64_reference(comfy, base, noise, sig, pos, neg, 6.0)
    ours = S.sample(WAN.wan_model_fn(dm), noise, pos, neg, steps=4, cfg=6.0)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
