# Fixtures shared by all test folders. The package `testcluster` lives in tests/cluster/, which
# pyproject.toml puts on the pytest pythonpath (that folder holds only test code).
pytest_plugins = ["testcluster.plugin"]
