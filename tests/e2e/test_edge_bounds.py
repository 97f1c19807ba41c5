"""Following ``WatchHealth`` streams are bounded like calls: past ``--max-followers`` the next one is
refused RESOURCE_EXHAUSTED OVERLOADED, and the sidecar stays small and its health SERVING.

Each stream has a connection of its own, the costliest way to follow (what the issue measured: about
25 KiB of the sidecar's resident memory per stream). The sidecar runs as its own process, so its
resident memory is its own. No timing is asserted: the test waits (bounded) for each state.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from hami.migsidecar.v1 import migsidecar_pb2_grpc as pb_grpc
from helpers_e2e import wait_until
from sidecar_process import Sidecar, SidecarFactory, allocate_one, error_info

from sidecar.config.flags import DEFAULT_MAX_FOLLOWERS

pytestmark = pytest.mark.e2e

SERVING = health_pb2.HealthCheckResponse.SERVING
SHIPPED_MEMORY_LIMIT = 256 * 2**20  # deploy/daemonset.yaml's limits.memory
STREAM_TIMEOUT_S = 300.0  # a bound on a stream's life in the test, never a measured duration


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def own_channel(car: Sidecar) -> grpc.aio.Channel:
    """A channel with a connection of its own (grpc shares one between equal channels otherwise)."""
    return grpc.aio.insecure_channel(f"unix://{car.socket}", options=[("grpc.use_local_subchannel_pool", 1)])


async def follow(car: Sidecar, channels: list[grpc.aio.Channel]) -> object:
    """Open one following stream on a connection of its own; its first update (it follows then)."""
    channel = own_channel(car)
    channels.append(channel)
    stream = pb_grpc.MigSidecarStub(channel).WatchHealth(
        pb.WatchHealthRequest(follow=True), timeout=STREAM_TIMEOUT_S
    )
    return await stream.read()


def test_followers_past_the_limit_are_refused_overloaded_while_memory_and_health_hold(
    sidecar_factory: SidecarFactory,
) -> None:
    car = sidecar_factory(sim_gpus="h100-80gb:1")  # the shipped --max-followers
    car.recover()
    allocate_one(car, "pod-1", 0, "1g.10gb", 0, 1)  # so that each stream opens with one update
    channels: list[grpc.aio.Channel] = []
    serving: list[int] = []
    resident: list[int] = []

    async def run() -> tuple[grpc.StatusCode, str, dict[str, str]]:
        for batch in range(0, DEFAULT_MAX_FOLLOWERS, 128):
            opened = await asyncio.gather(*(follow(car, channels) for _ in range(batch, batch + 128)))
            assert all(isinstance(update, pb.InstanceHealthUpdate) for update in opened)
            serving.append(car.health_status())
            resident.append(resident_bytes(car.proc.pid))  # type: ignore[union-attr]
        try:
            await follow(car, channels)
        except grpc.aio.AioRpcError as err:
            return error_info(err)
        finally:
            serving.append(car.health_status())
            resident.append(resident_bytes(car.proc.pid))  # type: ignore[union-attr]
            for channel in channels:
                await channel.close()
        raise AssertionError("the stream past the limit was admitted")

    code, reason, metadata = asyncio.run(run())

    assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED")
    assert metadata == {"method": "WatchHealth", "followers": str(DEFAULT_MAX_FOLLOWERS)}
    assert set(serving) == {SERVING}
    assert max(resident) < SHIPPED_MEMORY_LIMIT // 2, [r // 2**20 for r in resident]
    assert car.cli("health", "--socket", str(car.socket)).returncode == 0


def test_a_follower_that_leaves_frees_its_place(sidecar_factory: SidecarFactory) -> None:
    car = sidecar_factory(extra_args=["--max-followers", "2"], sim_gpus="h100-80gb:1")
    car.recover()
    allocate_one(car, "pod-1", 0, "1g.10gb", 0, 1)
    channels: list[grpc.aio.Channel] = []

    async def refused() -> str:
        try:
            await follow(car, channels)
        except grpc.aio.AioRpcError as err:
            return error_info(err)[1]
        return ""

    async def run() -> None:
        await follow(car, channels)
        await follow(car, channels)
        assert await refused() == "OVERLOADED"
        await channels[0].close()  # the first follower goes away
        for _ in range(200):  # its cancellation reaches the server in its own time
            if await refused() == "":
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the freed place was never taken")
        for channel in channels:
            await channel.close()

    asyncio.run(run())
    wait_until("health SERVING", lambda: car.health_status() == SERVING, car=car, within=30)
