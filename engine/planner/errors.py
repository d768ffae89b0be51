"""The planner's one input error, shared by its modules (shapes.py re-exports it)."""


class ConfigError(ValueError):
    """A config.json (or model directory) that cannot be planned; the message names the field."""
