"""The seams that let the trainer's step run on meta tensors under torch's fake process group (launch/
dryrun_step.py, issue 58). Each is a patch of torch's, scoped to the dry run's step (meta_step) or made on
the dry run's own objects (fsdp_on_meta, meta_backends); none changes what a collective moves."""
from __future__ import annotations

import contextlib

import torch


class MetaStreams:
    """The meta device's streams and events for FSDP2: the CPU's no-ops (torch.cpu), except that a stream's
    record_event gives an event (FSDP2 asserts one off the CPU: HSDP's and replicate's all-reduce)."""

    class Stream(torch.cpu.Stream):
        def record_event(self, event=None):
            return torch.cpu.Event()

    def current_stream(self, device=None) -> "MetaStreams.Stream":
        return self.Stream()

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)


class MetaAutocast(torch.autocast):
    """torch.autocast for device_type "meta": the CPU's, which casts no meta tensor (torch has no autocast
    for meta: dryrun_step.py `skipped` names the layouts where the casts would change what is counted)."""

    def __init__(self, device_type: str, *args, **kwargs):
        super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)


def _cpu_for_meta(query):
    """`query` (torch.is_autocast_enabled / get_autocast_dtype) asked of the CPU where it is asked of meta."""
    def asked(*args):
        return query(*("cpu" if a == "meta" else a for a in args))
    return asked


@contextlib.contextmanager
def meta_step():
    """The step on meta parameters:
      - FSDP2 refuses meta parameters (FSDPParamGroup._validate_no_meta_params, in its lazy init): that one
        check is off; it asks torch for the meta device's streams and events (device_mesh._get_device_handle,
        which has none for meta): it gets MetaStreams. Every other path of FSDP2 (all-gather copy-in and
        -out, reduce-scatter, HSDP's and replicate's all-reduce, resharding) runs as it is (fsdp_on_meta);
      - the pipeline schedules' first-step vote is each stage's own (static_vote);
      - torch.autocast refuses the meta device (the trainer's forward, the pipeline stages', ring attention's
        fp32 region): MetaAutocast, and 2-D TP's queries of it are the CPU's;
      - gradient clipping's foreach norms, which torch allows on a GPU and a CPU but not on meta, are
        allowed there too (torch._foreach_norm has meta kernels), as train/optim.py asks (foreach=True)."""
    from unittest import mock

    from torch.distributed.device_mesh import _get_device_handle
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param_group, _fsdp_state
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.pipelining.schedules import _PipelineSchedule
    from torch.nn.utils import clip_grad
    from torch.utils._foreach_utils import _device_has_foreach_support as foreach_support

    def handle(device_type: str = "cuda"):
        return MetaStreams() if device_type == "meta" else _get_device_handle(device_type)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(FSDPParamGroup, "_validate_no_meta_params", lambda self: None))
        for module in (_fsdp_collectives, _fsdp_param_group, _fsdp_state):
            stack.enter_context(mock.patch.object(module, "_get_device_handle", handle))
        stack.enter_context(mock.patch.object(_PipelineSchedule, "_warmup_p2p", static_vote))
        stack.enter_context(mock.patch.object(torch, "autocast", MetaAutocast))
        for name in ("is_autocast_enabled", "get_autocast_dtype"):  # 2-D TP's SUMMA asks them of its device
            stack.enter_context(mock.patch.object(torch, name, _cpu_for_meta(getattr(torch, name))))
        # gradient clipping's foreach norms (train/optim.py clip_grad_norm, foreach=True as on a GPU or CPU)
        stack.enter_context(mock.patch.object(clip_grad, "_device_has_foreach_support",
                                              lambda device: device.type == "meta" or foreach_support(device)))
        yield


def static_vote(schedule, stages, has_backward: bool, p2p_done: bool) -> None:
    """torch's pipeline schedules open their first step with a vote over every stage (a 4-byte send and
    recv per neighbour, then .item() of the result): static shapes everywhere or not. Under the fake group
    nothing arrives and a meta result has no value; every rank builds its stages as this one does
    (parallel/pipeline.py PipelineRun: static input and output shapes), so each local stage's own vote is
    the result. The handshake is first-step traffic, which the planner leaves out (plan/comm.py)."""
    from torch.distributed.pipelining._utils import InferenceMode

    static = all(not InferenceMode.needs_dynamic(stage._user_meta, has_backward) for stage in stages)
    for stage in stages:
        stage._inference_mode = InferenceMode.STATIC if static else InferenceMode.DYNAMIC


def meta_backends(group_names) -> None:
    """Point each process group's meta device at its fake backend: torch.distributed.batch_isend_irecv (the
    pipeline schedules' and ring attention's sends and receives) looks the backend up by the tensors' device,
    which the fake group registers for the CPU and GPUs only."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    meta = torch.device("meta")
    for name in group_names:
        group = _resolve_process_group(name)
        try:
            group._get_backend(meta)
        except RuntimeError:
            group._register_backend(meta, dist.ProcessGroup.BackendType.CUSTOM, group._get_backend(torch.device("cpu")))


def fsdp_on_meta(model) -> None:
    """FSDP2 allocates its all-gather outputs and reduce-scatter buffers on its mesh's device (the CPU mesh
    of the dry run): on meta parameters those would be real host tensors of a whole unit, which a meta
    computation cannot mix with. Each FSDP2 state, parameter group and parameter of `model` is told the meta
    device instead, with MetaStreams for its streams and events."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    meta = torch.device("meta")
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        state = state() if state is not None else None
        if not isinstance(state, FSDPState):
            continue
        state._device, state._device_handle = meta, MetaStreams()  # the root's lazy init makes the streams
        group = state._fsdp_param_group
        if group is None:
            continue
        group.device, group.device_handle = meta, MetaStreams()
        for param in group.fsdp_params:
            param.device = meta
