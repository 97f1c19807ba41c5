"""A record whose owner no call could name is corrupt: ``records verify`` fails on it, Recover leaves it.

Each case edits one name of a stored owner as someone with write access to the state directory would,
checksum recomputed, to a value the edge refuses in a request: such an owner could be released by
no call (a ``Release`` naming it is refused INVALID_REQUEST first). The record must read as corrupt,
so ``records verify`` exits non-zero naming it, and Recover keeps the file as it is and leaves the
instance foreign, hardware and CDI spec untouched, for the operator.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from lifecycle_world import BOOT_ID, World, restart

from sidecar import cli
from sidecar.model import errors
from sidecar.store import record_verify

# (where in the stored owner, the value written there)
CLAIM_EDITS = [
    pytest.param(("claim", "uid"), "", id="empty-uid"),
    pytest.param(("claim", "uid"), "claim-1\n", id="uid-with-a-newline"),
    pytest.param(("claim", "uid"), "bad uid", id="uid-with-a-space"),
    pytest.param(("request",), "Gpu/../x", id="request-Gpu/../x"),
    pytest.param(("request",), "", id="empty-request"),
    pytest.param(("claim", "namespace"), "Team-A", id="namespace-with-uppercase"),
    pytest.param(("claim", "name"), "Claim_1", id="name-no-dns-subdomain"),
]
POD_EDITS = [
    pytest.param(("pod", "uid"), "", id="empty-uid"),
    pytest.param(("pod", "uid"), "pod-a\n", id="uid-with-a-newline"),
    pytest.param(("pod", "uid"), "u" * 129, id="uid-of-129-bytes"),
    pytest.param(("pod", "namespace"), "Default", id="namespace-with-uppercase"),
    pytest.param(("pod", "name"), "p" * 254, id="name-of-254-bytes"),
    pytest.param(("container_name",), "c" * 64, id="container-name-of-64-bytes"),
    pytest.param(("device_index",), -1, id="negative-device-index"),
]


def tamper(path: Path, where: tuple[str, ...], value: object) -> bytes:
    """Set ``owner.<where>`` of the record file at ``path`` to ``value`` and write it back with the
    checksum recomputed, as a tamperer would; the new file content."""
    envelope = json.loads(path.read_bytes())
    target = envelope["record"]["owner"]
    for key in where[:-1]:
        target = target[key]
    assert target[where[-1]] != value
    target[where[-1]] = value
    payload = json.dumps(envelope["record"], separators=(",", ":")).encode()
    digest = hashlib.sha256(payload).hexdigest().encode()
    data = b'{"version":1,"checksum":"sha256:%s","record":%s}\n' % (digest, payload)
    path.write_bytes(data)
    return data


def assert_corrupt_and_left_for_the_operator(world: World, path: Path, data: bytes) -> None:
    report = record_verify.verify(path.parent, BOOT_ID)
    assert list(report.corrupt) == [path.stem]
    assert report.valid == ()
    assert cli.main(["records", "verify", "--state-dir", str(path.parent), "--boot-id", BOOT_ID]) != 0

    layout, cdi = world.layout(), world.cdi_files()
    recovered = restart(world).recover([])

    assert path.read_bytes() == data
    assert world.layout() == layout
    assert world.cdi_files() == cdi
    assert world.lifecycle.instances() == []
    assert {str(ref.reservation) for ref in recovered.preserved_foreign} == {f"{world.uuid(0)}/1g.10gb@0:1"}
    assert any(path.stem in line for line in recovered.errors)
    with pytest.raises(errors.PlacementBusy):
        world.allocate("pod-b", (0, "1g.10gb", 0, 1))


@pytest.mark.parametrize(("where", "value"), CLAIM_EDITS)
def test_a_claim_owner_no_release_could_name_is_corrupt_and_left_for_the_operator(
    cdi_world: World, where: tuple[str, ...], value: object
) -> None:
    cdi_world.allocate_claim("claim-1", (0, "1g.10gb", 0, 1), request="gpu")
    [name] = cdi_world.record_files()
    data = tamper(cdi_world.records.path(name), where, value)
    assert_corrupt_and_left_for_the_operator(cdi_world, cdi_world.records.path(name), data)


@pytest.mark.parametrize(("where", "value"), POD_EDITS)
def test_a_pod_owner_no_call_could_name_is_corrupt_and_left_for_the_operator(
    cdi_world: World, where: tuple[str, ...], value: object
) -> None:
    cdi_world.allocate("pod-a", (0, "1g.10gb", 0, 1))
    [name] = cdi_world.record_files()
    data = tamper(cdi_world.records.path(name), where, value)
    assert_corrupt_and_left_for_the_operator(cdi_world, cdi_world.records.path(name), data)


def test_the_untampered_records_verify_and_recover_as_owned(cdi_world: World) -> None:
    """The probe of the cases above: the same records, unedited, are valid and recovered ACTIVE."""
    cdi_world.allocate_claim("claim-1", (0, "1g.10gb", 0, 1), request="gpu")
    cdi_world.allocate("pod-a", (1, "1g.10gb", 0, 1))
    directory = cdi_world.records.directory
    assert record_verify.verify(directory, BOOT_ID).corrupt == {}
    assert cli.main(["records", "verify", "--state-dir", str(directory), "--boot-id", BOOT_ID]) == 0
    recovered = restart(cdi_world).recover([])
    assert recovered.errors == ()
    assert recovered.preserved_foreign == ()
    assert {str(r.owner.key) for r in cdi_world.lifecycle.instances() if r.owner is not None} == {
        "claim claim-1/0"
    }  # the claim's kept ACTIVE; pod-a's went IDLE, as the empty pod list does not name it
