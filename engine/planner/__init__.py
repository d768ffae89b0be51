"""The data contract, in pure Python (no torch): config.json -> shapes -> memory plan. The operator imports it."""
