"""The copy of the simulator's tables the Go cross-check reads is the tables as they are now.

``integration/goclient/hwtruth`` compares it with go-nvml's mock GPUs; a table changed without
refreshing the copy (``python -m sidecar.nvml.tables.export > .../testdata/sim-tables.json``) would
let that check compare yesterday's values.
"""

from __future__ import annotations

import json
from pathlib import Path

from sidecar.nvml.tables.export import export

COPY = Path(__file__).resolve().parents[2] / "integration/goclient/hwtruth/testdata/sim-tables.json"


def test_the_go_cross_checks_copy_is_the_current_export() -> None:
    assert json.loads(COPY.read_text()) == json.loads(json.dumps(export()))


def test_the_export_carries_every_model_with_its_placements() -> None:
    exported = export()
    h100 = exported["h100-80gb"]
    assert isinstance(h100, dict)
    by_name = {p["name"]: p for p in h100["profiles"]}
    assert by_name["3g.40gb"]["placements"] == [[0, 4], [4, 4]]
    assert by_name["1g.10gb"]["id"] == 19
