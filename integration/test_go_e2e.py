"""The Go client against a real sidecar: HAMi's side of the socket, end to end.

Each test starts a fresh sidecar on simulated GPUs, drives it with the Go mock device plugin or
the Go e2e test binary, and then checks what the Go side was told and what the "hardware"
(the simulated NVML state), the ownership records and the CDI files say afterwards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import go_harness
import pytest
from go_harness import GOCLIENT, GoBinaries, GoRunner
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from sidecar_process import Sidecar

# One worker runs them all (make's pytest-xdist --dist loadgroup): they share one build of the binaries.
pytestmark = [pytest.mark.e2e, pytest.mark.go, pytest.mark.xdist_group("go")]

SCENARIOS = GOCLIENT / "scenarios"

# The fixtures live in go_harness (see its docstring for why not in a conftest.py).
go_binaries_fixture = go_harness.go_binaries_fixture
go_sidecar_fixture = go_harness.go_sidecar_fixture
go_runner_fixture = go_harness.go_runner_fixture
driver_cdi_binaries = go_harness.driver_cdi_binaries


def play(
    go: GoBinaries,
    runner: GoRunner,
    scenario: str,
    *extra: str,
    during: dict[float, str] | None = None,
    allow_simulated: bool = True,
) -> tuple[int, list[dict[str, Any]], str]:
    """Run the mock plugin on a scenario; returns (exit code, one report per step, raw output).

    The sidecar here runs on simulated GPUs, which the client refuses unless told otherwise."""
    args = [
        str(go.mockplugin), "--socket", str(runner.car.socket), "--scenario", str(SCENARIOS / scenario),
        "--json", "--restart-cmd", runner.restart_command, *extra,
    ]  # fmt: skip
    if allow_simulated:
        args.append("--allow-simulated-backend")
    result = runner.run(args, during=during)
    steps = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return result.returncode, steps, result.stdout


def instances(car: Sidecar) -> dict[str, str]:
    """MIG UUID -> state name, as the sidecar reports it."""
    state = car.stub.GetState(pb.GetStateRequest(), timeout=30)
    return {i.mig_uuid: pb.InstanceState.Name(i.state) for g in state.gpus for i in g.instances}


def hardware_mig_uuids(car: Sidecar) -> set[str]:
    """The MIG UUIDs the simulated NVML state holds (what `nvidia-smi -L` would list)."""
    listing = car.sim("list").stdout
    return {word.strip("(),;") for word in listing.split() if word.strip("(),;").startswith("MIG-")}


def cdi_names(car: Sidecar) -> set[str]:
    """The device names in the sidecar's CDI spec files."""
    names: set[str] = set()
    for path in Path(car.cdi_dir).glob("*.json"):
        spec = json.loads(path.read_text())
        names.update(f"{spec['kind']}={d['name']}" for d in spec["devices"])
    return names


def records(car: Sidecar) -> list[Path]:
    return sorted(p for p in Path(car.state_dir).glob("*.json"))


class TestTheMockPluginReplaysTheReadmeScenario:
    def test_reuse_protection_and_reclaim_return_what_the_plugin_expects(
        self, go_binaries: GoBinaries, go_runner: GoRunner
    ) -> None:
        code, steps, raw = play(go_binaries, go_runner, "example.yaml")
        assert code == 0, raw
        by_step = {s["step"]: s for s in steps}
        created, reused = by_step[2]["devices"][0], by_step[5]["devices"][0]
        assert created["Outcome"] == "CREATED"
        assert reused["Outcome"] == "REUSED"
        assert reused["MigUUID"] == created["MigUUID"]
        assert by_step[7]["error"]["reason"] == "PLACEMENT_BUSY"
        assert by_step[7]["error"]["metadata"]["mig_uuid"] == created["MigUUID"]
        final = by_step[11]
        assert [r["MigUUID"] for r in final["reclaimed"]] == [created["MigUUID"]]
        survivor = final["devices"][0]

        car = go_runner.car
        assert instances(car) == {survivor["MigUUID"]: "ACTIVE"}
        assert hardware_mig_uuids(car) == {survivor["MigUUID"]}
        assert cdi_names(car) == {survivor["CDIDevice"]}
        assert len(records(car)) == 1


class TestAllOrNothing:
    def test_undo_reclaim_idle_and_disable_mig_steps_leave_what_the_plugin_expects(
        self, go_binaries: GoBinaries, go_runner: GoRunner
    ) -> None:
        code, steps, raw = play(go_binaries, go_runner, "undo-reclaim.yaml")
        assert code == 0, raw
        by_step = {s["step"]: s for s in steps}
        reused, created = by_step[5]["devices"]
        assert [r["MigUUID"] for r in by_step[6]["destroyed"]] == [created["MigUUID"]]
        assert [r["MigUUID"] for r in by_step[6]["idled"]] == [reused["MigUUID"]]
        assert by_step[11]["error"]["reason"] == "NOT_IDLE"
        assert [r["MigUUID"] for r in by_step[12]["reclaimed"]] == [reused["MigUUID"]]
        kept = by_step[10]["devices"][0]

        car = go_runner.car
        assert instances(car) == {kept["MigUUID"]: "ACTIVE"}
        assert hardware_mig_uuids(car) == {kept["MigUUID"]}
        assert len(records(car)) == 1
        assert not next(g for g in car.gpus() if g.index == 1).mig_mode.current

    def test_a_failed_second_device_destroys_the_instance_the_request_created(
        self, go_binaries: GoBinaries, go_runner: GoRunner
    ) -> None:
        car = go_runner.car
        car.sim("fault", "create-ci", "UNKNOWN", "--after", "1", "--times", "100")
        # NVML_ERROR is UNAVAILABLE, which the client retries with the same request. Two attempts,
        # both answered, end it: the error is the sidecar's own answer, not a deadline that cut an
        # attempt short, and no attempt is still rolling back when the state below is read. The
        # deadline is generous so that a slow machine does not end it first.
        code, steps, raw = play(
            go_binaries, go_runner, "rollback.yaml", "--max-attempts", "2", "--allocate-timeout", "60s"
        )
        assert code == 0, raw
        failed = next(s for s in steps if s["event"] == "allocate")
        assert failed["error"] is not None, raw
        assert failed["error"]["reason"] == "NVML_ERROR", raw
        assert failed["error"]["code"] == "Unavailable", raw
        assert "devices" not in failed
        assert instances(car) == {}
        assert hardware_mig_uuids(car) == set()
        assert cdi_names(car) == set()
        assert records(car) == []


class TestRestartRecovery:
    def test_after_kill_9_the_next_call_recovers_the_sidecar_and_keeps_the_active_pod(
        self, go_binaries: GoBinaries, go_runner: GoRunner
    ) -> None:
        code, steps, raw = play(go_binaries, go_runner, "restart.yaml")
        assert code == 0, raw
        assert go_runner.restarts == 1
        by_step = {s["step"]: s for s in steps}
        before = {d["MigUUID"] for d in by_step[2]["devices"]}
        after = by_step[5]["devices"][0]["MigUUID"]
        assert {i["MigUUID"] for i in by_step[7]["idled"]} == before
        car = go_runner.car
        assert instances(car) == {**dict.fromkeys(before, "IDLE"), after: "ACTIVE"}
        assert hardware_mig_uuids(car) == {*before, after}
        assert len(cdi_names(car)) == 3
        assert len(records(car)) == 3


class TestASimulatedSidecarIsRefusedUnlessAllowed:
    def test_without_the_opt_in_the_plugin_stops_at_startup_and_sends_nothing(
        self, go_binaries: GoBinaries, go_runner: GoRunner
    ) -> None:
        code, steps, raw = play(go_binaries, go_runner, "example.yaml", allow_simulated=False)
        assert code != 0, raw
        assert [s["event"] for s in steps] == ["start"], raw
        assert steps[0]["error"]["reason"] == "SIMULATED_BACKEND", raw
        assert steps[0]["error"]["metadata"]["backend"] == "simulated"
        car = go_runner.car
        info = car.stub.GetInfo(pb.GetInfoRequest(), timeout=30)
        assert not info.recovered  # not even Recover was sent
        assert instances(car) == {}
        assert hardware_mig_uuids(car) == set()
        assert records(car) == []


class TestSidecarDownWhenACallStarts:
    def test_the_client_waits_for_a_sidecar_that_comes_back_within_the_deadline(
        self, go_binaries: GoBinaries, go_runner: GoRunner
    ) -> None:
        go_runner.car.kill9()
        code, steps, raw = play(
            go_binaries, go_runner, "example.yaml", "--call-timeout", "60s", during={1.0: "start"}
        )
        assert code == 0, raw
        assert steps[0]["event"] == "start"
        assert "error" not in steps[0]

    def test_the_client_fails_closed_with_a_clear_error_when_it_stays_down(
        self, go_binaries: GoBinaries, go_runner: GoRunner
    ) -> None:
        go_runner.car.kill9()
        code, steps, raw = play(go_binaries, go_runner, "example.yaml", "--call-timeout", "1s")
        assert code != 0
        assert steps[0]["error"]["reason"] == "SIDECAR_UNREACHABLE", raw
        assert str(go_runner.car.socket) in steps[0]["error"]["message"]


# The Go e2e tests run only here, each against its own sidecar: `go test ./...` has no sidecar and
# skips them all, so a test left out of this list would run nowhere. The list is spelled out (the
# binary that could enumerate them is built by a fixture, after parametrization), and the first
# test below holds it equal to the tests compiled into the binary.
GO_E2E_TESTS = [
    "TestKubeDialAcceptsTheSimulatorOnlyWithTheOptInAndReleasesExactlyWhatItTook",
    "TestARolledBackInstanceHandedToAnotherPodStaysItsThroughEveryRelease",
    "TestALateRollbackLeavesTheNextPodsInstanceActive",
    "TestAPodStartAndStopCostAtMostOneWriteEach",
    "TestTheIdleAnnotationFollowsEveryChange",
    "TestAReleaseRacingAnAllocateKeepsTheNewAllocationActive",
    "TestAKilledSidecarIsRecoveredByTheNextCall",
    "TestEverySpecTheSidecarWroteLoadsAndInjectsWithTheReferenceLibrary",
    "TestAReuseThenFailRollbackAfterASuccessfulAllocateLeavesTheCacheAsItWas",
    "TestReclaimIdleRefusesAnActiveInstanceAndDestroysTheIdleOne",
    "TestDisablingMigOnAGPUWithOnlyIdleInstancesDestroysThemFirst",
    "TestAPendingReservationInRecoverIsAccepted",
    "TestAnErrorInstanceAtTheExactKeyIsRetriedInsideEnsureAllocation",
    "TestAnErrorInstanceOverlappingThePlacementIsRetriedInsideEnsureAllocation",
    "TestAPendingReservationKeepsTheReconcilerOffTheErrorInstanceAtIt",
    "TestTheRegisterHelperPublishesAnIdleInstanceFirstAndItsReclaimLast",
    "TestTheV210AdapterAnswersEveryCallOfHAMisPlugin",
    "TestTheLazyAdapterAnswersThePR3128MethodSet",
    "TestAnXidOnAnInstanceReachesTheClientsHealthStream",
    "TestAnXidTurnsTheDRADeviceUnhealthyAndTheHealthStreamOutlivesASidecarRestart",
    "TestTheMockPluginRunsItsPodsThroughARealAPIServer",
    "TestTheDRAPluginsMetricsCountTheSidecarsAnswersToRealPrepares",
    "TestHAMisDevicePluginAndTheDRAPluginOnOneSidecarNeverReleaseEachOthersInstances",
    "TestAClaimScheduledByTheRealSchedulerGetsAWarmInstanceBackWithNoGPUInstanceCreated",
    "TestThePluginsNextColdDeviceIsFreedInTheBackgroundAndAClaimThereDestroysNothing",
    "TestALostGPUOfTheRealSidecarTaintsItsOwnDevicesOnlyAndTheOtherStillFollowsItsIdleSet",
    "TestTheSidecarsReserveLeavesTheDRAPluginsGPUToThePlugin",
]
# These also start a real API server (integration/goclient/internal/kubeapi).
GO_E2E_KUBEAPI = {
    "TestTheMockPluginRunsItsPodsThroughARealAPIServer",
    "TestTheDRAPluginsMetricsCountTheSidecarsAnswersToRealPrepares",
    "TestThePluginsNextColdDeviceIsFreedInTheBackgroundAndAClaimThereDestroysNothing",
    "TestHAMisDevicePluginAndTheDRAPluginOnOneSidecarNeverReleaseEachOthersInstances",
    "TestAClaimScheduledByTheRealSchedulerGetsAWarmInstanceBackWithNoGPUInstanceCreated",
    "TestALostGPUOfTheRealSidecarTaintsItsOwnDevicesOnlyAndTheOtherStillFollowsItsIdleSet",
    "TestTheSidecarsReserveLeavesTheDRAPluginsGPUToThePlugin",
}
# These also run the real kube-scheduler against it.
GO_E2E_SCHEDULER = {
    "TestAClaimScheduledByTheRealSchedulerGetsAWarmInstanceBackWithNoGPUInstanceCreated",
    "TestALostGPUOfTheRealSidecarTaintsItsOwnDevicesOnlyAndTheOtherStillFollowsItsIdleSet",
}
# These assert that an ERROR instance is destroyed inside an Allocate; the fixture's reconciler
# (every 0.2 s) would destroy it first, so their sidecar is restarted with a quiet one.
GO_E2E_QUIET_RECONCILER = {
    "TestAnErrorInstanceAtTheExactKeyIsRetriedInsideEnsureAllocation",
    "TestAnErrorInstanceOverlappingThePlacementIsRetriedInsideEnsureAllocation",
}

# Its sidecar trims an instance idle longer than 8 s (the test's idleTTL), one of the changes the
# idle annotation must follow.
GO_E2E_IDLE_TTL = {"TestTheIdleAnnotationFollowsEveryChange": ["--idle-ttl", "8"]}

# Its sidecar keeps a 3g.40gb placement ready on the node (the reserve, which the fixture turns off).
GO_E2E_RESERVE = {"TestTheSidecarsReserveLeavesTheDRAPluginsGPUToThePlugin": ["--idle-reserve", "3g.40gb"]}

# Their sidecar writes the driver's CDI spec (hami-mig-driver-cdi over the simulated node's driver
# root), whose device the DRA plugin's prepare must hand out beside each instance's.
GO_E2E_DRIVER_CDI = {"TestAClaimScheduledByTheRealSchedulerGetsAWarmInstanceBackWithNoGPUInstanceCreated"}
DRIVER_DEVICE = "k8s.hami.io/mig-driver=common"


class TestGoEndToEndSuite:
    def test_the_list_names_every_test_in_the_go_e2e_binary(self, go_binaries: GoBinaries) -> None:
        assert set(go_binaries.e2e_tests()) == set(GO_E2E_TESTS)

    @pytest.mark.parametrize("name", GO_E2E_TESTS)
    def test_the_go_e2e_test_passes_against_a_real_sidecar(
        self, go_binaries: GoBinaries, go_runner: GoRunner, name: str, request: pytest.FixtureRequest
    ) -> None:
        if name in GO_E2E_KUBEAPI:
            go_harness.require_kube_binaries(*(["kube-scheduler"] if name in GO_E2E_SCHEDULER else []))
        if name in GO_E2E_QUIET_RECONCILER:
            go_runner.car.restart(extra_args=["--reconcile-interval", "3600"])
        if name in GO_E2E_IDLE_TTL:
            go_runner.car.restart(extra_args=GO_E2E_IDLE_TTL[name])
        if name in GO_E2E_RESERVE:
            go_runner.car.restart(extra_args=GO_E2E_RESERVE[name])
        if name in GO_E2E_DRIVER_CDI:
            driver: go_harness.DriverCdiBinaries = request.getfixturevalue("driver_cdi_binaries")
            go_runner.car.restart(extra_args=["--driver-cdi-command", str(driver.command)])
            go_runner.driver_device = DRIVER_DEVICE
        result = go_runner.run([str(go_binaries.e2e), "-test.run", f"^{name}$", "-test.v", "-test.count=1"])
        assert result.returncode == 0, result.stdout
        assert f"--- PASS: {name}" in result.stdout, result.stdout
        assert "--- SKIP" not in result.stdout, result.stdout  # a skipped subtest tested nothing


class TestCdiSpecsPassTheReferenceSchema:
    def test_every_spec_file_validates_against_the_builtin_cdi_schema(
        self, go_binaries: GoBinaries, go_runner: GoRunner
    ) -> None:
        code, _, raw = play(go_binaries, go_runner, "restart.yaml")
        assert code == 0, raw
        files = sorted(str(p) for p in Path(go_runner.car.cdi_dir).glob("*.json"))
        assert len(files) == 3
        result = go_runner.run([str(go_binaries.cdischema), *files])
        assert result.returncode == 0, result.stdout
        assert result.stdout.count("ok ") == 3, result.stdout
