"""The Allocate answer as the Go client reads it: every field of every device, and the reclaimed."""

from __future__ import annotations

import msgspec
from hami.migsidecar.v1 import migsidecar_pb2 as pb

from sidecar.edge import encode
from sidecar.model.domain import (
    AllocatedDevice,
    AllocateResult,
    Identity,
    InstanceRef,
    Outcome,
    Reservation,
    State,
)
from sidecar.model.ownership import OwnershipRecord
from sidecar.nvml.port import Placement

GPU = "GPU-12345678-1234-4234-8234-123456789abc"
MIG_A = "MIG-aaaaaaaa-1234-5234-8234-123456789abc"
MIG_B = "MIG-bbbbbbbb-1234-5234-8234-123456789abc"
MIG_GONE = "MIG-cccccccc-1234-5234-8234-123456789abc"


def test_an_allocate_result_encodes_each_device_and_each_reclaimed_instance() -> None:
    result = AllocateResult(
        devices=(
            AllocatedDevice(
                1,
                Reservation(GPU, "2g.20gb", Placement(4, 2)),
                Identity(5, 0, MIG_A),
                f"k8s.hami.io/mig={MIG_A}",
                Outcome.REUSED,
            ),
            AllocatedDevice(
                0, Reservation(GPU, "1g.10gb", Placement(0, 1)), Identity(9, 1, MIG_B), "", Outcome.CREATED
            ),
        ),
        reclaimed=(InstanceRef(Reservation(GPU, "3g.40gb", Placement(0, 4)), Identity(2, 0, MIG_GONE)),),
    )

    message = encode.encode_allocated(result)

    assert message == pb.AllocateResponse(
        devices=[
            pb.AllocatedDevice(
                device_index=1,
                gpu_uuid=GPU,
                profile="2g.20gb",
                placement=pb.Placement(start=4, size=2),
                mig_uuid=MIG_A,
                gpu_instance_id=5,
                compute_instance_id=0,
                cdi_device=f"k8s.hami.io/mig={MIG_A}",
                outcome=pb.REUSED,
            ),
            pb.AllocatedDevice(
                device_index=0,
                gpu_uuid=GPU,
                profile="1g.10gb",
                placement=pb.Placement(start=0, size=1),
                mig_uuid=MIG_B,
                gpu_instance_id=9,
                compute_instance_id=1,
                outcome=pb.CREATED,
            ),
        ],
        reclaimed=[encode.encode_ref(result.reclaimed[0])],
    )
    assert message.reclaimed[0].mig_uuid == MIG_GONE


def test_an_xid_past_32_bits_is_whole_in_xid64_and_the_largest_uint32_in_xid() -> None:
    record = OwnershipRecord(
        gpu_uuid=GPU,
        profile="1g.10gb",
        gi_profile_id=19,
        ci_profile_id=0,
        placement=Placement(0, 1),
        state=State.ACTIVE,
        mig_uuid=MIG_A,
        xid=2**64 - 1,
    )
    for message in (encode.encode_instance(record), encode.encode_health(record, current=True)):
        assert (message.health, message.xid, message.xid64) == (pb.FAULTED, 2**32 - 1, 2**64 - 1)
    small = msgspec.structs.replace(record, xid=79)
    assert (encode.encode_instance(small).xid, encode.encode_instance(small).xid64) == (79, 79)
