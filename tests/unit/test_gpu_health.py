"""launch/gpu_health.py: `shardwise doctor`'s reading of each GPU's health from NVML. The verdicts are
decided on CPU against a fake NVML that answers like nvidia-ml-py (its constants are the real module's)."""
from __future__ import annotations

import types

import pynvml
import pytest

from shardwise.launch.gpu_health import ADVICE, gpu_findings, health_checks
from shardwise.launch.nccl_log import FAIL, OK, WARN

H100 = dict(limit=700_000, default=700_000, reasons=pynvml.nvmlClocksEventReasonGpuIdle, sm=345, top=1980,
            ecc=0, remap=(0, 0, 0, 0), mig=(0, 0), width=16, widest=16)


def fake_nvml(*boards: dict) -> types.SimpleNamespace:
    """NVML over `boards` (handles are their indices); a value None raises NVMLError_NotSupported."""
    def answer(key):
        def read(h, *_):
            value = boards[h][key]
            if value is None:
                raise pynvml.NVMLError_NotSupported(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return value
        return read

    constants = {k: getattr(pynvml, k) for k in dir(pynvml) if k.startswith(("nvmlClocks", "NVML_"))}
    return types.SimpleNamespace(**constants, NVMLError_NotSupported=pynvml.NVMLError_NotSupported,
                                 nvmlDeviceGetEnforcedPowerLimit=answer("limit"),
                                 nvmlDeviceGetPowerManagementDefaultLimit=answer("default"),
                                 nvmlDeviceGetCurrentClocksEventReasons=answer("reasons"),
                                 nvmlDeviceGetClockInfo=answer("sm"), nvmlDeviceGetMaxClockInfo=answer("top"),
                                 nvmlDeviceGetTotalEccErrors=answer("ecc"), nvmlDeviceGetRemappedRows=answer("remap"),
                                 nvmlDeviceGetMigMode=answer("mig"), nvmlDeviceGetCurrPcieLinkWidth=answer("width"),
                                 nvmlDeviceGetMaxPcieLinkWidth=answer("widest"))


def checks(*boards: dict) -> dict[str, tuple[str, str, str]]:
    return {name: (status, detail, advice)
            for name, status, detail, advice in health_checks(fake_nvml(*boards), [(f"cuda:{i}", i) for i in range(len(boards))])}


def test_a_healthy_idle_node_passes_every_check_with_its_readings():
    got = checks(H100, H100)
    assert {name: status for name, (status, _, _) in got.items()} == dict.fromkeys(ADVICE, OK)
    assert got["gpu power limit"][1] == "cuda:0 700 of 700 W; cuda:1 700 of 700 W"
    assert got["gpu clocks"][1].startswith("cuda:0 not held (SM 345 of 1980 MHz)")
    assert all(advice == "" for _, _, advice in got.values())


def test_a_power_capped_gpu_is_named_with_its_watts():
    """torchtitan's H100 benchmarks ran at 500 W of 700 (its docs/performance.md): slower than the datasheet."""
    got = checks(H100, {**H100, "limit": 500_000})
    assert got["gpu power limit"][:2] == (WARN, "cuda:1 500 of 700 W") and "nvidia-smi -pl" in got["gpu power limit"][2]
    assert checks({**H100, "limit": 690_000})["gpu power limit"][0] == OK  # within 5%: not a cap someone set


@pytest.mark.parametrize("reason, status, words", [
    ("HwThermalSlowdown", FAIL, "hardware thermal slowdown"), ("SwThermalSlowdown", FAIL, "thermal slowdown"),
    ("HwPowerBrakeSlowdown", FAIL, "the power brake"), ("SwPowerCap", WARN, "the power cap")])
def test_what_holds_an_idle_gpus_clocks(reason, status, words):
    bit = getattr(pynvml, f"nvmlClocksEventReason{reason}")
    got = checks(H100, {**H100, "reasons": bit | pynvml.nvmlClocksEventReasonGpuIdle, "sm": 900})
    assert got["gpu clocks"][0] == status and got["gpu clocks"][1].startswith(f"cuda:1 held by {words}")
    assert got["gpu clocks"][1].endswith("(SM 900 of 1980 MHz)") and "cuda:0" not in got["gpu clocks"][1]


def test_memory_errors_and_row_remapping_fail_the_node():
    got = checks({**H100, "ecc": 3}, {**H100, "remap": (0, 1, 1, 0)}, {**H100, "remap": (0, 0, 0, 1)})
    status, detail, advice = got["gpu memory errors"]
    assert status == FAIL and advice.startswith("reset the GPU")
    assert detail == ("cuda:0 3 uncorrectable ECC error(s) since the driver loaded; cuda:1 row remapping pending: it "
                      "needs a reset; cuda:2 row remapping failed: it needs replacing")


def test_mig_and_a_narrow_link_warn():
    got = checks({**H100, "mig": (1, 1)}, {**H100, "width": 8})
    assert got["gpu mig"][:2] == (WARN, "cuda:0 MIG on")
    assert got["gpu pcie link"][:2] == (WARN, "cuda:1 x8 of x16")


def test_queries_a_gpu_does_not_support_are_left_out():
    """A consumer card: no ECC, no row remapping, no MIG; the other checks still read."""
    consumer = {**H100, "ecc": None, "remap": None, "mig": None, "default": None}
    found = gpu_findings(fake_nvml(consumer), [("cuda:0", 0)])
    assert found["gpu memory errors"] == [] and found["gpu mig"] == [] and found["gpu power limit"] == []
    assert found["gpu clocks"] == [(OK, "cuda:0 not held (SM 345 of 1980 MHz)")]
    assert set(checks(consumer)) == {"gpu clocks", "gpu pcie link"}


def test_the_sustained_gemm_section_names_what_held_the_clock_and_how_far_the_rate_fell():
    """benchmarks/kernel_sustained.py (kernels.py's sustained section, issue 60's power question): NVML's reasons
    under a full load in the words doctor uses, and the last window's rate over the first's."""
    import sys
    from pathlib import Path

    from shardwise.launch.gpu_health import held_by

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from kernel_sustained import summarize

    mask = pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonGpuIdle
    assert held_by(fake_nvml(H100), mask) == [(WARN, "the power cap")]
    assert held_by(fake_nvml(H100), pynvml.nvmlClocksEventReasonGpuIdle) == []
    windows = [{"flops": 7.9e14, "sm_mhz": 1980, "power_w": 690.0, "held_by": []},
               {"flops": 7.1e14, "sm_mhz": 1755, "power_w": 700.0, "held_by": ["the power cap"]},
               {"flops": 7.2e14, "sm_mhz": 1770, "power_w": 698.0, "held_by": ["the power cap"]}]
    got = summarize(windows)
    assert got["last_over_first"] == pytest.approx(7.2 / 7.9) and got["min_flops"] == 7.1e14
    assert (got["first_sm_mhz"], got["last_sm_mhz"], got["min_sm_mhz"]) == (1980, 1770, 1755)
    assert got["held_by"] == ["the power cap"] and got["mean_power_w"] == pytest.approx(696.0)
    assert "first_sm_mhz" not in summarize([{"flops": 1e11}, {"flops": 1e11}])  # a CPU: no NVML reading
