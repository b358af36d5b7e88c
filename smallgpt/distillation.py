"""Distillation from a teacher run, train.py's --distill (the losses are smallgpt/hybridize.py's):
'layers', stage 1 of the conversion papers, trains only the layers a conversion made, each on the
MSE to the teacher's attention output on the teacher's input to that layer; 'logits', stage 2,
trains the whole student on the KL to the teacher's next-token distributions, plus distill_ce
times the data's cross-entropy. The teacher is --teacher, else the convert: source, and the run
records it, so that a resumed run distills from the same one."""

from collections.abc import Callable

import torch

from model import GPT
from smallgpt import checkpoint, hybridize, runtime
from smallgpt.checkpoint import Source
from smallgpt.configs import TrainConfig
from smallgpt.errors import UserError

Loss = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def teacher_of(cfg: TrainConfig, source: Source, ckpt: dict | None) -> str:
    """The teacher's run folder or checkpoint (cfg.distill set): --teacher, else the convert:
    source, else the one the resumed run recorded."""
    if cfg.teacher:
        return cfg.teacher
    if source.kind == "convert":
        return source.where
    recorded = checkpoint.run_config(ckpt).get("teacher", "") if ckpt is not None else ""
    if recorded:
        return recorded
    raise UserError(
        f"distill={cfg.distill!r} needs a teacher: --teacher=<run folder or checkpoint>, or "
        "--init_from=convert:<run> to distill from the run converted"
    )


def converted_layers(teacher: GPT, student: GPT) -> list[int]:
    """The student's layers of a kind that converts attention where the teacher's layer is of
    another kind: what a conversion made."""
    return [
        i
        for i, (theirs, ours) in enumerate(
            zip(teacher.config.layer_kinds, student.config.layer_kinds, strict=True)
        )
        if ours.converts_attention and ours is not theirs
    ]


def loss(cfg: TrainConfig, student: GPT, proc: runtime.Dist) -> Loss:
    """train_step's loss_of for cfg.distill, the teacher loaded onto proc's device; for 'layers',
    every parameter but the converted layers' frozen."""
    teacher = checkpoint.load_run(Source("convert", cfg.teacher), tokenizer=False).model
    teacher = teacher.to(proc.device).eval().requires_grad_(False)
    if teacher.config.vocab_size != student.config.vocab_size:
        raise UserError(
            f"the teacher {cfg.teacher} has vocab_size={teacher.config.vocab_size}, the run "
            f"{student.config.vocab_size}: distill from a run on the same tokens"
        )
    if cfg.distill == "logits":

        def kl(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = model(x, y)[0]
            with torch.no_grad():
                wanted = teacher(x, y)[0]
            return hybridize.distillation_loss(logits, wanted, y, cfg.distill_ce)

        return kl
    layers = converted_layers(teacher, student)
    if not layers or teacher.config.n_layer != student.config.n_layer:
        raise UserError(
            f"distill='layers' trains the layers a conversion made, and the run has none that the "
            f"teacher {cfg.teacher} attends in: convert with a layer_pattern of D layers first"
        )
    if proc.world_size > 1 or cfg.parallel == "fsdp" or cfg.compile:
        raise UserError(
            "distill='layers' trains each converted layer on its own, in one process, uncompiled: "
            "run it without torchrun and with compile=False"
        )
    hybridize.train_only(student, layers)

    def mse(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return hybridize.layer_matching_loss(student, hybridize.mixer_io(teacher, x, layers))

    return mse
