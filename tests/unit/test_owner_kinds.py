"""Owner kinds: a pod's container or a claim's request, in the record format and at the edge.

The record of a pod's instance stays what it was before owner kinds (an older file reads as a pod's,
a new pod record is byte for byte an old one), a claim's record round-trips, and an owner that is
neither kind is a corrupt record. At the edge, an Allocate names exactly one of pod and claim and a
Release exactly one of pod_uid and claim_uid; every other shape is INVALID_REQUEST naming the fields.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from helpers_records import make_record

from sidecar.edge import decode
from sidecar.model.domain import AllocationKey, ClaimRef, Owner, OwnerKind, PodRef, State
from sidecar.model.errors import InvalidRequest
from sidecar.model.ownership import OwnershipRecord
from sidecar.store.record_format import CorruptRecord, decode_record, encode_record
from sidecar.store.records import RecordStore

# The record file of an ACTIVE pod instance exactly as the build before owner kinds wrote it.
OLD_RECORD_FILE = (
    b'{"version":1,"checksum":"sha256:e2b72f25fd869993ba213d945977aa2a268a52f348c49de3018dcfe05ac1e0ec",'
    b'"record":{"gpu_uuid":"GPU-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0","profile":"1g.10gb",'
    b'"gi_profile_id":19,"ci_profile_id":0,"placement":{"start":0,"size":1},"state":"ACTIVE",'
    b'"gpu_instance_id":9,"compute_instance_id":0,"mig_uuid":"MIG-5c2f3a9e-1111-2222-3333-444455556666",'
    b'"owner":{"pod":{"uid":"pod-uid-1","namespace":"default","name":"trainer"},"container_name":"main",'
    b'"container_index":0,"device_index":0},"activated_generation":3,"idled_generation":0,'
    b'"cdi_device":"k8s.hami.io/mig=MIG-5c2f3a9e-1111-2222-3333-444455556666","last_error":"",'
    b'"boot_id":"7e1f3c2a-0000-4000-8000-000000000001","since":"2026-01-01T00:00:00Z",'
    b'"ci_create_issued":false,"origin":"REUSED","taken_over_from":"","xid":0}}\n'
)
GPU = "GPU-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"
CLAIM = ClaimRef("3f1d0c9e-claim", "team-a", "train-gpu")


def claim_record(owner: Owner | None = None) -> OwnershipRecord:
    return msgspec.structs.replace(
        make_record(state=State.ACTIVE), owner=owner or Owner.of_claim(CLAIM, 0, "gpu/small")
    )


def with_record(payload: bytes) -> bytes:
    """A record file around ``payload`` (checksummed as the store writes it)."""
    digest = hashlib.sha256(payload).hexdigest().encode()
    return b'{"version":1,"checksum":"sha256:%s","record":%s}\n' % (digest, payload)


class TestTheRecordFormat:
    def test_a_record_file_written_before_owner_kinds_reads_as_a_pods(self, tmp_path: Path) -> None:
        with RecordStore(tmp_path / "state") as store:
            name = make_record().name
            store.path(name).write_bytes(OLD_RECORD_FILE)
            record = store.load(name)
        assert record.owner is not None
        assert record.owner.kind is OwnerKind.POD
        assert record.owner.claim is None
        assert record.owner.request == ""
        assert record.owner.key == AllocationKey("pod-uid-1", 0, 0, OwnerKind.POD)
        assert record == make_record(state=State.ACTIVE)

    def test_a_pod_record_is_written_byte_for_byte_as_before(self) -> None:
        assert encode_record(make_record(state=State.ACTIVE)) == OLD_RECORD_FILE

    def test_a_claim_record_round_trips_with_its_kind_claim_and_request(self, tmp_path: Path) -> None:
        record = claim_record()
        with RecordStore(tmp_path / "state") as store:
            store.put(record)
            assert store.load(make_record().name) == record
            data = store.path(make_record().name).read_bytes()
        assert b'"kind":"CLAIM"' in data
        assert b'"claim":{"uid":"3f1d0c9e-claim","namespace":"team-a","name":"train-gpu"}' in data
        assert b'"request":"gpu/small"' in data

    @pytest.mark.parametrize(
        ("owner", "why"),
        [
            pytest.param(
                Owner(PodRef("", ""), "", 0, 0, OwnerKind.CLAIM, None, "gpu"), "names no claim", id="no claim"
            ),
            pytest.param(
                Owner(PodRef(""), "", 0, 0, OwnerKind.CLAIM, CLAIM, ""), "no request", id="no request"
            ),
            pytest.param(
                Owner(PodRef("pod-1"), "main", 0, 0, OwnerKind.CLAIM, CLAIM, "gpu"),
                "names a pod",
                id="a pod too",
            ),
            pytest.param(
                Owner(PodRef("pod-1"), "main", 0, 0, OwnerKind.POD, CLAIM, ""), "a claim", id="pod+claim"
            ),
        ],
    )
    def test_an_owner_of_neither_kind_never_reaches_the_disk_and_reads_as_corrupt(
        self, owner: Owner, why: str
    ) -> None:
        record = msgspec.structs.replace(make_record(state=State.ACTIVE), owner=owner)
        with pytest.raises(ValueError, match=why):
            encode_record(record)
        data = with_record(msgspec.json.encode(record))
        with pytest.raises(CorruptRecord, match=why):
            decode_record(record.name, Path(record.name), data)

    def test_an_unknown_owner_kind_is_a_corrupt_record(self) -> None:
        data = OLD_RECORD_FILE.split(b'"record":', 1)[1].rstrip(b"}\n") + b"}"
        payload = data.replace(b'"device_index":0}', b'"device_index":0,"kind":"NODE"}')
        assert payload != data
        with pytest.raises(CorruptRecord, match="does not decode"):
            decode_record(make_record().name, Path("x"), with_record(payload))


class TestKeys:
    def test_a_pod_and_a_claim_with_the_same_uid_have_different_keys(self) -> None:
        pod = Owner(PodRef("same-uid"), "", 0, 0)
        claim = Owner.of_claim(ClaimRef("same-uid"), 0, "gpu")
        assert pod.uid == claim.uid == "same-uid"
        assert pod.key != claim.key
        assert str(pod.key) != str(claim.key)

    def test_a_claims_devices_are_told_apart_by_their_index(self) -> None:
        assert Owner.of_claim(CLAIM, 0, "gpu").key != Owner.of_claim(CLAIM, 1, "gpu").key


def claim_allocate(**fields: object) -> pb.AllocateRequest:
    request = pb.AllocateRequest(
        claim=pb.ClaimRef(uid="claim-1", namespace="team-a", name="train-gpu"),
        devices=[
            pb.DeviceRequest(
                device_index=0, gpu_uuid=GPU, profile="1g.10gb", placement=pb.Placement(start=0, size=1)
            )
        ],
    )
    request.devices[0].request = "gpu"
    for name, value in fields.items():
        setattr(request, name, value)
    return request


def invalid(call: Callable[[], object]) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        call()
    return caught.value


class TestTheEdgeAllocate:
    def test_a_claims_allocate_decodes_to_its_claim_and_requests(self) -> None:
        request = claim_allocate()
        request.devices.add(device_index=1, gpu_uuid=GPU, profile="1g.10gb", request="gpu/small")
        request.devices[1].placement.CopyFrom(pb.Placement(start=1, size=1))
        decoded = decode.allocate(request)
        assert decoded.claim == ClaimRef("claim-1", "team-a", "train-gpu")
        assert [decoded.owner(d) for d in decoded.devices] == [
            Owner.of_claim(decoded.claim, 0, "gpu"),
            Owner.of_claim(decoded.claim, 1, "gpu/small"),
        ]

    def test_pod_and_claim_both_set_is_invalid_naming_both(self) -> None:
        request = claim_allocate()
        request.pod.CopyFrom(pb.PodRef(uid="pod-1"))
        error = invalid(lambda: decode.allocate(request))
        assert error.metadata == {"field": "pod,claim"}
        assert "exactly one" in str(error)

    def test_neither_pod_nor_claim_is_invalid_naming_both(self) -> None:
        request = claim_allocate()
        request.ClearField("claim")
        request.devices[0].request = ""
        assert invalid(lambda: decode.allocate(request)).metadata == {"field": "pod,claim"}

    @pytest.mark.parametrize(
        "fields",
        [{"container_name": "main"}, {"container_index": 1}],
        ids=["container name", "container index"],
    )
    def test_a_claims_allocate_names_no_container(self, fields: dict[str, object]) -> None:
        error = invalid(lambda: decode.allocate(claim_allocate(**fields)))
        assert error.metadata == {"field": "container_name,container_index"}

    @pytest.mark.parametrize(
        ("mutate", "field"),
        [
            pytest.param(lambda r: r.claim.ClearField("uid"), "request.claim.uid", id="no claim uid"),
            pytest.param(
                lambda r: setattr(r.claim, "uid", "a b"), "request.claim.uid", id="claim uid with space"
            ),
            pytest.param(
                lambda r: setattr(r.claim, "uid", "uid\n"), "request.claim.uid", id="trailing newline"
            ),
            pytest.param(
                lambda r: setattr(r.claim, "uid", "u" * 129), "request.claim.uid", id="uid past 128"
            ),
            pytest.param(
                lambda r: setattr(r.claim, "namespace", "Team_A"),
                "request.claim.namespace",
                id="bad namespace",
            ),
            pytest.param(
                lambda r: setattr(r.claim, "name", "Train.GPU"), "request.claim.name", id="bad name"
            ),
            pytest.param(
                lambda r: setattr(r.claim, "name", "n" * 254), "request.claim.name", id="name past 253"
            ),
            pytest.param(
                lambda r: setattr(r.devices[0], "request", ""), "devices[0].request", id="no request"
            ),
            pytest.param(
                lambda r: setattr(r.devices[0], "request", "GPU"), "devices[0].request", id="upper case"
            ),
            pytest.param(
                lambda r: setattr(r.devices[0], "request", "a/b/c"), "devices[0].request", id="3 parts"
            ),
            pytest.param(
                lambda r: setattr(r.devices[0], "request", "gpu/"), "devices[0].request", id="empty sub"
            ),
            pytest.param(
                lambda r: setattr(r.devices[0], "request", "g" * 64), "devices[0].request", id="long label"
            ),
        ],
    )
    def test_a_malformed_claim_is_invalid_naming_its_field(
        self, mutate: Callable[[pb.AllocateRequest], object], field: str
    ) -> None:
        request = claim_allocate()
        mutate(request)
        assert invalid(lambda: decode.allocate(request)).metadata == {"field": field}

    def test_request_names_at_their_limits_are_accepted(self) -> None:
        request = claim_allocate()
        request.devices[0].request = f"{'a' * 63}/{'b' * 63}"
        request.claim.name = ".".join(["n" * 63] * 4)[:253].rstrip(".")
        assert decode.allocate(request).devices[0].request == f"{'a' * 63}/{'b' * 63}"

    def test_a_pods_device_names_no_request(self) -> None:
        request = claim_allocate()
        request.ClearField("claim")
        request.pod.CopyFrom(pb.PodRef(uid="pod-1"))
        error = invalid(lambda: decode.allocate(request))
        assert error.metadata == {"field": "devices[0].request"}


class TestTheEdgeRelease:
    def test_a_claim_uid_releases_a_claim(self) -> None:
        assert decode.release(pb.ReleaseRequest(claim_uid="claim-1")) == ("claim-1", OwnerKind.CLAIM)
        assert decode.release(pb.ReleaseRequest(pod_uid="pod-1")) == ("pod-1", OwnerKind.POD)

    @pytest.mark.parametrize(
        ("request_", "field"),
        [
            pytest.param(pb.ReleaseRequest(), "pod_uid,claim_uid", id="neither"),
            pytest.param(pb.ReleaseRequest(pod_uid="p", claim_uid="c"), "pod_uid,claim_uid", id="both"),
            pytest.param(pb.ReleaseRequest(claim_uid="a b"), "claim_uid", id="malformed claim uid"),
        ],
    )
    def test_anything_but_exactly_one_valid_uid_is_invalid(
        self, request_: pb.ReleaseRequest, field: str
    ) -> None:
        assert invalid(lambda: decode.release(request_)).metadata == {"field": field}
