"""Pictures for the user: a prompt rendered through the model being trained (`prompt`), a saved LoRA
previewed on a plan (`preview`), and loss curves, grids and animations (`report`)."""
