"""How a block computes while it trains: the frozen base's precision (`base_compute`: the modes, one file
each in `modes/`, applied to a model by `base_compute.py`), the LoRA adapters (`lora`), the blocks compiled
(`compile`) or recomputed in backward (`recompute`), residual adds made safe to differentiate
(`inplace_guard`), and the torch dtypes of the settings (`dtypes`). Nothing here knows a model family, a
device layout or a plan."""
