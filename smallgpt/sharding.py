"""train.py's parallel training: DDP's wrapper, and FSDP2 (torch.distributed.fsdp.fully_shard) for
--parallel=fsdp: each block and the root sharded over the processes, a model built on the meta
device and initialised shard by shard, and sharded checkpoints written with
torch.distributed.checkpoint (readable at any number of processes, with or without FSDP).

A sharded checkpoint is a folder `sharded-<iteration>` beside ckpt.pt; ckpt.pt (the full model,
gathered) names it under 'sharded' and is written after it, so a crash at any point leaves a ckpt.pt
whose folder is complete.
"""

import inspect
import re
import shutil
import sys
import warnings
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from model import GPT, GPTConfig
from smallgpt.checkpoint import KEPT_NAME
from smallgpt.errors import UserError, first_line


def loaded_class(module: str, name: str) -> type | None:
    """A class of torch's distributed packages if the package is imported, else None: only FSDP
    imports them (about a second of start-up, so train.py does not), and a tensor or model made
    without them cannot be of their classes."""
    package = sys.modules.get(module)
    return getattr(package, name) if package is not None else None


def is_dtensor(t: torch.Tensor) -> bool:
    dtensor = loaded_class("torch.distributed.tensor", "DTensor")
    return dtensor is not None and isinstance(t, dtensor)


def shard(model: GPT, device: str, dtype: torch.dtype) -> GPT:
    """model with each block, then the root (embeddings, final norm, lm_head), sharded over the
    default process group; on CUDA with a 16-bit dtype, computed in that dtype with gradients
    reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy()
    if device.startswith("cuda") and dtype != torch.float32:
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def build(
    config: GPTConfig, device: str, dtype: torch.dtype, seed: int | None, sharded: bool
) -> GPT:
    """A new GPT made on the meta device, sharded (if sharded), then given memory on device (for its
    shards only) and initialised there by GPT.init_weights from seed: every rank draws each
    parameter's values in turn and keeps its shard, so any number of processes, sharded or not,
    starts from the same weights, and one parameter at a time is whole in memory, never the model.
    seed None leaves the weights uninitialised (a checkpoint is loaded next)."""
    with torch.device("meta"):
        model = GPT(config)
    if sharded:
        shard(model, device, dtype)
    model.to_empty(device=device)
    model.lm_head.weight = model.transformer.wte.weight  # to_empty made each module its own tensor
    model.init_buffers()
    if seed is not None:
        model.init_weights(seed, assign=assign_shard)
    return model


def assign_shard(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a parameter's full value (on CPU) into it: its own shard where it is sharded (no
    communication)."""
    if is_dtensor(param):
        from torch.distributed.tensor import distribute_tensor

        mesh = param.device_mesh
        value = distribute_tensor(value, mesh, param.placements, src_data_rank=None).to_local()
    local(param).copy_(value)


def is_sharded(model: torch.nn.Module) -> bool:
    fsdp_module = loaded_class("torch.distributed.fsdp", "FSDPModule")
    return fsdp_module is not None and isinstance(model, fsdp_module)


def ddp(model: torch.nn.Module, device: int | None) -> DDP:
    """model wrapped by DDP (device: the CUDA device index, None on CPU), without a buffer broadcast
    at each forward (the rotary tables are the same everywhere; torch 2.13 renamed that flag)."""
    flag = "broadcast_buffers"
    if "forward_sync_buffers" in inspect.signature(DDP).parameters:
        flag = "forward_sync_buffers"
    device_ids = None if device is None else [device]
    return DDP(model, device_ids=device_ids, **{flag: False})


def gradient_sync(
    model: torch.nn.Module, raw_model: torch.nn.Module, last: bool
) -> AbstractContextManager:
    """Where the backward of a micro-batch runs: gradients are all-reduced (DDP) or reduce-scattered
    (FSDP) after the last micro-batch of a step only, accumulated locally before it."""
    if is_sharded(raw_model):
        raw_model.set_requires_gradient_sync(last)
    return model.no_sync() if isinstance(model, DDP) and not last else nullcontext()


def full_model_state(model: GPT) -> dict[str, torch.Tensor]:
    """The whole model's state_dict on CPU, gathered on rank 0 (empty on the others): a
    collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor as a whole: a DTensor gathered (a collective), any other as it is."""
    return t.full_tensor() if is_dtensor(t) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's shard, any other tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def all_finite(model: torch.nn.Module) -> bool:
    """Whether every weight is finite; for a sharded model, on every rank (the ranks agree: a
    collective)."""
    flag = torch.tensor(float(all(bool(local(p).isfinite().all()) for p in model.parameters())))
    if is_sharded(model):
        flag = flag.to(local(next(model.parameters())).device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def from_rank0(value: object) -> object:
    """value as rank 0 has it, on every rank (a collective)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


SHARDED_NAME = re.compile(r"sharded-\d{7,}(\.tmp)?")  # save_sharded's folders, whole or unfinished


def save_sharded(
    out_dir: Path, iter_num: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> str:
    """Write the model and optimizer state, each rank its shards, to out_dir/sharded-<iter_num>
    (through a .tmp folder renamed when every rank is done); returns the folder's name. A complete
    folder for iter_num is kept as it is (the same iteration's state: saved again on a signal, or by
    a resumed run), never deleted and rewritten under the ckpt.pt that names it."""
    name = f"sharded-{iter_num:07d}"
    tmp = out_dir / (name + ".tmp")
    final = out_dir / name
    if (final / ".metadata").is_file():
        return name
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)  # an incomplete one, from a crash
        tmp.rename(final)
    dist.barrier()
    return name


def load_sharded(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Read a folder written by save_sharded into model and optimizer, sharded or not, at any number
    of processes."""
    if not (folder / ".metadata").is_file():
        raise UserError(
            f"the sharded checkpoint {folder}, which {folder.parent / 'ckpt.pt'} names, is missing "
            "or incomplete: restore it, or start a new run"
        )
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    try:
        # read by one process: torch's warning that it assumes so is nothing a user can act on
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, checkpoint_id=folder)
    except (CheckpointException, RuntimeError, ValueError, OSError) as e:
        raise UserError(
            f"the sharded checkpoint {folder} is corrupt or does not fit this model "
            f"({first_line(e)})"
        ) from e
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )


def checkpoint_state(
    out_dir: Path, iter_num: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict:
    """What ckpt.pt holds of the model and optimizer: the optimizer's state; or, for a sharded
    model, the name of the sharded checkpoint written now and the whole model gathered (collectives:
    every rank calls it)."""
    if not is_sharded(model):
        return {"optimizer": optimizer.state_dict()}
    return {
        "sharded": save_sharded(out_dir, iter_num, model, optimizer),
        "model_state": full_model_state(model),
    }


def load_optimizer(
    ckpt: dict, out_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """A checkpoint's optimizer state into optimizer, sharded or not: from the sharded checkpoint it
    names (with the weights, at any number of processes), or from its own whole state."""
    if "sharded" in ckpt:
        load_sharded(out_dir / ckpt["sharded"], model, optimizer)
    elif is_sharded(model):  # written without FSDP: parameters by number, not by name
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        names = {id(p): n for n, p in model.named_parameters()}
        saved = ckpt["optimizer"]
        by_name = {}  # the saved state's parameter numbers -> the model's names
        for group, ours in zip(saved["param_groups"], optimizer.param_groups, strict=True):
            numbered = zip(group["params"], ours["params"], strict=True)
            by_name |= {i: names[id(p)] for i, p in numbered}
        groups = [g | {"params": [by_name[i] for i in g["params"]]} for g in saved["param_groups"]]
        state = {
            "state": {by_name[i]: s for i, s in saved["state"].items()},
            "param_groups": groups,
        }
        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(model, optimizer, state, options=options)
    else:
        try:
            optimizer.load_state_dict(ckpt["optimizer"])
        except ValueError as e:  # torch's: a group holds another number of parameters
            raise UserError(
                f"the checkpoint's optimizer state does not fit this run's optimizer ({e}): it was "
                "saved by a version that split the parameters otherwise between its optimizers; "
                "--init_from=convert:<this out_dir> with a new --out_dir trains on from its "
                "weights with a new optimizer state"
            ) from None


def prune_sharded(out_dir: Path, iter_num: int) -> None:
    """Delete the sharded-<iteration> folders (and unfinished .tmp ones) that neither ckpt.pt (at
    iter_num) nor a kept ckpt-<iteration>.pt names: folders of exactly the names save_sharded
    writes, no other."""
    kept = (KEPT_NAME.fullmatch(p.name) for p in out_dir.iterdir())
    keep = {f"sharded-{iter_num:07d}"} | {f"sharded-{match[1]}" for match in kept if match}
    for folder in out_dir.iterdir():
        if SHARDED_NAME.fullmatch(folder.name) and folder.name not in keep and folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)


def per_rank_bytes(config: GPTConfig, world_size: int) -> dict[str, int]:
    """Bytes one rank holds for fp32 parameters, gradients and AdamW's two moments (4 x 4 bytes a
    parameter): with DDP (whole) and with FSDP (rank 0's shards, from fully_shard on the meta device
    over a fake process group of world_size ranks: no memory, no devices)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        with torch.device("meta"):
            model = GPT(config)
        params = sum(p.numel() for p in model.parameters())
        shard(model, "cpu", torch.float32)
        shards = sum(local(p).numel() for p in model.parameters())
    finally:
        dist.destroy_process_group()
    return {"params": params, "ddp_bytes": 16 * params, "fsdp_bytes": 16 * shards}
