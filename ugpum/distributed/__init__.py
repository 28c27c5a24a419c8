"""Past one machine: the planner's stages on `torch.distributed.pipelining` ranks under torchrun,
with data-parallel replicas (README "Past one machine").

`stepper.py`: the distributed engine the one training loop (`ugpum.train.loop.train`) drives, writing
the same files as one process. `topology.py`: ranks and process groups. `stages.py`: a rank's stages,
each a ComfyUI DiT's blocks as a module (embed + blocks on the first, blocks in the middle, blocks +
final layer on the last; the glue is the family's, ugpum/arch/<family>/stage.py). `stage_lora.py`: a
stage's LoRA and the whole LoRA on the saving rank. `schedule_run.py`: a step's micro-batches through
torch's schedules, gradients summed in order. `schedules.py`: which torch schedule class runs them.
`validation.py`: the pipeline's validation loss. `forecast.py`: what a run would cost, before it runs.
"""
