"""RuntimeConfig.from_env: every variable good and bad, with the exact messages."""

import dataclasses

import pytest

from sexpgpu.errors import SexpgpuError
from sexpgpu.runtime.config import RuntimeConfig, check_env
from sexpgpu.runtime.devices import (
    Device,
    parse_device,
    require_capability,
    visible_gpu_count,
)
from sexpgpu.runtime.units import GiB, MiB


def error(environ, device=None, visible_gpus=0) -> SexpgpuError:
    with pytest.raises(SexpgpuError) as info:
        RuntimeConfig.from_env(environ, device, visible_gpus=visible_gpus)
    return info.value


def test_defaults_are_one_cpu_rank_on_one_node():
    config = RuntimeConfig.from_env({})
    assert config == RuntimeConfig(
        device="cpu",
        devices=(0,),
        memory=None,
        nodes=1,
        node_rank=0,
        rendezvous=None,
        node_gradients="bf16",
        node_timeout=300.0,
    )
    assert config.local_devices == (Device("cpu", 0),)
    assert (config.local_size, config.world_size, config.first_rank) == (1, 1, 0)
    assert not config.simulated


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        RuntimeConfig.from_env({}).device = "cuda"  # type: ignore[misc]


def test_device_argument_wins_over_the_variable():
    config = RuntimeConfig.from_env({"SEXPGPU_DEVICE": "cpu"}, "cuda", visible_gpus=2)
    assert config.device == "cuda"
    assert config.devices == (0, 1)  # unset: every visible GPU
    assert RuntimeConfig.from_env({"SEXPGPU_DEVICE": "CUDA "}, visible_gpus=1).device == "cuda"


def test_bad_device_variable():
    err = error({"SEXPGPU_DEVICE": "gpu"})
    assert err.code == "E-CLI-001"
    assert err.render() == (
        "error[E-CLI-001]: SEXPGPU_DEVICE='gpu' is not a device\n"
        " --> SEXPGPU_DEVICE\n"
        "  = hint: use cpu (the default) or cuda"
    )


def test_bad_device_argument():
    err = error({}, device="tpu")
    assert (err.code, err.message, err.location) == (
        "E-CLI-001",
        "--device tpu is not a device",
        "--device",
    )


def test_simulated_ranks_on_cpu():
    config = RuntimeConfig.from_env({"SEXPGPU_DEVICES": "0, 1,2,3"})
    assert config.devices == (0, 1, 2, 3)
    assert config.simulated
    assert [str(d) for d in config.local_devices] == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]


def test_cpu_ranks_need_no_gpu():
    # visible_gpus is not consulted on cpu: a GPU-less host simulates 8 ranks.
    config = RuntimeConfig.from_env({"SEXPGPU_DEVICES": "7,6,5,4,3,2,1,0"}, visible_gpus=0)
    assert config.local_size == 8


def test_chosen_gpus():
    config = RuntimeConfig.from_env({"SEXPGPU_DEVICES": "2,0"}, "cuda", visible_gpus=4)
    assert config.devices == (2, 0)
    assert config.local_devices == (Device("cuda", 2), Device("cuda", 0))
    assert not config.simulated


def test_e_dp_001_does_not_parse():
    err = error({"SEXPGPU_DEVICES": "0,x"})
    assert err.render() == (
        "error[E-DP-001]: SEXPGPU_DEVICES='0,x' does not parse: 'x' is not a device ordinal\n"
        " --> SEXPGPU_DEVICES\n"
        "  = hint: write ordinals separated by commas, such as SEXPGPU_DEVICES=0,1, "
        "or unset it to use every visible GPU"
    )


@pytest.mark.parametrize(
    ("text", "part"), [("0,", ""), ("-1", "-1"), ("0;1", "0;1"), ("1.0", "1.0")]
)
def test_e_dp_001_other_malformed_lists(text, part):
    err = error({"SEXPGPU_DEVICES": text}, "cuda", visible_gpus=2)
    assert err.code == "E-DP-001"
    assert err.message == (
        f"SEXPGPU_DEVICES='{text}' does not parse: '{part}' is not a device ordinal"
    )


def test_e_dp_001_repeats():
    err = error({"SEXPGPU_DEVICES": "0,1,0"}, "cuda", visible_gpus=2)
    assert err.render() == (
        "error[E-DP-001]: SEXPGPU_DEVICES='0,1,0' names device 0 twice\n"
        " --> SEXPGPU_DEVICES\n"
        "  = hint: name each device once, such as SEXPGPU_DEVICES=0,1"
    )
    assert error({"SEXPGPU_DEVICES": "1,1"}).code == "E-DP-001"  # simulated ranks too


def test_e_dp_001_invisible_ordinal():
    err = error({"SEXPGPU_DEVICES": "0,2"}, "cuda", visible_gpus=2)
    assert err.render() == (
        "error[E-DP-001]: SEXPGPU_DEVICES='0,2' names GPU 2, but only 2 GPUs are visible "
        "(ordinals 0 to 1)\n"
        " --> SEXPGPU_DEVICES\n"
        "  = hint: name ordinals below 2, or unset SEXPGPU_DEVICES to use every visible GPU "
        "(CUDA_VISIBLE_DEVICES and nvidia-smi show which are visible)"
    )
    one = error({"SEXPGPU_DEVICES": "1"}, "cuda", visible_gpus=1)
    assert one.message == "SEXPGPU_DEVICES='1' names GPU 1, but only 1 GPU is visible (ordinal 0)"


@pytest.mark.parametrize(
    ("environ", "device", "location"),
    [
        ({}, "cuda", "--device"),
        ({"SEXPGPU_DEVICE": "cuda"}, None, "SEXPGPU_DEVICE"),
        ({"SEXPGPU_DEVICE": "cuda", "SEXPGPU_DEVICES": "0"}, None, "SEXPGPU_DEVICE"),
    ],
)
def test_e_dp_001_no_gpu_visible(environ, device, location):
    err = error(environ, device, visible_gpus=0)
    assert err.render() == (
        "error[E-DP-001]: no GPU is visible for the cuda device\n"
        f" --> {location}\n"
        "  = hint: the cuda device needs a CUDA build of PyTorch and a visible GPU (`sexpgpu "
        "doctor --device cuda` says which is missing); or use the cpu device, where "
        "SEXPGPU_DEVICES=0,1 simulates two ranks on the host"
    )


def test_visible_gpus_are_asked_of_pytorch_only_on_cuda():
    assert RuntimeConfig.from_env({}).device == "cpu"
    count = visible_gpu_count()
    if count == 0:  # a CPU-only PyTorch: cuda fails
        with pytest.raises(SexpgpuError, match="no GPU is visible"):
            RuntimeConfig.from_env({}, "cuda")
    else:
        assert RuntimeConfig.from_env({}, "cuda").devices == tuple(range(count))


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("40GiB", 40 * GiB),
        ("40GB", 40 * 10**9),
        ("512MiB", 512 * MiB),
        ("1000", 1000),
        (" 1.5 gib ", int(1.5 * GiB)),
        ("2TB", 2 * 10**12),
    ],
)
def test_memory(text, nbytes):
    assert RuntimeConfig.from_env({"SEXPGPU_MEMORY": text}).memory == nbytes


@pytest.mark.parametrize("text", ["40G", "forty", "-1GiB", "0", "1e9", "GiB"])
def test_bad_memory(text):
    err = error({"SEXPGPU_MEMORY": text})
    assert err.render() == (
        f"error[E-CLI-001]: SEXPGPU_MEMORY='{text}' is not an amount of memory\n"
        " --> SEXPGPU_MEMORY\n"
        "  = hint: write a number with a unit, such as SEXPGPU_MEMORY=40GiB, 40GB or 512MiB, "
        "or a plain number of bytes; unset it to detect the free memory"
    )


MULTI_NODE = {
    "SEXPGPU_DEVICE": "cuda",
    "SEXPGPU_NODES": "2",
    "SEXPGPU_NODE_RANK": "1",
    "SEXPGPU_RENDEZVOUS": "10.0.0.1:29500",
    "SEXPGPU_NODE_GRADIENTS": "bf16",
}


def test_nodes():
    config = RuntimeConfig.from_env(MULTI_NODE, visible_gpus=4)
    assert (config.nodes, config.node_rank) == (2, 1)
    assert config.rendezvous == ("10.0.0.1", 29500)
    assert config.node_gradients == "bf16"
    assert (config.local_size, config.world_size, config.first_rank) == (4, 8, 4)


def test_ipv6_rendezvous():
    config = RuntimeConfig.from_env(
        {**MULTI_NODE, "SEXPGPU_RENDEZVOUS": "[::1]:80"}, visible_gpus=1
    )
    assert config.rendezvous == ("::1", 80)


def test_node_gradients_default_and_case():
    assert RuntimeConfig.from_env({}).node_gradients == "bf16"  # as the contract says
    assert RuntimeConfig.from_env({"SEXPGPU_NODE_GRADIENTS": "F32"}).node_gradients == "f32"


def test_node_timeout_default_and_values():
    assert RuntimeConfig.from_env({}).node_timeout == 300.0
    assert RuntimeConfig.from_env({"SEXPGPU_NODE_TIMEOUT": "2.5"}).node_timeout == 2.5
    for text in ["soon", "0", "-3", "inf", "nan"]:
        err = error({"SEXPGPU_NODE_TIMEOUT": text})
        assert err.render() == (
            f"error[E-DP-005]: SEXPGPU_NODE_TIMEOUT='{text}' is not a number of seconds\n"
            " --> SEXPGPU_NODE_TIMEOUT\n"
            "  = hint: give the seconds a node waits for the others, such as "
            "SEXPGPU_NODE_TIMEOUT=600, or unset it for 300"
        )


def node_error(**changes) -> SexpgpuError:
    environ = {k: v for k, v in {**MULTI_NODE, **changes}.items() if v is not None}
    err = error(environ, visible_gpus=1)
    assert err.code == "E-DP-005"
    return err


def test_e_dp_005_node_count():
    err = node_error(SEXPGPU_NODES="two")
    assert err.render() == (
        "error[E-DP-005]: SEXPGPU_NODES='two' is not a node count\n"
        " --> SEXPGPU_NODES\n"
        "  = hint: set SEXPGPU_NODES to a whole number of nodes, 1 or more, such as "
        "SEXPGPU_NODES=2, or unset it to run on one node"
    )
    assert node_error(SEXPGPU_NODES="0").message == "SEXPGPU_NODES='0' is not a node count"


def test_cpu_nodes_are_allowed_over_gloo():
    # docs/devices.md: several cpu nodes rehearse a launch without GPUs.
    config = RuntimeConfig.from_env({**MULTI_NODE, "SEXPGPU_DEVICE": "cpu"})
    assert (config.device, config.nodes, config.node_rank) == ("cpu", 2, 1)


def test_e_dp_005_node_rank():
    missing = node_error(SEXPGPU_NODE_RANK=None)
    assert missing.render() == (
        "error[E-DP-005]: SEXPGPU_NODE_RANK is not set, but SEXPGPU_NODES=2\n"
        " --> SEXPGPU_NODE_RANK\n"
        "  = hint: set SEXPGPU_NODE_RANK on each node: number the nodes 0 to 1, 0 on the node "
        "that listens at SEXPGPU_RENDEZVOUS"
    )
    bad = node_error(SEXPGPU_NODE_RANK="first")
    assert bad.message == "SEXPGPU_NODE_RANK='first' is not a node rank"
    assert bad.hint == (
        "set SEXPGPU_NODE_RANK to a whole number: number the nodes 0 to 1, 0 on the node "
        "that listens at SEXPGPU_RENDEZVOUS"
    )
    high = node_error(SEXPGPU_NODE_RANK="2")
    assert high.message == "SEXPGPU_NODE_RANK=2 is out of range for SEXPGPU_NODES=2"
    assert high.location == "SEXPGPU_NODE_RANK"


def test_e_dp_005_node_rank_on_one_node():
    err = error({"SEXPGPU_NODE_RANK": "1"})
    assert err.message == "SEXPGPU_NODE_RANK=1 is out of range for SEXPGPU_NODES=1"


def test_e_dp_005_rendezvous():
    missing = node_error(SEXPGPU_RENDEZVOUS=None)
    assert missing.render() == (
        "error[E-DP-005]: SEXPGPU_RENDEZVOUS is not set, but SEXPGPU_NODES=2\n"
        " --> SEXPGPU_RENDEZVOUS\n"
        "  = hint: set SEXPGPU_RENDEZVOUS=host:port on every node, such as "
        "SEXPGPU_RENDEZVOUS=10.0.0.1:29500, the address node 0 listens at"
    )
    for text in ["node0", "node0:", ":29500", "node0:http", "node0:70000", "node0:0"]:
        err = node_error(SEXPGPU_RENDEZVOUS=text)
        assert err.message == (
            f"SEXPGPU_RENDEZVOUS='{text}' is not host:port with a port from 1 to 65535"
        )
        assert err.hint == (
            "write host:port, such as SEXPGPU_RENDEZVOUS=10.0.0.1:29500, "
            "the address node 0 listens at"
        )


def test_e_dp_005_node_gradients():
    err = node_error(SEXPGPU_NODE_GRADIENTS="fp16")
    assert err.render() == (
        "error[E-DP-005]: SEXPGPU_NODE_GRADIENTS='fp16' is not a gradient dtype\n"
        " --> SEXPGPU_NODE_GRADIENTS\n"
        "  = hint: use bf16 (the default: half the traffic; each rounding error is carried to "
        "the next step) or f32 (two nodes of one GPU train bitwise like one node of two)"
    )


def test_empty_variables_mean_unset():
    empty = {name: "" for name in MULTI_NODE} | {"SEXPGPU_DEVICES": "", "SEXPGPU_MEMORY": ""}
    assert RuntimeConfig.from_env(empty) == RuntimeConfig()


def test_check_env_lists_every_problem_once():
    environ = {
        "SEXPGPU_DEVICE": "cuda",
        "SEXPGPU_DEVICES": "0,0",
        "SEXPGPU_MEMORY": "lots",
        "SEXPGPU_NODES": "2",
        "SEXPGPU_RENDEZVOUS": "x",
        "SEXPGPU_NODE_GRADIENTS": "f64",
    }
    problems = check_env(environ, visible_gpus=2)
    assert [(p.code, p.location) for p in problems] == [
        ("E-DP-001", "SEXPGPU_DEVICES"),
        ("E-CLI-001", "SEXPGPU_MEMORY"),
        ("E-DP-005", "SEXPGPU_NODE_RANK"),
        ("E-DP-005", "SEXPGPU_RENDEZVOUS"),
        ("E-DP-005", "SEXPGPU_NODE_GRADIENTS"),
    ]
    assert check_env({}) == []


def test_device_list_is_checked_even_with_a_bad_device():
    problems = check_env({"SEXPGPU_DEVICES": "a"}, device="gpu")
    assert [p.code for p in problems] == ["E-CLI-001", "E-DP-001"]


def test_e_dev_001_refuses_an_old_gpu():
    capabilities = {0: (9, 0), 1: (7, 5)}
    require_capability([Device("cuda", 0), Device("cpu", 1)], capabilities.__getitem__)
    with pytest.raises(SexpgpuError) as info:
        require_capability([Device("cuda", 0), Device("cuda", 1)], capabilities.__getitem__)
    assert info.value.render() == (
        "error[E-DEV-001]: GPU 1 has compute capability 7.5; the cuda device needs 8.0 or "
        "newer (bf16 tensor cores)\n"
        " --> cuda:1\n"
        "  = hint: use an Ampere GPU or newer (A100, H100, RTX 30xx...), leave this one out "
        "of SEXPGPU_DEVICES, or use --device cpu"
    )


def test_device_names():
    assert parse_device("cuda:1") == Device("cuda", 1)
    assert parse_device("cpu") == Device("cpu", 0)
    assert str(parse_device(Device("cpu", 4))) == "cpu:4"
    for bad in ["gpu:0", "cuda:x", "cuda:-1", ""]:
        with pytest.raises(ValueError, match="is not a device"):
            parse_device(bad)


def test_deterministic_is_0_or_1_or_the_devices_default():
    from sexpgpu.runtime.config import deterministic_setting

    assert deterministic_setting({}) is None
    assert deterministic_setting({"SEXPGPU_DETERMINISTIC": "1"}) is True
    assert RuntimeConfig.from_env({"SEXPGPU_DETERMINISTIC": "0"}).deterministic is False
    with pytest.raises(SexpgpuError) as err:
        RuntimeConfig.from_env({"SEXPGPU_DETERMINISTIC": "yes"})
    assert err.value.code == "E-CLI-001"
    assert "SEXPGPU_DETERMINISTIC='yes' is neither 0 nor 1" in err.value.message


def test_shard_optimizer_is_0_or_1_or_the_plans_choice():
    from sexpgpu.runtime.config import shard_setting

    assert shard_setting({}) is None
    assert RuntimeConfig.from_env({}).shard_optimizer is None
    assert RuntimeConfig.from_env({"SEXPGPU_SHARD_OPTIMIZER": "1"}).shard_optimizer is True
    assert RuntimeConfig.from_env({"SEXPGPU_SHARD_OPTIMIZER": " 0 "}).shard_optimizer is False
    with pytest.raises(SexpgpuError) as err:
        RuntimeConfig.from_env({"SEXPGPU_SHARD_OPTIMIZER": "auto"})
    assert (err.value.code, err.value.location) == ("E-CLI-001", "SEXPGPU_SHARD_OPTIMIZER")
    assert err.value.message == "SEXPGPU_SHARD_OPTIMIZER='auto' is neither 0 nor 1"
    assert "unset it to let the memory plan choose" in err.value.hint
