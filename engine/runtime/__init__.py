"""One process's device state: KV slots, the model calls of the decode loop, CUDA graphs, the step loop."""
