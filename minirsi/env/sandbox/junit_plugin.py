"""A pytest plugin the verifier loads inside the sandbox (as module ``minirsi_junit``).

It makes hygiene checks visible in the junit XML without any file in the task: every test
marked ``@pytest.mark.hygiene`` gets ``<property name="minirsi.hygiene" value="1"/>`` in its
``<testcase>``, and the marker is registered (no "unknown marker" warning). If test.sh runs
pytest without ``--junitxml``, the plugin writes ``/logs/verifier/junit.xml`` itself, so real
Terminal-Bench tasks still yield per-check outcomes.

The verifier binds this file at /opt/minirsi/minirsi_junit.py and sets
``PYTHONPATH=/opt/minirsi PYTEST_PLUGINS=minirsi_junit``. It has no import of minirsi: it runs
under the sandbox's own Python and pytest (Debian bookworm: pytest 7.2).
"""

from __future__ import annotations

import os

import pytest

HYGIENE_PROPERTY = "minirsi.hygiene"
DEFAULT_XML = "/logs/verifier/junit.xml"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "hygiene: bookkeeping check, excluded from P and C (docs/method.md section 1)")
    # tryfirst: runs before the junitxml plugin's own pytest_configure reads the option.
    if not getattr(config.option, "xmlpath", None) and os.path.isdir(os.path.dirname(DEFAULT_XML)):
        config.option.xmlpath = DEFAULT_XML


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("hygiene") is not None:
            item.user_properties.append((HYGIENE_PROPERTY, "1"))
