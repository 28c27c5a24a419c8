"""Where weights live and how activations move: a model's blocks put on their devices by a plan, streamed
from the model file (`place`, `stream_load`); activations carried between devices (`route`, `copy`);
blocks swapped in from pinned host memory (`swap`); a step's micro-batches run over the stages
(`pipeline`, in the orders of `schedules`). The mechanisms only: what goes where is `ugpum.planning`'s."""
