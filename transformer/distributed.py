"""Thin helpers over torch.distributed for runs under torchrun (one process per device).

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; a plain `python train.py` sets
none of them and runs as world size 1 without a process group. All collectives are no-ops at world size 1.

When a rank dies, the others' next collective fails (train.py turns that into a one-line PeerFailure) and
torchrun stops whatever still runs (SIGTERM, SIGKILL 30 s later). A rank that hangs instead holds the others
in their next collective until the process-group timeout: TRANSFORMER_DIST_TIMEOUT_S seconds, default 1800
(long enough for rank 0's lone work, such as translating the test set at the end; tests set a few seconds).
docs/RELIABILITY.md has the measured behaviour.
"""

import datetime
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from data.errors import ConfigError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        """Rank 0 writes checkpoints, logs and TensorBoard events."""
        return self.rank == 0


class PeerFailure(Exception):
    """Another rank died, was stopped or stopped answering during a collective; `str` is one line for the user."""


def init_from_env(device_type: str, *, timeout_s: float | None = None) -> DistInfo:
    """Join the process group torchrun describes in the environment, or run alone when WORLD_SIZE <= 1.

    Backend: NCCL for "cuda" (on the GPU LOCAL_RANK, which `pick_device` has made current), gloo otherwise.
    `timeout_s` bounds how long a collective (and joining) waits for a dead or stuck peer before raising
    instead of hanging.
    """
    world_size = _env_int("WORLD_SIZE", 1)
    if world_size <= 1:
        return DistInfo(rank=0, world_size=1, local_rank=0)
    if timeout_s is None:
        try:
            timeout_s = float(os.environ.get("TRANSFORMER_DIST_TIMEOUT_S") or 1800)
        except ValueError:
            raise ValueError("TRANSFORMER_DIST_TIMEOUT_S must be a number of seconds") from None
    local_rank = _env_int("LOCAL_RANK", 0)
    if not dist.is_initialized():
        # device_id binds the process group to this rank's GPU at once (NCCL's eager init): no guessing of
        # the device by the first collective, and a wrong LOCAL_RANK fails here.
        dist.init_process_group(
            backend="nccl" if device_type == "cuda" else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=torch.device("cuda", local_rank) if device_type == "cuda" else None,
            **_attempt_store(timeout_s),
        )
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank)


def _attempt_store(timeout_s: float) -> dict:
    """Under torchrun's elastic agent (TORCHELASTIC_USE_AGENT_STORE), the agent's store, with this restart's
    keys apart: the agent keeps one store across `--max-restarts` restarts, and restarted ranks could
    otherwise read the failed attempt's addresses ("Gloo connectFullMesh failed ... Connection refused",
    pytorch/pytorch#167288). One node only: on several, each node's agent counts only its own workers'
    failures, so TORCHELASTIC_RESTART_COUNT differs between nodes. Elsewhere: {} (init_process_group's own
    env:// rendezvous)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    if _env_int("LOCAL_WORLD_SIZE", 0) != _env_int("WORLD_SIZE", 1):
        return {}  # several nodes: each agent counts its own restarts, so the count is no shared namespace
    store = dist.TCPStore(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT", 0), _env_int("WORLD_SIZE", 1),
                          is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    attempt = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    return {"store": dist.PrefixStore(f"transformer/attempt-{attempt}", store), "rank": _env_int("RANK", 0),
            "world_size": _env_int("WORLD_SIZE", 1)}


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer (set by torchrun)") from None


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all ranks in place and return it; unchanged at world size 1."""
    if _active():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def broadcast_from_main(values: list[float], *, device: torch.device) -> list[float]:
    """Rank 0's `values` on every rank (unchanged at world size 1)."""
    if not _active():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.broadcast(tensor, src=0)
    return tensor.tolist()


class RankMismatch(PeerFailure):
    """The ranks did not start from the same state; `str` is one line naming the ranks and what differs."""


def check_same_start(fingerprint: dict[str, int], *, device: torch.device) -> None:
    """Raise RankMismatch on every rank when any rank's `fingerprint` differs from rank 0's.

    DDP copies rank 0's weights to the others and nothing else: a rank that read another checkpoint (a node
    without the shared run_dir, a stale copy after a requeue) would train on with its own Adam moments,
    schedule and data position, and the ranks would drift apart without an error.
    """
    if not _active():
        return
    mine = torch.tensor(list(fingerprint.values()), dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    rows = [row.tolist() for row in gathered]
    differ = {rank: [name for name, a, b in zip(fingerprint, rows[0], row) if a != b]
              for rank, row in enumerate(rows) if row != rows[0]}
    if differ:
        what = "; ".join(f"rank {rank}: {', '.join(names)}" for rank, names in list(differ.items())[:4])
        first = dict(zip(fingerprint, rows[0]))
        raise RankMismatch(
            f"the ranks did not start from the same state ({what} differ from rank 0, which is at update "
            f"{first.get('update')}): give every rank the same run_dir (a filesystem all nodes share) or the "
            "same checkpoint on every node, then start again")


def peer_failure(error: BaseException) -> PeerFailure | None:
    """The one-line PeerFailure for `error` when it is a collective that lost its peers (gloo: connection
    closed or timed out; NCCL: error or watchdog timeout), else None (a bug of this rank: keep its traceback)."""
    if not _active() or not isinstance(error, (RuntimeError, dist.DistError)):
        return None
    text = " ".join(str(error).split())
    if not isinstance(error, dist.DistError) and not re.search(r"gloo|nccl|closed by peer|reset by peer", text, re.I):
        return None
    detail = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)  # drop C++ source locations
    detail = detail.split(". ")[0].rstrip(".")[:200]  # the first sentence: gloo's go on for several
    return PeerFailure(
        f"rank {dist.get_rank()}: another rank failed, was stopped or stopped answering ({detail}); its own "
        "message is above. Fix the cause and run the same command: training resumes from the last checkpoint")


def barrier() -> None:
    if _active():
        dist.barrier()


def cleanup() -> None:
    """Leave the process group (call once at the end of the run, on every rank)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def pick_device(name: str, *, training: bool = False) -> torch.device:
    """`device=auto | cpu | cuda | cuda:N | mps` as a torch.device; a CUDA device is also made current, with TF32
    matmuls (training and decoding on Ampere and later).

    The one device rule, for train.py, translate.py, evaluate.py and Translator.load alike: a process under
    torchrun uses the GPU its LOCAL_RANK names (`auto` and `cuda` are cuda:LOCAL_RANK), and `cuda:N` with
    WORLD_SIZE > 1 is refused, since every rank would then use GPU N. The name and the rule are checked before
    the hardware is asked anything, so a machine without CUDA gives the same error.

    `mps` (Apple silicon) is for decoding only (translate.py, evaluate.py), where torch was built with it; it is
    untested here (no such machine), and training refuses it (`training=True`): the distributed and
    mixed-precision paths are written for CUDA and CPU.
    """
    name = str(name)
    choices = "auto, cpu, cuda, cuda:N" + ("" if training else ", mps")
    world_size, local_rank = _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0)
    if name == "mps":
        if training:
            raise ConfigError("device=mps is not supported for training (translate.py and evaluate.py accept it): "
                              "use device=cpu, or a CUDA machine")
        if not torch.backends.mps.is_available():
            raise ConfigError("device=mps but this torch has no MPS device (Apple silicon with macOS 12.3+ only): "
                              "use device=cpu or device=auto")
        return torch.device("mps")
    if name == "cpu":
        return torch.device("cpu")
    if name not in ("auto", "cuda"):
        index = name.removeprefix("cuda:")
        if not (name.startswith("cuda:") and index.isdigit()):
            hint = " (device=cuda is the GPU)" if name.lower() in ("gpu", "gpus", "nvidia") else ""
            suffix = " (N a GPU number, e.g. cuda:0)" if name.startswith("cuda") else hint
            raise ConfigError(f"device={name} is not one of {choices}{suffix}")
        if world_size > 1:
            raise ConfigError(f"device={name} with WORLD_SIZE={world_size}: under torchrun each process uses the GPU "
                              f"its LOCAL_RANK names (cuda:LOCAL_RANK); give device=cuda or device=auto, and choose "
                              "the GPUs with CUDA_VISIBLE_DEVICES")
        local_rank = int(index)
    gpus = _claim_gpu(local_rank)
    if gpus == 0:
        if name == "auto":
            return torch.device("cpu")
        raise ConfigError(f"device={name} but no CUDA device is visible: use device=cpu or device=auto")
    if local_rank >= gpus:
        which = f"device={name}" if name.startswith("cuda:") else f"LOCAL_RANK={local_rank} (device={name})"
        raise ConfigError(f"{which} but this machine has {gpus} CUDA device(s) (cuda:0 to cuda:{gpus - 1}): "
                          + ("choose one of them" if name.startswith("cuda:") else
                             "start at most that many processes per node (torchrun --nproc_per_node)"))
    return torch.device("cuda", local_rank)


def _claim_gpu(index: int) -> int:
    """How many CUDA devices this process sees (0 without CUDA); GPU `index`, when among them, becomes the
    current device, with TF32 matmuls. The one place the device rule touches the hardware (tests replace it)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index < count:
        torch.cuda.set_device(index)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return count
