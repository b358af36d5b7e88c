"""Distillation from a teacher run, train.py's --distill (the losses are smallgpt/hybridize.py's):
'layers', stage 1 of the conversion papers, trains only the layers a conversion made, each on the
MSE to the teacher's attention output on the teacher's input to that layer; 'logits', stage 2,
trains the whole student on the KL to the teacher's next-token distributions, plus distill_ce
times the data's cross-entropy. The teacher is --teacher, else the convert: source, and the run
records it, so that a resumed run distills from the same one."""

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from model import GPT
from smallgpt import checkpoint, hybridize, runtime
from smallgpt.checkpoint import Source
from smallgpt.configs import TrainConfig
from smallgpt.errors import UserError

Loss = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def planned_teacher(distill: str, teacher: str, source: Source) -> str:
    """The teacher a run records when it starts (what it sets for itself, not a setting of its
    own): --teacher, else its convert: source ('' without distill, or with neither)."""
    if not distill:
        return ""
    if teacher:
        return teacher
    return source.where if source.kind == "convert" else ""


def teacher_of(cfg: TrainConfig, source: Source, ckpt: dict | None) -> str:
    """The teacher's run folder or checkpoint (cfg.distill set): --teacher, else the convert:
    source, else the one the resumed run recorded."""
    planned = planned_teacher(cfg.distill, cfg.teacher, source)
    if planned:
        return planned
    recorded = checkpoint.run_config(ckpt).get("teacher", "") if ckpt is not None else ""
    if recorded:
        return recorded
    raise UserError(
        f"distill={cfg.distill!r} needs a teacher: --teacher=<run folder or checkpoint>, or "
        "--init_from=convert:<run> to distill from the run converted"
    )


@dataclass(slots=True)
class Teacher:
    """The teacher a run distils from: where (cfg.teacher), its checkpoint, and what identifies its
    weights (recorded in the run's checkpoints, so that a resumed run knows it is the same)."""

    where: str
    ckpt: dict
    weights: dict


def teacher_for(cfg: TrainConfig, meta: dict, resumed: dict | None) -> Teacher:
    """cfg.teacher's checkpoint, checked before any work: there, trained on the dataset's tokens
    (meta), of the run's depth for 'layers', and for a resumed run (resumed: its checkpoint) the
    same weights it started distilling from; a UserError naming the teacher otherwise."""
    path = Source("convert", cfg.teacher).checkpoint_path("")
    if not path.is_file():
        fix = "give --teacher=<its run folder or checkpoint>"
        if resumed is not None:
            fix = f"--teacher=<its new place> resumes this run ({fix.split(' ', 1)[1]})"
        raise UserError(
            f"the teacher this run distils from, {cfg.teacher}, has no checkpoint at {path} "
            f"(moved or deleted?): {fix}"
        )
    ckpt = checkpoint.load_checkpoint(path, "cpu", mmap=True)
    advice = "distill from a teacher trained on this dataset's tokens"
    try:
        vocab = ckpt["model_config"].get("vocab_size", 0)
        checkpoint.check_vocabulary(vocab, meta, ckpt.get("data_meta"), cfg.dataset, advice)
    except UserError as e:
        raise UserError(f"the teacher {cfg.teacher}: {e}") from e
    depth = ckpt["model_config"].get("n_layer")
    if cfg.distill == "layers" and depth != cfg.n_layer:
        raise UserError(
            f"distill='layers' matches each converted layer to the teacher's same layer, and the "
            f"teacher {cfg.teacher} has {depth} layers, the run {cfg.n_layer}: distill from the "
            f"run it was converted from"
        )
    weights = {"iter_num": ckpt.get("iter_num"), "digest": digest(ckpt["model"])}
    was = resumed.get("teacher_weights") if resumed is not None else None
    if was is not None and was != weights:
        raise UserError(
            f"the teacher {cfg.teacher} changed since this run started distilling from it (it "
            f"was at iteration {was['iter_num']}, it is at {weights['iter_num']} now): restore "
            f"the teacher as it was, or distill from it as it is in a new run (another out_dir)"
        )
    return Teacher(cfg.teacher, ckpt, weights)


def digest(state: dict[str, torch.Tensor]) -> str:
    """A SHA-1 of a state_dict's names and bytes: the same weights, the same digest."""
    sha = hashlib.sha1()
    for name in sorted(state):
        sha.update(name.encode())
        t = state[name].detach().contiguous().cpu()
        sha.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return sha.hexdigest()


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


def loss(cfg: TrainConfig, student: GPT, proc: runtime.Dist, teacher: Teacher) -> Loss:
    """train_step's loss_of for cfg.distill, the teacher (teacher_for's) loaded onto proc's
    device; for 'layers', every parameter but the converted layers' frozen."""
    teacher = checkpoint.model_from_checkpoint(teacher.ckpt)
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
