"""check(): the Python tests' assertion. A bare `assert` is removed when Python runs optimised (python -O,
or PYTHONOPTIMIZE set in the environment), which would turn every check into a pass; this one always runs.
tests/python/no_bare_assert.py keeps bare asserts out of the tests."""


def check(condition, message=""):
    if not condition:
        raise AssertionError(message)
