"""End-to-end fixtures: ``sidecar`` (one started sidecar) and ``sidecar_factory`` (make more).

The process handle, its helpers and these two fixtures live in ``sidecar_process`` (``Sidecar``,
``error_info``); tests import them from there (``from sidecar_process import Sidecar, error_info``).
See that module for the paths, methods and the reasons behind them. Keep these names stable: every e2e
test uses them. The fixtures are defined there so that mypy checks them: mypy names a module by its
file name within the folder the tests import their helpers from, and every such folder's conftest
would be ``conftest``; pytest finds a fixture by its name in this module.
"""

from sidecar_process import sidecar, sidecar_factory

__all__ = ["sidecar", "sidecar_factory"]
