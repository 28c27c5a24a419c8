"""File formats the pack reads and writes: safetensors headers (read without loading), a streaming
safetensors writer, the LoRA file in ComfyUI's key format, and atomic replacement of files."""
