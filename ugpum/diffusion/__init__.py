"""The diffusion math below training and preview: the flow-matching objective and timestep draws
(`flow.py`) and ComfyUI's samplers for FLUX.2 and Wan (`flow_sampler.py`); a prompt rendered through a
model is `ugpum.render.prompt`'s."""
