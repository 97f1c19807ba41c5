"""Every pattern check below the edge matches the value whole: a ``$`` also matches before a final
newline, so ``GPU-...\\n`` would pass as a GPU UUID. The edge's own checks are driven through the
socket in ``tests/e2e/test_edge_limits.py``; these are the record decoder's, the record names', the
CDI store's (and ``--cdi-kind``'s)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec
import pytest
from helpers_records import GPU, MIG, make_record

from sidecar.model.ownership import is_record_name, parse_record_name, record_name
from sidecar.nvml.port import Placement
from sidecar.store.cdi import CdiSpecs
from sidecar.store.cdi_format import parse_kind
from sidecar.store.record_format import CorruptRecord, decode_record


def stored(record: object) -> bytes:
    """The file bytes of ``record`` with a valid envelope and checksum, whatever its values."""
    payload = msgspec.json.encode(record)
    digest = hashlib.sha256(payload).hexdigest().encode()
    return b'{"version":1,"checksum":"sha256:%s","record":%s}\n' % (digest, payload)


def test_the_record_decoder_refuses_a_gpu_uuid_with_a_trailing_newline(tmp_path: Path) -> None:
    record = msgspec.structs.replace(make_record(), gpu_uuid=GPU + "\n")
    name = f"mig-{GPU}\n-0-1"  # the name such a record would give itself
    with pytest.raises(CorruptRecord, match="not a GPU UUID"):
        decode_record(name, tmp_path / f"{name}.json", stored(record))


def test_a_record_name_is_matched_whole() -> None:
    name = record_name(GPU, Placement(0, 1))
    assert parse_record_name(name) == (GPU, Placement(0, 1))
    assert parse_record_name(name + "\n") is None
    assert not is_record_name(name + "\n")
    with pytest.raises(ValueError, match="not a GPU UUID"):
        record_name(GPU + "\n", Placement(0, 1))


def test_a_cdi_kind_and_a_cdi_device_are_matched_whole(tmp_path: Path) -> None:
    assert parse_kind("k8s.hami.io/mig") == ("k8s.hami.io", "mig")
    with pytest.raises(ValueError, match="not a CDI kind"):
        parse_kind("k8s.hami.io/mig\n")
    specs = CdiSpecs(tmp_path, "k8s.hami.io/mig", tmp_path)
    assert specs.device_name(MIG).endswith(MIG)
    with pytest.raises(ValueError, match="not a MIG UUID"):
        specs.device_name(MIG + "\n")
