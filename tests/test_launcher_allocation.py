"""The allocation string: parsing, placement on nodes x GPUs, errors with the arithmetic."""

from __future__ import annotations

import json

import pytest

from areal_mcore.launcher.allocation import AllocationError, Side, parse_allocation


def test_parse_and_place_the_boba_layouts():
    a = parse_allocation("sglang:d4t2+megatron:d2p2t4")
    assert a.rollout == Side("sglang", d=4, t=2) and a.trainer == Side("megatron", d=2, p=2, t=4)
    assert (a.rollout.gpus, a.trainer.gpus) == (8, 16)
    assert a.place(nodes=3, gpus_per_node=8) == (1, 2)
    assert str(a) == "sglang:d4t2+megatron:d2p2t4"
    # order of letters is free; c1 is accepted (no context parallelism); sub-node sides
    assert parse_allocation("sglang:t2d4+megatron:c1d2").trainer.gpus == 2
    # c takes GPUs of its own (each sequence split over c ranks), e does not
    assert parse_allocation("sglang:d8+megatron:d8c2t2").trainer.gpus == 32
    assert parse_allocation("megatron:d1c2e2").trainer.gpus == 2
    assert parse_allocation("embedded:d1+megatron:d1").place(nodes=2, gpus_per_node=1) == (1, 1)
    assert parse_allocation("sglang:d2+megatron:d4").place(nodes=2, gpus_per_node=8) == (1, 1)
    # 128 nodes x 8 GPUs: the 32B PPO layout
    assert parse_allocation("sglang:d128t4+megatron:d16p4t8").place(nodes=128, gpus_per_node=8) == (64, 64)


@pytest.mark.parametrize("text,nodes,gpn,message", [
    # too few nodes: both sides' products and the node sum are spelled out
    ("sglang:d4t2+megatron:d2p2t4", 2, 8,
     "rollout d4 x t2 = 8 GPUs -> 1 node(s), trainer d2 x p2 x t4 = 16 GPUs -> 2 node(s) of 8 GPUs: "
     "1 + 2 = 3 nodes, but the allocation has 2"),
    # a side that is neither whole nodes nor within one node
    ("sglang:d3t4+megatron:d8", 3, 8,
     "sglang:d3t4: d3 x t4 = 12 GPUs, which is neither whole 8-GPU nodes nor at most one node "
     "(12 / 8 = 1.50 nodes)"),
    # tensor parallelism wider than a node
    ("sglang:d1t16+megatron:d8", 3, 8, "tensor parallel size t16 exceeds the 8 GPUs of a node"),
    # servers that do not tile a node: the launcher's servers-per-node would run out of nodes
    ("sglang:d8t3+megatron:d8", 4, 8, "sglang:d8t3: servers of t3 GPUs do not tile a node of 8 GPUs "
                                      "(8 % 3 = 2): 2 server(s) per node on 3 nodes hold 6 of the 8 servers"),
    ("sglang:d4t6+megatron:d8", 4, 8, "servers of t6 GPUs do not tile a node of 8 GPUs"),
])
def test_allocations_that_do_not_fit_say_why_with_numbers(text, nodes, gpn, message):
    with pytest.raises(AllocationError) as e:
        parse_allocation(text).place(nodes, gpn)
    assert message in str(e.value)


@pytest.mark.parametrize("text,message", [
    ("sglang:d4", "must be '<rollout>:<dims>+megatron:<dims>'"),
    ("trtllm:d4+megatron:d2", "rollout backend 'trtllm' is not one of ['sglang', 'embedded', 'vllm']"),
    ("megatron:d2+sglang:d4", "rollout backend 'megatron'"),
    ("sglang:d4x2+megatron:d2", "'sglang:d4x2' is not '<name>:<dims>'"),
    ("sglang:d4d2+megatron:d2", "gives 'd' twice"),
    ("sglang:d0+megatron:d2", "sizes are >= 1"),
    ("sglang:d2c2+megatron:d2", "context parallelism (c) is a trainer dimension"),
    ("sglang:d1p2t8+megatron:d8", "pipeline-parallel rollout servers (p2) are not supported"),
    ("sglang:d2p2t4+megatron:d8", "use t and d, e.g. sglang:d4t4"),
])
def test_malformed_strings_name_the_bad_part(text, message):
    with pytest.raises(AllocationError) as e:
        parse_allocation(text)
    assert message in str(e.value)


def test_a_trainer_only_allocation_is_for_sft_and_the_config_checks_the_pairing():
    from areal_mcore.config import ConfigError, load_config

    sft = parse_allocation("megatron:d1p4t8")
    assert sft.rollout is None and sft.place(nodes=4, gpus_per_node=8) == (0, 4)
    with pytest.raises(AllocationError, match="trainer d1 x p4 x t8 = 32 GPUs -> 4 node"):
        sft.place(nodes=2, gpus_per_node=8)
    cfg = load_config("configs/boba_32b_sft.yaml", ["launch.stage=sft", "launch.allocation=megatron:d1p4t8"])
    assert cfg.launch.stage == "sft"
    with pytest.raises(ConfigError, match="ppo needs '<rollout>:<dims>\\+megatron:<dims>'"):
        load_config("configs/boba_7b.yaml", ["launch.allocation=megatron:d8"])
    with pytest.raises(ConfigError, match="launch.allocation"):
        load_config("configs/boba_7b.yaml", ["launch.allocation=sglang:d4x+megatron:d1"])


def test_expert_parallel_takes_no_gpus_and_places_like_its_dense_layout():
    # AReaL's semantics: e is carved out of d (megatron's expert-TP x EP x expert-DP x PP over
    # the TP x DP x PP ranks), so the GPU and node counts are those without e.
    a = parse_allocation("sglang:d16+megatron:d8t2e4")
    assert a.trainer == Side("megatron", d=8, t=2, e=4) and a.trainer.gpus == 16
    assert a.place(nodes=4, gpus_per_node=8) == parse_allocation("sglang:d16+megatron:d8t2").place(4, 8) == (2, 2)
    assert str(a) == "sglang:d16+megatron:d8t2e4" and str(parse_allocation("megatron:e2d2p2")) == "megatron:d2p2e2"
    with pytest.raises(AllocationError, match=r"trainer d8 x t2 = 16 GPUs -> 2 node\(s\) of 8 GPUs: 2 \+ 2 = 4 "
                                              r"nodes, but the allocation has 8"):
        a.place(nodes=8, gpus_per_node=8)  # e4 does not ask for 4x the GPUs


@pytest.mark.parametrize("text,message", [
    ("sglang:d4e2+megatron:d4e2", "expert parallelism (e2) is a trainer dimension; the rollout servers are "
                                  "launched with tensor parallelism only (use sglang:d4)"),
    ("sglang:d4+megatron:d6t2e4", "expert parallelism e4 must divide the data-parallel size d6 (the EP ranks "
                                  "are carved out of the DP ranks; e adds no GPUs), e.g. megatron:d6t2e2"),
    ("megatron:d2e4", "e4 must divide the data-parallel size d2"),
    # under CP, EP is carved out of DP x CP
    ("megatron:d1c2e4", "e4 must divide the data-parallel size d1 x c2 (the EP ranks are carved out of the "
                        "DP x CP ranks; e adds no GPUs), e.g. megatron:d1c2e2"),
    ("sglang:d4+megatron:d4e0", "sizes are >= 1"),
])
def test_expert_parallel_on_the_rollout_side_or_not_dividing_d_is_refused(text, message):
    with pytest.raises(AllocationError) as e:
        parse_allocation(text)
    assert message in str(e.value)


def test_the_allocations_e_and_actor_parallel_ep_must_agree_when_the_config_loads():
    from areal_mcore.config import ConfigError, load_config

    disk = ["weight_sync.mode=disk", "weight_sync.disk_dir=/tmp/x"]  # either sync takes EP > 1
    cfg = load_config("configs/boba_7b.yaml", [*disk, "actor.parallel.ep=4",
                                               "launch.allocation=sglang:d16+megatron:d8t2e4"])
    assert cfg.actor.parallel.ep == 4 and parse_allocation(cfg.launch.allocation).trainer.e == 4
    with pytest.raises(ConfigError) as e:  # ep without e: e is 1
        load_config("configs/boba_7b.yaml", [*disk, "actor.parallel.ep=2"])
    assert ("launch.allocation='sglang:d16+megatron:d8t2' has e1 (expert parallelism) but actor.parallel.ep=2: "
            "they must agree; set launch.allocation='sglang:d16+megatron:d8t2e2' or actor.parallel.ep=1") in str(e.value)
    with pytest.raises(ConfigError, match=r"has e2 \(expert parallelism\) but actor.parallel.ep=1"):
        load_config("configs/boba_7b.yaml", ["launch.allocation=sglang:d16+megatron:d8t2e2"])
    with pytest.raises(ConfigError, match=r"set a launch.allocation whose d is a multiple of 16 \(e16\), or "
                                          r"actor.parallel.ep=2"):
        load_config("configs/boba_7b.yaml", [*disk, "actor.parallel.ep=16",
                                             "launch.allocation=sglang:d16+megatron:d8t2e2"])


def test_sweeps_expand_to_named_runs_and_times_parse():
    from areal_mcore.launcher.submit import _minutes, sweep_overrides

    runs = sweep_overrides(["a=1"], ["actor.optimizer.lr=1e-5,2e-5", "ppo.eps_clip=0.2,0.4"], "boba")
    assert len(runs) == 4 and runs[0] == ["a=1", "actor.optimizer.lr=1e-5", "ppo.eps_clip=0.2",
                                          "experiment_name=boba-lr1e-5-eps_clip0.2"]
    assert len({r[-1] for r in runs}) == 4  # every run writes its own folder
    assert sweep_overrides(["a=1"], [], "boba") == [["a=1"]]
    with pytest.raises(ValueError, match="must be key=value1,value2"):
        sweep_overrides([], ["lr"], "boba")
    assert (_minutes("72:00:00"), _minutes("10:00"), _minutes("1-00:30:00"), _minutes("0:0:30")) == (4320, 10, 1470, 1)


def test_c_and_actor_parallel_cp_must_agree_when_the_config_loads():
    from areal_mcore.config import load_config

    sft = ["launch.stage=sft", "launch.allocation=megatron:d8c2t2"]
    with pytest.raises(ValueError, match=r"has c2 \(context parallelism\) but actor\.parallel\.cp=1: they must "
                                         r"agree; set launch\.allocation='megatron:d8t2' .* or actor\.parallel\.cp=2"):
        load_config("configs/boba_32b_sft.yaml", sft)
    assert load_config("configs/boba_32b_sft.yaml", [*sft, "actor.parallel.cp=2"]).actor.parallel.cp == 2
    # The allocation it suggests parses: e, carved out of d x c, shrinks with c.
    with pytest.raises(ValueError, match=r"set launch\.allocation='megatron:d1' \(c adds GPUs"):
        load_config("configs/boba_32b_sft.yaml", ["launch.stage=sft", "launch.allocation=megatron:d1c2e2"])
    # Without an allocation (torchrun by hand) the derived one gives the trainer its cp GPUs.
    derived = load_config("configs/boba_32b_sft.yaml", ["launch.stage=sft", "launch.allocation=null",
                                                        "actor.parallel.cp=2"]).launch.allocation
    assert derived == "megatron:d1c2" and parse_allocation(derived).trainer.gpus == 2


@pytest.mark.parametrize("gpus,cfg,env,flags", [
    # 8 GPUs, 96 CPUs and 1 TB on the node: a TP-4 server gets half of each
    (4, {}, {"SLURM_CPUS_ON_NODE": "96", "SLURM_MEM_PER_NODE": "1024000"},
     ["--exact", "--cpus-per-task=48", "--mem=512000M"]),
    # fixed by the admin; mem 0 = the cluster's default
    (8, {"cpus_per_gpu": 10, "mem_per_gpu_mb": 0}, {"SLURM_CPUS_ON_NODE": "96"}, ["--exact", "--cpus-per-task=80"]),
    # Slurm's "2(x3)" form of SLURM_CPUS_ON_NODE; no memory known
    (1, {}, {"SLURM_CPUS_ON_NODE": "16(x2)"}, ["--exact", "--cpus-per-task=2"]),
])
def test_srun_steps_ask_for_their_gpus_share_of_cpus_and_memory(gpus, cfg, env, flags):
    from areal_mcore.launcher.config import LaunchConfig

    assert LaunchConfig(gpus_per_node=8, **cfg).step_resources(gpus, env) == flags


def test_boba_32b_ppo_says_which_node_count_it_needs(tmp_path):
    import os
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "STAGE": "ppo", "SLURM_NNODES": "4", "SLURM_SUBMIT_DIR": repo, "PY": "/bin/false"}
    out = subprocess.run(["bash", os.path.join(repo, "launch/slurm/boba_32b.sh")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "STAGE=ppo needs -N a multiple of 8 from 8 to 128" in out.stderr and "has 4 nodes" in out.stderr


def test_the_allocations_rollout_backends_are_the_engines_the_client_knows():
    # allocation.py keeps its own tuple (a leaf: no rollout imports); the two must agree.
    from areal_mcore.launcher.allocation import ROLLOUT_BACKENDS
    from areal_mcore.rollout.engines import BACKENDS

    assert sorted(ROLLOUT_BACKENDS) == sorted(BACKENDS)
    assert parse_allocation("vllm:d2t2+megatron:d4").rollout.backend == "vllm"


def test_trainer_nodes_take_their_rank_from_the_node_list_and_the_masters_port(tmp_path):
    """Node rank = place in the trainer's node list, whose first node is the master address
    (Slurm's task numbering follows slurm.conf's node order, not this list's); the port is
    the one the master node picked."""
    import threading

    from areal_mcore.launcher.slurm import trainer_node

    port_file, nodes, out = tmp_path / "trainer_master.json", ["gpu-b07", "gpu-a01"], {}
    other = threading.Thread(target=lambda: out.update(b=trainer_node(nodes, "gpu-a01", port_file, timeout_s=20)))
    other.start()  # waits for the master's port
    rank, port = trainer_node(nodes, "gpu-b07", port_file)
    other.join()
    assert rank == 0 and out["b"] == (1, port) and 1024 < port < 65536
    with pytest.raises(RuntimeError, match="'gpu-c01' .* is not one of the trainer nodes"):
        trainer_node(nodes, "gpu-c01", port_file)


def test_a_trainer_node_execs_torchrun_with_its_rank_and_gloos_interface(tmp_path, monkeypatch):
    from areal_mcore.launcher import slurm

    ran = []
    monkeypatch.setattr(slurm.os, "execv", lambda path, cmd: ran.append(cmd))
    env = {"SLURMD_NODENAME": "node1"}  # the task's environment, without GLOO_SOCKET_IFNAME
    monkeypatch.setattr(slurm.os, "environ", env)
    slurm.main(["torchrun", "--nodes", "node1", "--master-addr", "127.0.0.1", "--port-file",
                str(tmp_path / "p.json"), "--", "--nnodes=1", "-m", "areal_mcore.cli", "sft"])
    port = json.loads((tmp_path / "p.json").read_text())["port"]
    assert ran[0][1:] == ["-m", "torch.distributed.run", "--node-rank=0", "--master-addr=127.0.0.1",
                          f"--master-port={port}", "--nnodes=1", "-m", "areal_mcore.cli", "sft"]
    # gloo (megatron's gloo groups, the control group) binds the interface to the master
    assert env["GLOO_SOCKET_IFNAME"] == "lo"


FOUR_NODES = """#!/bin/sh
# show hostnames X | show node -o X | show job -o ID, as Slurm prints them
case "$1 $2" in
  "show hostnames") printf 'gpu1\\ngpu2\\ngpu3\\ngpu4\\n' ;;
  "show node") echo "NodeName=$4 NodeAddr=$4" ;;
  "show job") echo "JobId=$4 JobState=RUNNING TimeLimit=UNLIMITED" ;;
esac
"""


def test_the_qwen3_30b_a3b_launch_gives_the_ep_trainer_two_nodes_of_8_gpus(tmp_path, monkeypatch):
    """sglang:d8t2+megatron:d8t2e8 on 4 x 8 GPUs: 8 TP-2 servers on 2 nodes, the trainer's 16
    ranks (EP 8 among its DP 8, no GPUs of its own) on the other 2, 8 per node."""
    import os

    from areal_mcore.launcher import slurm

    (tmp_path / "scontrol").write_text(FOUR_NODES)
    (tmp_path / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setattr(os, "environ", {**os.environ, "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu[1-4]",
                                        "SLURM_CPUS_ON_NODE": "96"})
    launcher = slurm.Launcher("configs/qwen3_30b_a3b.yaml", [f"trainer.log_dir={tmp_path}"])
    started = []
    monkeypatch.setattr(slurm, "node_address", lambda node: node)
    monkeypatch.setattr(slurm.subprocess, "Popen", lambda cmd, env=None: started.append(cmd))
    assert launcher.alloc.place(len(launcher.job.nodes), 8) == (2, 2)
    launcher._start_trainer(["gpu3", "gpu4"], ["http://gpu1:1"])
    cmd = started[0]
    assert {"--nodes=2", "--nodelist=gpu3,gpu4", "--gpus-per-node=8", "--cpus-per-task=96"} <= set(cmd)
    assert {"--nnodes=2", "--nproc-per-node=8", "actor.parallel.tp=2"} <= set(cmd)
    assert "actor.parallel.ep=8" not in cmd  # the config's own, which config load checked against e8
