"""Test tiers, for everything pytest collects here (tests/, notebooks/, solutions/).

The full run (``bash .ci/run``, what CI runs) executes every notebook under nbval and
starts worker processes; the quick tier (``bash .ci/run --quick``, a few minutes on two
cores) leaves out what is marked below:

- ``notebook``: a cell of a notebook run under nbval (lectures, solutions, the browser
  test's notebook), and the blank exercises executed whole: each notebook starts a
  Jupyter kernel and most load a model;
- ``slow`` and ``multiprocess``: marked in the test files themselves.
"""

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("::", 1)[0].endswith(".ipynb"):
            item.add_marker(pytest.mark.notebook)
