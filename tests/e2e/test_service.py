"""The service on its socket, seen from outside: a real ``serve`` process on simulated GPUs
(h100-80gb:2, a100-40gb:1), driven over gRPC and through the command line."""

from __future__ import annotations

import ctypes
import fcntl
import json
import math
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from sidecar_process import CALL_TIMEOUT_S, STOP_TIMEOUT_S, Sidecar, SidecarFactory, error_info

from sidecar import __version__

pytestmark = pytest.mark.e2e

SERVICE = "hami.migsidecar.v1.MigSidecar"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def h100(sidecar: Sidecar) -> pb.Gpu:
    return next(g for g in sidecar.gpus() if "H100" in g.model)


def allocate_request(
    gpu_uuid: str, profile: str, start: int, size: int, pod_uid: str = "pod-a"
) -> pb.AllocateRequest:
    return pb.AllocateRequest(
        pod=pb.PodRef(uid=pod_uid, namespace="default", name=f"{pod_uid}-name"),
        container_name="main",
        container_index=0,
        devices=[
            pb.DeviceRequest(
                device_index=0,
                gpu_uuid=gpu_uuid,
                profile=profile,
                placement=pb.Placement(start=start, size=size),
            )
        ],
    )


class TestSocketAndLock:
    def test_the_socket_is_a_socket_with_mode_0660(self, sidecar: Sidecar) -> None:
        mode = sidecar.socket.lstat().st_mode
        assert stat.S_ISSOCK(mode)
        assert stat.S_IMODE(mode) == 0o660

    def test_a_second_sidecar_on_the_same_state_dir_is_refused_and_the_first_keeps_serving(
        self, sidecar: Sidecar, sidecar_factory: SidecarFactory
    ) -> None:
        inode = sidecar.socket.stat().st_ino
        second = sidecar_factory(start=False, root=sidecar.root)
        code = second.spawn().wait(timeout=60)
        assert code != 0
        assert "locked by another running sidecar" in second.log_text()
        assert sidecar.socket.stat().st_ino == inode, "the second sidecar must not touch the socket"
        assert sidecar.info().api_version == "v1"

    def test_sigterm_exits_zero_and_removes_the_socket(self, sidecar: Sidecar) -> None:
        assert sidecar.terminate() == 0
        assert not sidecar.socket.exists()

    def test_a_stale_socket_left_by_kill_9_is_replaced_on_restart(self, sidecar: Sidecar) -> None:
        first = sidecar.info().started_at.ToNanoseconds()
        sidecar.kill9()
        assert sidecar.socket.exists()
        sidecar.restart()
        assert sidecar.info().started_at.ToNanoseconds() != first

    def test_the_nvml_backend_without_a_driver_fails_clearly_and_never_serves(
        self, sidecar_factory: SidecarFactory
    ) -> None:
        try:
            ctypes.CDLL("libnvidia-ml.so.1")
        except OSError:
            pass
        else:
            pytest.skip("this machine has an NVIDIA driver")
        car = sidecar_factory(start=False)
        command = [
            sys.executable, "-m", "sidecar", "serve", "--backend", "nvml",
            "--state-dir", str(car.state_dir), "--cdi-dir", str(car.cdi_dir), "--socket", str(car.socket),
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode != 0
        assert "cannot open the nvml backend" in result.stderr
        assert "--backend simulated" in result.stderr
        assert not car.socket.exists()


def failed_start(car: Sidecar) -> tuple[int, list[dict[str, Any]]]:
    """Run a sidecar that must not start: (its exit code, the JSON lines it logged). Its stderr must be
    JSON lines only - a Python traceback there means an error escaped the startup path."""
    code = car.spawn().wait(timeout=60)
    lines = [line for line in car.log_text().splitlines() if not line.startswith("--- start ")]
    assert all(line.startswith("{") for line in lines), car.log_text()
    return code, [json.loads(line) for line in lines]


class TestStartupFailures:
    """A startup that cannot go on says why in one JSON line and exits 1, having released what it took."""

    def test_a_state_dir_that_is_a_regular_file_fails_with_one_clear_line(
        self, sidecar_factory: SidecarFactory
    ) -> None:
        car = sidecar_factory(start=False)
        state_file = car.root / "not-a-dir"
        state_file.write_text("")
        car.extra_args = ["--state-dir", str(state_file)]
        code, events = failed_start(car)
        assert code == 1
        (failed,) = [e for e in events if e["msg"] == "startup failed"]
        assert f"state directory {state_file}" in failed["error"]
        assert failed["level"] == "ERROR"
        assert not car.socket.exists()
        assert state_file.read_text() == ""

    def test_a_socket_path_under_a_regular_file_fails_with_one_clear_line(
        self, sidecar_factory: SidecarFactory
    ) -> None:
        car = sidecar_factory(start=False)
        blocker = car.root / "afile"
        blocker.write_text("")
        socket = blocker / "s.sock"
        car.extra_args = ["--socket", str(socket)]
        code, events = failed_start(car)
        assert code == 1
        (failed,) = [e for e in events if e["msg"] == "startup failed"]
        assert str(socket) in failed["error"]
        assert not any(e["msg"] == "serving" for e in events)
        assert blocker.read_text() == ""


CRASH_IN_CDI_WRITE = """
import os, sys
from pathlib import Path
from sidecar.store import durable
from sidecar.store.cdi import CdiSpecs

os.fsync = lambda fd: os._exit(137)  # killed between writing the temp file and renaming it
durable.atomic_write(CdiSpecs(Path(sys.argv[1])).spec_path(sys.argv[2]), b"{}", 0o644)
"""


class TestCdiTempSweep:
    def test_startup_removes_the_temp_file_a_crashed_cdi_write_left_and_nothing_else(
        self, sidecar_factory: SidecarFactory
    ) -> None:
        car = sidecar_factory(start=False)
        car.cdi_dir.mkdir()
        mig = "MIG-2923e22f-df83-5d8f-88fe-e176c7516c96"
        crashed = subprocess.run(
            [sys.executable, "-c", CRASH_IN_CDI_WRITE, str(car.cdi_dir), mig], check=False, timeout=60
        )
        assert crashed.returncode == 137
        (leftover,) = car.cdi_files()
        assert leftover.startswith(f".k8s.hami.io-mig_{mig}.tmp-")
        unrelated = {
            "k8s.device-plugin.nvidia.com-gpu.json": '{"cdiVersion":"0.5.0"}',
            f".k8s.device-plugin.nvidia.com-gpu_{mig}.tmp-0123456789abcdef": "another writer's",
        }
        for name, text in unrelated.items():
            (car.cdi_dir / name).write_text(text)

        car.start()
        car.log_event("serving")

        assert car.cdi_files() == sorted(unrelated)
        for name, text in unrelated.items():
            assert (car.cdi_dir / name).read_text() == text


def creating(car: Sidecar) -> bool:
    """Whether a CREATING record is on disk: an Allocate is between its intent and its completion."""
    for path in car.state_dir.glob("*.json"):
        try:
            if json.loads(path.read_bytes())["record"]["state"] == "CREATING":
                return True
        except FileNotFoundError:
            continue  # removed between the listing and the read
    return False


def lock_is_free(car: Sidecar) -> bool:
    """Try the state directory's flock without blocking, as a second sidecar would; release it at once."""
    with (car.state_dir / ".lock").open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(lock, fcntl.LOCK_UN)
        return True


class TestGracefulShutdown:
    """SIGTERM while an Allocate outlives the grace period: the call runs to its end before the
    reconciler stops, NVML closes and the state directory lock is released."""

    def test_a_slow_allocate_keeps_the_lock_until_it_ends_and_leaves_a_whole_instance_or_none(
        self, sidecar_factory: SidecarFactory
    ) -> None:
        car = sidecar_factory(extra_args=["--shutdown-grace", "0.5"])
        car.recover()
        gpu = h100(car)
        car.sim("latency", "create-gi", "3")  # the GI exists at once; the call returns 3 s later
        answers: list[Any] = []

        def allocate() -> None:
            try:
                answers.append(car.stub.Allocate(allocate_request(gpu.uuid, "1g.10gb", 0, 1), timeout=60))
            except grpc.RpcError as err:
                answers.append(error_info(err))

        caller = threading.Thread(target=allocate)
        caller.start()
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while not creating(car):  # the intent is on disk: the call is inside the lifecycle
            assert time.monotonic() < deadline, f"no CREATING record appeared:\n{car.log_text()}"
            time.sleep(0.02)
        assert car.proc is not None
        car.proc.send_signal(signal.SIGTERM)

        lock_taken_mid_call = False
        while car.running and creating(car):
            # CREATING only ever moves on, so CREATING read after a successful flock means the call
            # was still running while another sidecar could have taken the directory.
            if lock_is_free(car) and creating(car):
                lock_taken_mid_call = True
                break
            time.sleep(0.05)
        code = car.proc.wait(timeout=STOP_TIMEOUT_S)
        caller.join(timeout=CALL_TIMEOUT_S)

        assert not lock_taken_mid_call, f"the lock was free while the Allocate ran:\n{car.log_text()}"
        assert code == 0, car.log_text()
        assert answers, "the Allocate never returned"
        records = car.records()
        gis = [gi for g in car.hardware() if g["uuid"] == gpu.uuid for gi in g["gis"]]
        assert [r["state"] for r in records.values()] in ([], ["ACTIVE"]), (records, car.log_text())
        if records:  # completed: one ACTIVE record, its GI with its CI, its CDI spec
            (record,) = records.values()
            assert [ci["mig_uuid"] for gi in gis for ci in gi["cis"]] == [record["mig_uuid"]]
            assert any(record["mig_uuid"] in name for name in car.cdi_files())
        else:  # undone: nothing on the hardware, no CDI spec
            assert gis == []
            assert car.cdi_files() == []


# A child that serves from its main thread while another of its threads takes the SIGTERM, as the
# kernel may choose: the signal is directed at that thread, which stays alive and busy.
SIGNAL_ON_ANOTHER_THREAD = """
import signal, sys, threading, time
from pathlib import Path
from sidecar.cli import main

socket = Path(sys.argv[1])

def take_the_signal():
    while not socket.exists():
        time.sleep(0.02)
    time.sleep(0.2)
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
    while True:
        time.sleep(1)

threading.Thread(target=take_the_signal, daemon=True).start()
sys.exit(main(sys.argv[2:]))
"""


def test_a_sigterm_taken_by_another_thread_still_stops_the_sidecar(sidecar_factory: SidecarFactory) -> None:
    """The main thread is woken however the kernel routes the signal; an untimed wait there would
    leave the sidecar running until the kubelet's SIGKILL."""
    car = sidecar_factory(start=False)
    argv = car.command()[3:]  # after "python -m sidecar"
    with car.log_path.open("ab") as log:
        child = subprocess.Popen(
            [sys.executable, "-c", SIGNAL_ON_ANOTHER_THREAD, str(car.socket), *argv], stdout=log, stderr=log
        )
    try:
        code = child.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        pytest.fail(f"the sidecar ignored a SIGTERM taken by another thread:\n{car.log_text()}")
    assert code == 0, car.log_text()
    assert '"msg":"stopping","signal":"SIGTERM"' in car.log_text()
    assert not car.socket.exists()


class TestHealthAndRecoveryGate:
    def test_the_process_is_serving_but_the_service_is_not_before_recover(self, sidecar: Sidecar) -> None:
        assert sidecar.health_status("") == SERVING
        assert sidecar.health_status(SERVICE) == NOT_SERVING
        assert sidecar.info().recovered is False

    def test_the_service_turns_serving_after_a_successful_recover(self, sidecar: Sidecar) -> None:
        sidecar.recover()
        assert sidecar.health_status(SERVICE) == SERVING
        assert sidecar.info().recovered is True

    def test_mutating_calls_fail_with_not_recovered_before_recover(self, sidecar: Sidecar) -> None:
        gpu = h100(sidecar)
        calls: list[Callable[[], object]] = [
            lambda: sidecar.stub.Allocate(allocate_request(gpu.uuid, "1g.10gb", 0, 1)),
            lambda: sidecar.stub.Release(pb.ReleaseRequest(pod_uid="pod-a")),
            lambda: sidecar.stub.SyncActive(pb.SyncActiveRequest(generation=0)),
            lambda: sidecar.stub.SetMigMode(pb.SetMigModeRequest(gpu_uuid=gpu.uuid, enabled=True)),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as caught:
                call()
            code, reason, _ = error_info(caught.value)
            assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "NOT_RECOVERED")

    def test_after_recover_an_allocation_succeeds(self, sidecar: Sidecar) -> None:
        sidecar.recover()
        gpu = h100(sidecar)
        response = sidecar.stub.Allocate(allocate_request(gpu.uuid, "1g.10gb", 0, 1))
        (device,) = response.devices
        assert device.outcome == pb.CREATED
        assert device.mig_uuid.startswith("MIG-")
        assert device.cdi_device == f"k8s.hami.io/mig={device.mig_uuid}"


class TestQueries:
    def test_get_info_describes_the_running_sidecar(self, sidecar: Sidecar) -> None:
        info = sidecar.info()
        assert info.api_version == "v1"
        assert info.sidecar_version == __version__
        assert info.backend == "simulated"
        assert info.boot_id
        assert info.cdi_enabled is True
        assert info.adopt_existing is False
        assert info.started_at.seconds > 0

    def test_get_info_reports_legacy_mode_and_adoption_when_configured(
        self, sidecar_factory: SidecarFactory
    ) -> None:
        car = sidecar_factory(extra_args=["--no-cdi", "--adopt-existing-mig-instances"])
        info = car.info()
        assert (info.cdi_enabled, info.adopt_existing) == (False, True)

    def test_list_gpus_shows_the_simulated_node(self, sidecar: Sidecar) -> None:
        gpus = sidecar.gpus()
        assert [g.index for g in gpus] == [0, 1, 2]
        assert sum("H100 80GB" in g.model for g in gpus) == 2
        assert sum("A100" in g.model and "40GB" in g.model for g in gpus) == 1
        assert len({g.uuid for g in gpus}) == 3
        assert all(g.uuid.startswith("GPU-") for g in gpus)
        assert all(g.mig_mode.current for g in gpus)
        assert not any(g.busy for g in gpus)

    def test_h100_profiles_carry_nvml_ids_placements_and_core_percent(self, sidecar: Sidecar) -> None:
        gpu = h100(sidecar)
        profiles = {
            p.name: p
            for p in sidecar.stub.DiscoverProfiles(pb.DiscoverProfilesRequest(gpu_uuid=gpu.uuid)).profiles
        }
        one = profiles["1g.10gb"]
        assert one.gi_profile_id == 19
        assert one.slice_count == 1
        assert one.instance_count == 7
        assert [(p.start, p.size) for p in one.placements] == [(i, 1) for i in range(7)]
        assert one.core_percent == math.ceil(16 * 100 / 132)
        full = profiles["7g.80gb"]
        assert full.gi_profile_id == 0
        assert [(p.start, p.size) for p in full.placements] == [(0, 8)]
        assert full.core_percent == 100
        assert profiles["1g.20gb"].gi_profile_id == 15
        assert [(p.start, p.size) for p in profiles["1g.20gb"].placements] == [(0, 2), (2, 2), (4, 2), (6, 2)]

    def test_allowed_profiles_filter_the_answer(self, sidecar: Sidecar) -> None:
        gpu = h100(sidecar)
        request = pb.DiscoverProfilesRequest(gpu_uuid=gpu.uuid, allowed_profiles=["3g.40gb", "1g.10gb"])
        names = {p.name for p in sidecar.stub.DiscoverProfiles(request).profiles}
        assert names == {"3g.40gb", "1g.10gb"}

    def test_an_unknown_name_in_allowed_profiles_is_unknown_profile(self, sidecar: Sidecar) -> None:
        gpu = h100(sidecar)
        request = pb.DiscoverProfilesRequest(gpu_uuid=gpu.uuid, allowed_profiles=["1g.10gb", "9g.99gb"])
        with pytest.raises(grpc.RpcError) as caught:
            sidecar.stub.DiscoverProfiles(request)
        code, reason, metadata = error_info(caught.value)
        assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "UNKNOWN_PROFILE")
        assert metadata["profile"] == "9g.99gb"

    def test_profiles_of_an_unknown_gpu_are_not_found(self, sidecar: Sidecar) -> None:
        request = pb.DiscoverProfilesRequest(gpu_uuid="GPU-00000000-0000-0000-0000-000000000000")
        with pytest.raises(grpc.RpcError) as caught:
            sidecar.stub.DiscoverProfiles(request)
        code, reason, _ = error_info(caught.value)
        assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "UNKNOWN_GPU")


class TestRequestValidation:
    @pytest.mark.parametrize(
        "mutate",
        [
            pytest.param(lambda r: r.pod.ClearField("uid"), id="missing pod uid"),
            pytest.param(lambda r: r.ClearField("pod"), id="missing pod"),
            pytest.param(lambda r: r.devices[0].ClearField("placement"), id="missing placement"),
            pytest.param(lambda r: r.ClearField("devices"), id="no devices"),
            pytest.param(lambda r: setattr(r.devices[0], "gpu_uuid", "gpu-zero"), id="malformed gpu uuid"),
            pytest.param(lambda r: setattr(r.devices[0], "profile", ""), id="missing profile"),
            pytest.param(lambda r: setattr(r.devices[0].placement, "size", 0), id="empty placement"),
        ],
    )
    def test_malformed_allocate_requests_are_invalid_request(self, sidecar: Sidecar, mutate: object) -> None:
        sidecar.recover()
        request = allocate_request(h100(sidecar).uuid, "1g.10gb", 0, 1)
        mutate(request)  # type: ignore[operator]
        with pytest.raises(grpc.RpcError) as caught:
            sidecar.stub.Allocate(request)
        code, reason, _ = error_info(caught.value)
        assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST")

    def test_validation_errors_win_over_the_recovery_gate(self, sidecar: Sidecar) -> None:
        with pytest.raises(grpc.RpcError) as caught:
            sidecar.stub.Allocate(pb.AllocateRequest())
        assert error_info(caught.value)[1] == "INVALID_REQUEST"

    def test_an_invalid_request_modifies_nothing(self, sidecar: Sidecar) -> None:
        sidecar.recover()
        gpu = h100(sidecar)
        request = allocate_request(gpu.uuid, "1g.10gb", 0, 1)
        request.devices.append(pb.DeviceRequest(device_index=1, gpu_uuid=gpu.uuid, profile="1g.10gb"))
        with pytest.raises(grpc.RpcError):
            sidecar.stub.Allocate(request)
        state = sidecar.stub.GetState(pb.GetStateRequest())
        assert all(not g.instances and not g.foreign for g in state.gpus)
        assert list(sidecar.state_dir.glob("*.json")) == []


class TestStatusCommand:
    def test_status_prints_gpus_owned_and_foreign_instances_as_a_table(self, sidecar: Sidecar) -> None:
        sidecar.recover()
        gpu = h100(sidecar)
        device = sidecar.stub.Allocate(allocate_request(gpu.uuid, "3g.40gb", 4, 4)).devices[0]
        sidecar.sim("create", "--gpu", str(gpu.index), "--profile", "1g.10gb", "--placement", "0:1")
        result = sidecar.cli("status", "--socket", str(sidecar.socket))
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        owned = next(line for line in lines if device.mig_uuid in line)
        assert owned.split()[:4] == [str(gpu.index), "ACTIVE", "3g.40gb", "4:4"]
        assert "default/pod-a-name[0/0]" in owned
        foreign_header = lines.index(next(line for line in lines if line.startswith("FOREIGN")))
        assert any(line.split()[:3] == [str(gpu.index), "1g.10gb", "0:1"] for line in lines[foreign_header:])

    def test_status_json_is_the_get_info_and_get_state_responses(self, sidecar: Sidecar) -> None:
        sidecar.recover()
        result = sidecar.cli("status", "--json", "--socket", str(sidecar.socket))
        assert result.returncode == 0, result.stderr
        document = json.loads(result.stdout)
        assert document["info"]["backend"] == "simulated"
        assert document["info"]["recovered"] is True
        assert len(document["state"]["gpus"]) == 3

    def test_status_without_a_socket_fails_with_a_clear_message(self, sidecar: Sidecar) -> None:
        result = sidecar.cli("status", "--socket", str(sidecar.root / "missing.sock"))
        assert result.returncode == 1
        assert "no sidecar socket" in result.stderr


class TestRecordsVerifyCommand:
    def test_verify_passes_on_valid_records_and_fails_on_a_corrupt_one(self, sidecar: Sidecar) -> None:
        sidecar.recover()
        gpu = h100(sidecar)
        sidecar.stub.Allocate(allocate_request(gpu.uuid, "1g.10gb", 0, 1))
        ok = sidecar.cli(
            "records", "verify", "--state-dir", str(sidecar.state_dir), "--boot-id", sidecar.info().boot_id
        )
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert "1 valid (0 stale), 0 corrupt" in ok.stdout

        (record,) = sidecar.state_dir.glob("*.json")
        record.write_bytes(record.read_bytes().rstrip()[:-5])
        bad = sidecar.cli("records", "verify", "--state-dir", str(sidecar.state_dir))
        assert bad.returncode == 1
        assert "CORRUPT" in bad.stdout
        assert record.exists(), "verify never deletes a corrupt record"

    def test_verify_of_a_missing_directory_fails(self, sidecar: Sidecar) -> None:
        result = sidecar.cli("records", "verify", "--state-dir", str(sidecar.root / "nowhere"))
        assert result.returncode == 1


class TestMetrics:
    def test_metrics_count_creations_and_reuse_and_show_instances_by_state(
        self, sidecar_factory: SidecarFactory
    ) -> None:
        import urllib.request  # noqa: PLC0415

        car = sidecar_factory(extra_args=["--metrics-address", "127.0.0.1:0"])
        port = car.log_event("serving")["metrics"]
        car.recover()
        gpu = h100(car)
        car.stub.Allocate(allocate_request(gpu.uuid, "1g.10gb", 0, 1))
        car.stub.Release(pb.ReleaseRequest(pod_uid="pod-a"))
        reused = car.stub.Allocate(allocate_request(gpu.uuid, "1g.10gb", 0, 1, pod_uid="pod-b"))
        assert reused.devices[0].outcome == pb.REUSED
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
        assert "hami_mig_sidecar_reuse_hits_total 1.0" in text
        assert "hami_mig_sidecar_gpu_instance_creations_total 1.0" in text
        assert f'hami_mig_sidecar_instances{{gpu="{gpu.uuid}",state="ACTIVE"}} 1.0' in text
        assert 'hami_mig_sidecar_rpc_duration_seconds_count{code="OK",method="Allocate"} 2.0' in text
