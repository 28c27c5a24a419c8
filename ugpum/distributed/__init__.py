"""Past one machine: the planner's stages on `torch.distributed.pipelining` ranks under torchrun,
with data-parallel replicas (README "Past one machine").

`stages.py`: one stage of a ComfyUI DiT as a module (embed + blocks on the first, blocks in the
middle, blocks + final layer on the last). `schedules.py`: which torch schedule runs the
micro-batches and which stages a rank holds (one, or two for interleaved 1F1B and zero bubble).
`run.py`: the distributed training loop, built from the single-process engine's pieces
(`ugpum.train.loop`), writing the same files. `forecast.py`: what a run would cost, before it runs.
"""
