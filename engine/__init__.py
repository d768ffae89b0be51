"""The engine, in layers (tests/test_layout.py): planner/ (pure Python, the operator imports it)
< kernels/ | memory/ | parallel.py < models/ < speculative/ < runtime/ < serving/ < demo/."""
