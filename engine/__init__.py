"""The engine: planner/ (pure Python, the operator imports it), models/, kernels/, speculative/, runtime/, serving/, demo/."""
