"""The simulator's MIG tables as JSON, for a check by a second source outside Python.

``python -m sidecar.nvml.tables.export`` prints, per model, what NVML would answer for each GI
profile index: ID, slices, instance count, memory, SMs and the legal placements. The Go module
compares it with go-nvml's mock GPUs (``integration/goclient/hwtruth``), from a copy committed
beside that test; ``tests/unit/test_tables_export.py`` holds the copy equal to this output.
"""

from __future__ import annotations

import sys

import msgspec

from sidecar.nvml import profiles


def export() -> dict[str, object]:
    return {
        m.key: {
            "name": m.name,
            "memory_mb": m.memory_mb,
            "profiles": [
                {
                    "index": p.index,
                    "id": p.id,
                    "name": p.name,
                    "slice_count": p.slice_count,
                    "instance_count": p.instance_count,
                    "memory_mb": p.memory_mb,
                    "multiprocessor_count": p.multiprocessor_count,
                    "placements": [[start, p.size] for start in p.starts],
                }
                for p in sorted(m.profiles, key=lambda p: p.index)
            ],
        }
        for m in profiles.MODELS.values()
    }


def main() -> int:
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(export()), indent=1).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
