"""gpu_ops/launch.py's early launch: the context that the launchers read, and that the CPU has none."""

import torch

from lorad.gpu_ops import launch


def test_early_launch_is_scoped_and_nests():
    assert not launch.launching_early()
    with launch.early_launch(True):
        assert launch.launching_early()
        assert launch.early_options(launch.launching_early()) == {"launch_pdl": True}
        with launch.early_launch(False):  # a step inside another's forward (none does, but it must not leak)
            assert not launch.launching_early()
        assert launch.launching_early()
    assert not launch.launching_early()
    assert launch.early_options(False) == {}


def test_early_launch_is_reset_when_the_forward_raises():
    try:
        with launch.early_launch(True):
            raise ValueError("a kernel's checks")
    except ValueError:
        pass
    assert not launch.launching_early()


def test_no_early_launch_on_the_cpu():
    assert launch.pdl_unavailable(torch.device("cpu")) == "cpu is not a CUDA device"
