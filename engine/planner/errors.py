"""The planner's input errors, shared by its modules (shapes.py re-exports it)."""


class ConfigError(ValueError):
    """A config.json (or model directory) that cannot be planned; the message names the field.
    `model`: whose config.json it is ("target" or "draft"), where plan_from_configs knows it."""

    model: str | None = None


class UncomputedDtypeError(ConfigError):
    """The target's dtype is not one the engine computes in (shapes.COMPUTE_DTYPES)."""


# No published model comes near these; a larger value in a config.json is a broken config,
# refused before any arithmetic or per-layer loop runs on it.
MAX_CONFIG_INT = 1 << 40
MAX_LAYERS = 10_000
# How `specdeploy plan` and the operator report a config.json that no check refused but the
# planner still could not read (a bug to report; tests/engine/planner/test_no_traceback.py
# holds every shipped and test config, broken field by field, clear of it).
PLANNER_FAILED = "the planner failed on these config.json files"
