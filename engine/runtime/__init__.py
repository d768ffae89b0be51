"""One process's step loop: the model calls of the decode loop, CUDA graphs, the runner, KV transfer, the ranks' lockstep."""
