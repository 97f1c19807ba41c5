"""Shared by every suite: puts ``tests/`` on the import path, so ``hami_format`` (HAMi's files as HAMi
writes them) serves the unit and the end-to-end tests alike."""
