"""Training pieces: dataset, flow-matching loss, LoRA, loop."""
