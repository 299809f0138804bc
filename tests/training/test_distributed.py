"""transformer/distributed.py at world size 1: no process group, and every collective a no-op."""

import torch

from transformer import distributed


def test_world_size_one_runs_without_a_process_group(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    info = distributed.init_from_env("cpu")
    assert (info.rank, info.world_size, info.local_rank, info.is_main) == (0, 1, 0, True)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert distributed.init_from_env("cpu", timeout_s=5) == info
    assert not torch.distributed.is_initialized()
    tensor = torch.tensor([1.0, 2.0])
    assert distributed.all_reduce_sum(tensor) is tensor and tensor.tolist() == [1.0, 2.0]
    distributed.barrier()
    distributed.cleanup()
