"""Fixtures for lifecycle component tests: ``world`` and ``cdi_world``, defined in ``lifecycle_world``.

Every test that uses ``world`` runs twice: with CDI files and in legacy mode (CDI disabled), where the
CDI directory must stay empty whatever happens.

They live in ``lifecycle_world`` so that mypy checks them there: mypy names a module by its file name
within the folder the tests import their helpers from, and every such folder's conftest would be
``conftest``; pytest finds a fixture by its name in this module.
"""

from lifecycle_world import cdi_world, world

__all__ = ["cdi_world", "world"]
