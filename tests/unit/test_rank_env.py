"""train/distributed.py rank_env: rank, local rank, world size and rendezvous from each launcher's own
variables (fixture environments as torchrun, Open MPI 4.1's mpirun, MPICH's Hydra and srun set them),
and cuda_index: LOCAL_RANK % visible devices, two ranks on one GPU refused."""
from __future__ import annotations

import os

import pytest

from shardwise.errors import ConfigError
from shardwise.train.distributed import DEFAULT_PORT, RankEnv, cuda_index, first_slurm_host, rank_env

TORCHRUN = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node7",
            "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "abc"}
# What `mpirun -np 2` (Open MPI 4.1.4) exported to its second rank, trimmed.
OPENMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "1615724545", "PMIX_NAMESPACE": "1615724545"}
MPICH = {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4", "PMI_FD": "7"}
SRUN = {"SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_NTASKS": "8", "SLURM_NODEID": "1",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_ID": "123456", "SLURM_JOB_NODELIST": "gpu[007-008]",
        "SLURM_STEP_NODELIST": "gpu[007-008]"}


def test_torchrun_variables_are_taken_as_they_are():
    assert rank_env(TORCHRUN) == RankEnv(3, 1, 4, "node7", 29400, "torchrun", 2)


def test_nodes_started_with_different_nproc_are_refused():
    """`--nproc 2` on node 0 and `--nproc 1` on node 1: torchrun forms a job of 3 ranks, and the workers failed
    on a layout rule about "data-parallel size(3)" (or trained 3 ranks if the batch divided), never naming
    the cause."""
    assert rank_env({**TORCHRUN, "GROUP_WORLD_SIZE": "2"}).world_size == 4  # 2 nodes x 2
    with pytest.raises(ConfigError) as e:
        rank_env({**TORCHRUN, "WORLD_SIZE": "3", "GROUP_WORLD_SIZE": "2"})
    assert e.value.field == "--nproc" and "(2 on this one)" in e.value.problem and "same --nproc" in e.value.fix


def test_nothing_set_is_a_single_process():
    assert rank_env({}) == RankEnv(0, 0, 1, "127.0.0.1", DEFAULT_PORT, "single", 1)


def test_openmpi_single_node_rendezvous_on_localhost_port_from_the_job_id():
    got = rank_env(OPENMPI)
    assert got == RankEnv(1, 1, 2, "127.0.0.1", 10000 + 1615724545 % 20000, "openmpi", 2)
    assert rank_env(OPENMPI) == got  # deterministic: every rank derives the same port
    assert rank_env({**OPENMPI, "MASTER_ADDR": "a", "MASTER_PORT": "29555"}).master_port == 29555


def test_openmpi5_namespace_gives_a_port_in_range():
    env = {k: v for k, v in OPENMPI.items() if k != "OMPI_MCA_ess_base_jobid"} | {"PMIX_NAMESPACE": "prterun-h-42@1"}
    port = rank_env(env).master_port
    assert 10000 <= port < 30000 and rank_env(env).master_port == port


def test_multi_node_mpi_without_master_addr_is_refused_with_the_fix():
    env = {**OPENMPI, "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}
    with pytest.raises(ConfigError) as e:
        rank_env(env)
    assert e.value.field == "MASTER_ADDR" and "-x MASTER_ADDR" in e.value.fix
    assert rank_env({**env, "MASTER_ADDR": "a", "MASTER_PORT": "29500"}).master_addr == "a"


def test_mpich_hydra_pmi_variables():
    got = rank_env({**MPICH, "MASTER_ADDR": "head"})
    assert got == RankEnv(5, 1, 8, "head", DEFAULT_PORT, "pmi", 4)
    assert rank_env({**MPICH, "PMI_SIZE": "4"}).master_addr == "127.0.0.1"


def test_srun_first_node_of_the_node_list_and_port_from_the_job_id():
    got = rank_env(SRUN)
    assert got == RankEnv(6, 2, 8, "gpu007", 10000 + 123456 % 20000, "slurm", 4)
    # `first_host` is how init_distributed asks scontrol; here a stand-in.
    assert rank_env(SRUN, first_host=lambda nodes: "from-scontrol").master_addr == "from-scontrol"


def test_torchrun_under_srun_wins():
    """`srun torchrun ...`: the workers are torchrun's; the SLURM task variables are its agent's."""
    assert rank_env({**SRUN, **TORCHRUN}).source == "torchrun"
    assert rank_env({**SRUN, **OPENMPI}).source == "openmpi"


def test_variables_that_are_not_numbers_are_a_config_error():
    with pytest.raises(ConfigError) as e:
        rank_env({**OPENMPI, "OMPI_COMM_WORLD_RANK": "one"})
    assert e.value.field == "OMPI_COMM_WORLD_RANK"


@pytest.mark.parametrize("nodes, first", [("gpu[003-005,9],cpu1", "gpu003"), ("a,b", "a"), ("node1", "node1"),
                                          ("rack[1-2]-n[01-04]", "rack1-n01"), ("x[9,10]", "x9")])
def test_first_slurm_host(nodes, first):
    assert first_slurm_host(nodes) == first


def test_cuda_index_is_local_rank_modulo_visible_devices():
    assert [cuda_index(r, 8, 8, None) for r in range(8)] == list(range(8))
    assert cuda_index(3, 4, 4, "4,5,6,7") == 3  # index among the visible devices: physical GPU 7
    # srun --gpus-per-task=1: each rank sees its own single device.
    assert cuda_index(3, 4, 1, "3") == 0


def test_more_local_ranks_than_visible_devices_is_refused():
    with pytest.raises(ConfigError) as e:
        cuda_index(2, 4, 2, "0,1")
    assert "4 ranks on this node but 2 visible" in e.value.problem and "at most 2" in e.value.fix
    with pytest.raises(ConfigError):
        cuda_index(1, 2, 1, None)  # one GPU, no per-rank binding: both ranks would share it


def test_a_process_that_dies_in_native_code_says_where_it_was():
    """A rank killed by SIGABRT (std::terminate, a backend's check) or SIGSEGV printed nothing of its own: the
    launcher could name only the signal. After init_distributed it prints each thread's Python stack."""
    import subprocess
    import sys

    code = ("import os\nfrom shardwise.train.distributed import init_distributed\ninit_distributed()\n"
            "def the_step():\n    os.abort()\nthe_step()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == -6, (p.returncode, p.stderr)
    assert "Fatal Python error: Aborted" in p.stderr and "in the_step" in p.stderr, p.stderr
