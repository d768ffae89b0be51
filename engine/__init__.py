"""The engine. `shapes` and `plan` are pure Python (no torch) so the operator can import them."""
