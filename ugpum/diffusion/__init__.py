"""The diffusion math below training and preview: the flow-matching objective and timestep draws
(`flow.py`), ComfyUI's samplers for FLUX.2 and Wan (`flow_sampler.py`), and a prompt rendered on a
placed model (`render_prompt.py`)."""
