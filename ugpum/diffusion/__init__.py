"""The diffusion math below training and preview: the flow-matching objective and timestep draws
(`flow.py`) and ComfyUI's Euler sampler (`flow_sampler.py`; each family's sigmas and model function are in
its folder, ugpum/arch/<family>/sampler.py); a prompt rendered through a model is `ugpum.render.prompt`'s."""
