"""`shardwise doctor`'s GPU health, read from NVML (nvidia-ml-py): what makes a GPU slower than its
datasheet, or unfit to train, that no collective test shows.

  power limit  the enforced board limit below the default (e.g. an H100 SXM held at 500 of its 700 W):
               under a full load its clocks, and so every step, drop; the planner prices the datasheet
  clocks       why the clocks are held down now: thermal or hardware slowdown, or the power brake, on a GPU
               doctor found idle, is a cooling or power fault (fail); a software power cap at idle, a warning
  memory       uncorrectable ECC errors since the driver loaded (results may already be wrong), and row
               remapping pending (the GPU needs a reset) or failed (it needs replacing)
  MIG          a MIG slice holds a fraction of the GPU's compute and memory: the planner's table entry is
               the whole GPU
  PCIe         the link narrower than the GPU supports (x8 of x16): host <-> GPU copies (offload, batches)
               at a fraction of their speed. Only the width: an idle GPU lowers its link generation itself.

Each is one check over every visible GPU, named by its worst finding; a query the GPU does not support
(NVMLError_NotSupported: no ECC on a consumer card, no row remapping before Ampere) is left out of it.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardwise.launch.nccl_log import FAIL, OK, SKIP, WARN

# A limit this far under the default is a cap someone set (the defaults are whole watts).
POWER_CAP_FRACTION = 0.95
_ORDER = (OK, WARN, FAIL)
# Clock-event reasons (nvml.h nvmlClocksEventReason*) and what each means on an idle GPU: (status, words).
_REASONS = (("HwThermalSlowdown", FAIL, "hardware thermal slowdown"),
            ("SwThermalSlowdown", FAIL, "thermal slowdown (the driver's)"),
            ("HwPowerBrakeSlowdown", FAIL, "the power brake (an external signal from the power supply)"),
            ("HwSlowdown", FAIL, "hardware slowdown (thermal or power)"),
            ("SwPowerCap", WARN, "the power cap"))


def _worst(statuses: list[str]) -> str:
    return max(statuses, key=_ORDER.index) if statuses else OK


def _query(nvml: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, or None where the GPU does not support the query."""
    try:
        return fn(*args)
    except nvml.NVMLError_NotSupported:
        return None


def _reason_bit(nvml: Any, name: str) -> int:
    return getattr(nvml, f"nvmlClocksEventReason{name}", None) or getattr(nvml, f"nvmlClocksThrottleReason{name}")


def _power(nvml: Any, name: str, h: Any) -> tuple[str, str] | None:
    limit = _query(nvml, nvml.nvmlDeviceGetEnforcedPowerLimit, h)
    default = _query(nvml, nvml.nvmlDeviceGetPowerManagementDefaultLimit, h)
    if not (limit and default):
        return None
    return WARN if limit < POWER_CAP_FRACTION * default else OK, f"{name} {limit / 1e3:.0f} of {default / 1e3:.0f} W"


def clock_event_reasons(nvml: Any, h: Any) -> int | None:
    """The GPU's clock-event reasons mask (nvidia-ml-py's name for it before and since 12.5), None when the GPU
    does not support the query."""
    read = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    return _query(nvml, read, h)


def held_by(nvml: Any, reasons: int) -> list[tuple[str, str]]:
    """(status on an idle GPU, words) of each clock-event reason set in an NVML reasons mask (_REASONS); also
    read under load by benchmarks/kernel_sustained.py, where the power cap is what a full load meets."""
    return [(status, words) for bit, status, words in _REASONS if reasons & _reason_bit(nvml, bit)]


def _clocks(nvml: Any, name: str, h: Any) -> tuple[str, str] | None:
    reasons = clock_event_reasons(nvml, h)
    if reasons is None:
        return None
    held = held_by(nvml, reasons)
    sm = _query(nvml, nvml.nvmlDeviceGetClockInfo, h, nvml.NVML_CLOCK_SM)
    top = _query(nvml, nvml.nvmlDeviceGetMaxClockInfo, h, nvml.NVML_CLOCK_SM)
    clock = f" (SM {sm} of {top} MHz)" if sm and top else ""
    if not held:
        return OK, f"{name} not held{clock}"
    return _worst([s for s, _ in held]), f"{name} held by {', '.join(w for _, w in held)}{clock}"


def _memory(nvml: Any, name: str, h: Any) -> tuple[str, str] | None:
    errors = _query(nvml, nvml.nvmlDeviceGetTotalEccErrors, h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                    nvml.NVML_VOLATILE_ECC)
    remap = _query(nvml, nvml.nvmlDeviceGetRemappedRows, h)  # (corrected, uncorrected, pending, failed)
    if errors is None and remap is None:
        return None
    bad = ([f"{errors} uncorrectable ECC error(s) since the driver loaded"] if errors else []) + \
        (["row remapping pending: it needs a reset"] if remap is not None and remap[2] else []) + \
        (["row remapping failed: it needs replacing"] if remap is not None and remap[3] else [])
    return (FAIL, f"{name} {'; '.join(bad)}") if bad else (OK, f"{name} none")


def _mig(nvml: Any, name: str, h: Any) -> tuple[str, str] | None:
    mig = _query(nvml, nvml.nvmlDeviceGetMigMode, h)  # (current, pending)
    if mig is None:
        return None
    on = mig[0] == nvml.NVML_DEVICE_MIG_ENABLE
    return WARN if on else OK, f"{name} {'MIG on' if on else 'whole GPU'}"


def _pcie(nvml: Any, name: str, h: Any) -> tuple[str, str] | None:
    width = _query(nvml, nvml.nvmlDeviceGetCurrPcieLinkWidth, h)
    widest = _query(nvml, nvml.nvmlDeviceGetMaxPcieLinkWidth, h)
    if not (width and widest):
        return None
    return WARN if width < widest else OK, f"{name} x{width} of x{widest}"


CHECKS = {"gpu power limit": _power, "gpu clocks": _clocks, "gpu memory errors": _memory, "gpu mig": _mig,
          "gpu pcie link": _pcie}


def gpu_findings(nvml: Any, gpus: list[tuple[str, Any]]) -> dict[str, list[tuple[str, str]]]:
    """Per check, (status, words) for each GPU (`gpus`: its name in the report and its NVML handle) that
    answered the check's queries."""
    return {check: [r for name, h in gpus if (r := read(nvml, name, h)) is not None] for check, read in CHECKS.items()}


ADVICE = {
    "gpu power limit": "restore the default limit (`nvidia-smi -pl WATTS`, as root) or ask the cluster's admins; "
                       "the planner prices the datasheet: `shardwise plan calibrate` from a run here prices what it gets",
    "gpu clocks": "check the cooling and power of that GPU (`nvidia-smi -q -d PERFORMANCE,TEMPERATURE`); leave it "
                  "out (CUDA_VISIBLE_DEVICES) until fixed",
    "gpu memory errors": "reset the GPU (`nvidia-smi -r`, or reboot the node) and drain it if errors return; leave "
                         "it out (CUDA_VISIBLE_DEVICES) meanwhile",
    "gpu mig": "disable MIG (`nvidia-smi -mig 0`) for training, or plan with the slice's own measured speed",
    "gpu pcie link": "reseat the card or check the slot's BIOS setting; until then offload and batch copies are slow",
}


def health_checks(nvml: Any, gpus: list[tuple[str, Any]]) -> list[tuple[str, str, str, str]]:
    """(name, status, detail, advice) per check that had anything to read."""
    out = []
    for check, items in gpu_findings(nvml, gpus).items():
        if not items:
            continue
        status = _worst([s for s, _ in items])
        shown = [w for s, w in items if s != OK] or [w for _, w in items]  # the findings, else every GPU's reading
        out.append((check, status, "; ".join(shown), ADVICE[check] if status != OK else ""))
    return out


def nvml_gpus(count: int) -> tuple[Any, list[tuple[str, Any]]] | str:
    """(pynvml, [(cuda:i, handle)]) for the `count` visible GPUs, matched by UUID (CUDA_VISIBLE_DEVICES may
    reorder them), or why there is nothing to read."""
    import torch

    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
        gpus = []
        for i in range(count):
            uuid = str(torch.cuda.get_device_properties(i).uuid)
            gpus.append((f"cuda:{i}", pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")))
    except Exception as e:  # noqa: BLE001  (pynvml's NVMLError subclasses: no driver, no such device)
        return f"NVML did not answer: {e}"
    return pynvml, gpus


def skipped(why: str) -> tuple[str, str, str, str]:
    return ("gpu health", SKIP, why, "")
