"""What the ranks of a run agree on: once before the first update (`start_fingerprint`: the same update, data
position, weights, optimizer state, ...), and once per update (`agree` and `settle`: the update's tokens, the
stop signals, and rank 0's clocks, which time-based decisions read so that every rank decides alike).

One collective per update, summed, left on the device until the end of the update: the device never waits
for the host in between (train.py's `train_step`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

import torch

from data.batching import BatchStream
from data.vocab import Vocab
from transformer import distributed
from transformer.training.budget import Costs
from transformer.checkpoint import TrainState
from transformer.config import TrainJob


@dataclass(frozen=True)
class Clock:
    """Rank 0's clocks, as every rank received them at the start of the latest update. Time-based decisions
    (train.max_time, train.save_every_minutes) read these, never a rank's own clock: the ranks' clocks drift
    apart while rank 0 alone validates BLEU and writes checkpoints."""

    train_seconds: float = 0.0  # updates only (throughput, training hours)
    since_save: float = 0.0
    wall_seconds: float = 0.0  # the run's wall clock, all its processes (train.max_time; transformer/training/budget.py)
    costs: Costs = Costs()  # rank 0's measured costs of an update, a validation, a save and the end of the run



AGREED = ("tokens", "stops", "train_seconds", "since_save", "wall_seconds", *(f.name for f in fields(Costs)))



@dataclass(frozen=True)
class Agreement:
    """What `agree` summed over the ranks, in the order of AGREED: a float64 tensor left on the device, so that
    the update can divide its loss by `tokens` without the host waiting; `settle` reads the rest once."""

    summed: torch.Tensor

    @property
    def tokens(self) -> torch.Tensor:
        """The target tokens of the update over all ranks (a device scalar): the loss divisor."""
        return self.summed[AGREED.index("tokens")]



@dataclass(frozen=True)
class Settled:
    """The host's reading of an update's agreement (`settle`)."""

    tokens: float  # target tokens of the update, all ranks
    stop: bool  # some rank received a stop signal: every rank stops after this update
    finite: bool  # the gradient norm was finite
    clock: Clock  # rank 0's clocks at the start of the update



def agree(tokens: int, stop_requested: bool, reading: Clock | None, *, device: torch.device) -> Agreement:
    """The one collective of an update, before its backward passes: the target tokens of all ranks (the loss
    divisor), the stop signals received, and rank 0's clocks and costs (`reading`: rank 0's own `Clock` now,
    None on the other ranks), summed over ranks. The host reads it once, at the end of the update (`settle`),
    so that the device never waits for the host in between."""
    values = dict.fromkeys(AGREED, 0.0)
    values.update(tokens=tokens, stops=float(stop_requested))
    if reading is not None:
        values.update(train_seconds=reading.train_seconds, since_save=reading.since_save,
                      wall_seconds=reading.wall_seconds, **dataclasses.asdict(reading.costs))
    tensor = torch.tensor([values[key] for key in AGREED], dtype=torch.float64)
    if device.type == "cuda":  # from pinned memory, asynchronously: a pageable copy would make the host wait
        tensor = tensor.pin_memory().to(device, non_blocking=True)  # (torch's pinned cache keeps the block until copied)
    distributed.all_reduce_sum(tensor)
    return Agreement(tensor)



def settle(agreement: Agreement, finite: torch.Tensor) -> Settled:
    """The update's one host sync: what `agree` summed and whether its gradient norm was finite, with rank 0's
    `Clock` for every rank."""
    *summed, is_finite = torch.cat([agreement.summed, finite.double()[None]]).tolist()
    values = dict(zip(AGREED, summed))
    clock = Clock(train_seconds=values["train_seconds"], since_save=values["since_save"],
                  wall_seconds=values["wall_seconds"], costs=Costs(**{f.name: values[f.name] for f in fields(Costs)}))
    return Settled(tokens=values["tokens"], stop=values["stops"] > 0, finite=is_finite > 0, clock=clock)



def start_fingerprint(job: TrainJob, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      scaler: torch.amp.GradScaler, state: TrainState, stream: BatchStream,
                      vocab: Vocab) -> dict[str, int]:
    """What every rank must agree on before the first update: the update, the data (its batches and the
    position in them), the update plan, the vocabulary, the seed, and exact checksums of the weights, the
    optimizer state and the loss scale."""
    def checksum(tensors) -> int:
        """The tensors' bits as integers, summed per tensor (exact, so the same on any device) and weighted by
        the tensor's position, so that two swapped tensors differ."""
        total = 0
        for i, tensor in enumerate(tensors):
            bits = tensor.detach().contiguous().view(-1)
            bits = bits.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[bits.element_size()])
            total += (i + 1) * int(bits.sum(dtype=torch.int64))
        return total % (1 << 61)

    moments = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"update": state.step, "epoch": stream.epoch, "batch": stream.offset, "batches per epoch":
            len(stream.batches), "update plan": state.world_size * state.update_freq * state.max_tokens,
            "vocabulary": int(vocab.sha256[:15], 16), "seed": job.seed,
            "weights": checksum(model.state_dict().values()), "optimizer state": checksum(moments),
            "loss scale": int(scaler.get_scale() * 1024) if scaler.is_enabled() else 0}
