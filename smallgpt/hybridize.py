"""A trained attention model converted into a Gated DeltaNet hybrid, as the 2024-26 distillation
papers do (Mamba in the Llama, LoLCATs, RADLADS, KL-guided layer selection, Taylor-Calibrate):

- `to_hybrid`: the layers the new layer_pattern makes D take their attention's projections, W_q
  to q, W_k and W_v (each query head h from K/V head h // group) to k and v, W_o to the output;
  the embeddings, norms, MLPs and the layers kept as attention are copied as they are.
- `decays`: each head's decay calibrated from the teacher's attention maps, the decay whose
  exponential look-back has the mean look-back distance the head shows.
- `ranked_layers`: which layers to keep as attention, by what converting each alone costs in loss
  or by the KL to the teacher with each one restored in an all-converted model ("GA-S2").
- `layer_matching_loss` (stage 1) and `kl_to_teacher` (stage 2): the distillation losses.

What the copy cannot hold, so what uptraining must learn: softmax's normalisation and its
positions (the recurrent layer has neither), the SiLU after the short convolution (the convolution
itself starts as the identity: its last tap 1, the others 0), and the gated RMSNorm of each
head's output (c_z at its initial values, or the attention's elementwise output gate where it has
one). A q/k RMSNorm folds into W_q and W_k exactly: the layer L2-normalises q and k anyway.
"""

import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.nn.functional as F

import attention
from model import GPT, LAYER_KINDS, GPTConfig
from smallgpt.errors import UserError

RANKINGS = ("loss", "kl")


def to_hybrid(
    model: GPT,
    layer_pattern: str,
    decays: dict[int, torch.Tensor] | None = None,
    seed: int = 0,
) -> GPT:
    """A copy of an attention model with layer_pattern's D layers converted from its global
    attention layers (see the module's text); each converted layer's decay per head from
    `decays` (layer: (n_head,) in (0, 1), its input dependence zeroed) or at its initial values.
    What the copy does not set starts as a new model made with `seed` would (GPT.init_weights):
    the same conversion, the same model."""
    try:
        config = replace(model.config, layer_pattern=layer_pattern, window_pattern="L")
    except ValueError as e:
        raise UserError(f"cannot convert the model to layer_pattern={layer_pattern!r}: {e}") from e
    sources = model.transformer.h
    converted = [
        i
        for i, kind in enumerate(config.layer_kinds)
        if kind.converts_attention and kind is not model.config.layer_kinds[i]
    ]
    sources_ok = global_attention_layers(model)
    for i in converted:
        if i not in sources_ok:
            latent = model.config.attention_type == "MLA"
            source = "MLA" if latent else model.config.layer_kinds[i].name
            raise UserError(
                f"layer {i} is {source}: a {config.layer_kinds[i].name} layer is made from global "
                "attention (MHA, GQA or MQA) only"
            )
    hybrid = GPT(config).to(next(model.parameters()).device)
    hybrid.init_weights(seed)
    state = hybrid.state_dict()
    # everything but the converted layers' mixers, as it is (a kept layer's kind must match)
    mixers = tuple(f"transformer.h.{i}.attn." for i in converted)
    for name, t in model.state_dict().items():
        if not name.startswith(mixers):
            if name not in state or state[name].shape != t.shape:
                raise UserError(unplaced(model.config, config, name))
            state[name] = t
    hybrid.load_state_dict(state)
    with torch.no_grad():
        for i in converted:
            hybrid.transformer.h[i].attn.take_attention(sources[i].attn)
            if decays is not None and i in decays:
                hybrid.transformer.h[i].attn.keep_decay(decays[i])
    return hybrid


def unplaced(source: GPTConfig, target: GPTConfig, weight: str) -> str:
    """Why a weight of the source (state_dict name) has no place in the converted model, said by
    its layer and kinds: a kept layer must keep its kind (a conversion makes attention recurrent,
    never the reverse), and the layers' shapes the source's."""
    match = re.match(r"transformer\.h\.(\d+)\.", weight)
    if match is None:
        return (
            f"cannot convert into layer_pattern={target.layer_letters!r}: the model outside its "
            f"layers (embeddings, final norm) differs from the source's; convert with the source's "
            f"vocabulary and positions"
        )
    i = int(match[1])
    was = source.layer_kinds[i].name
    now = target.layer_kinds[i].name
    if was != now:
        return (
            f"cannot convert layer {i}: it is {was} in the source and layer_pattern="
            f"{target.layer_letters!r} makes it {now}; a conversion makes global attention "
            f"recurrent and keeps every other layer's kind: give layer {i} its letter "
            f"{source.layer_letters[i]!r}"
        )
    return (
        f"cannot convert layer {i} ({was}): its weights do not fit layer_pattern="
        f"{target.layer_letters!r} with the source's other settings; convert with the source's "
        f"model settings (only the layer letters change)"
    )


@contextmanager
def recorded_queries_and_keys(model: GPT) -> Iterator[dict[int, list[tuple]]]:
    """Inside: every call of attention's SDPA in model's global_attention_layers appends (q, k,
    mask) to its layer's list, as the scores see them: after rotation and any q/k norm."""
    records: dict[int, list[tuple]] = {}
    running = []
    original = attention.sdpa

    def recording(q, k, v, mask, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if running:
            records.setdefault(running[-1], []).append((q.detach(), k.detach(), mask))
        return original(q, k, v, mask, *args, **kwargs)

    def enter(module: torch.nn.Module, args: tuple) -> None:
        running.append(module.layer)

    def leave(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        running.pop()

    hooks = []
    attention.sdpa = recording
    try:
        for i in global_attention_layers(model):
            hooks.append(model.transformer.h[i].attn.register_forward_pre_hook(enter))
            hooks.append(model.transformer.h[i].attn.register_forward_hook(leave))
        yield records
    finally:
        attention.sdpa = original
        for hook in hooks:
            hook.remove()


def attention_probs(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) over what each query sees (mask None: causal): (B, H, T, Tk)."""
    group = q.size(1) // k.size(1)
    k = k.repeat_interleave(group, dim=1)
    scores = (q.float() @ k.float().mT) * q.size(-1) ** -0.5
    if mask is None:
        T, Tk = scores.shape[-2:]
        mask = torch.ones(T, Tk, dtype=torch.bool, device=q.device).tril(Tk - T)
    return scores.masked_fill(~mask, float("-inf")).softmax(-1)


def look_back(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head's mean look-back distance sum_s p(t, s) (t - s) over every query (H,), and how far
    back each query could look (T,): its visible keys less one."""
    T, Tk = probs.shape[-2:]
    t = torch.arange(T, device=probs.device)[:, None] + (Tk - T)
    distance = (t - torch.arange(Tk, device=probs.device)).clamp(min=0).float()
    mean = (probs * distance).sum(-1).mean(dim=(0, 2))
    reach = ((probs > 0).sum(-1).amax(dim=(0, 1)) - 1).clamp(min=0)
    return mean, reach


def geometric_look_back(decay: torch.Tensor, reach: torch.Tensor) -> torch.Tensor:
    """The mean look-back distance of attention weights a^d over d = 0..reach_t for each query t,
    averaged over the queries: (heads,) for decays (heads,)."""
    d = torch.arange(int(reach.max()) + 1, dtype=torch.float64, device=decay.device)
    weights = decay.double()[:, None, None] ** d  # (heads, 1, D)
    weights = weights * (d <= reach.double()[:, None])  # (heads, T, D)
    return ((weights * d).sum(-1) / weights.sum(-1)).mean(-1)


def decay_for(mean: torch.Tensor, reach: torch.Tensor, steps: int = 60) -> torch.Tensor:
    """The decay per head whose exponential look-back (geometric_look_back) has the observed mean,
    by bisection; clamped to half-lives from about a tenth of a token to 100 times the reach."""
    low = torch.full_like(mean, 1e-3, dtype=torch.float64)
    high = torch.full_like(mean, 0.5 ** (1 / (100 * max(int(reach.max()), 1))), dtype=torch.float64)
    for _ in range(steps):
        mid = (low + high) / 2
        below = geometric_look_back(mid, reach) < mean.double()
        low = torch.where(below, mid, low)
        high = torch.where(below, high, mid)
    return ((low + high) / 2).float()


def half_life(decay: torch.Tensor) -> torch.Tensor:
    """Tokens until a^n = 1/2."""
    return math.log(0.5) / decay.double().log()


@torch.no_grad()
def decays(model: GPT, batches: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Each global attention layer's decay per head, from its attention maps over the batches of
    tokens (Taylor-Calibrate's half-life from the head's mean look-back distance)."""
    sums: dict[int, list] = {}
    with recorded_queries_and_keys(model) as records:
        for idx in batches:
            model(idx)
    for layer, calls in records.items():
        for q, k, mask in calls:
            mean, reach = look_back(attention_probs(q, k, mask))
            sums.setdefault(layer, []).append((mean, reach))
    return {
        layer: decay_for(torch.stack([m for m, _ in got]).mean(0), got[0][1])
        for layer, got in sums.items()
    }


def global_attention_layers(model: GPT) -> list[int]:
    """The layers to_hybrid can convert: global MHA, GQA or MQA (a kind's conversion_source, in
    a model without MLA's latent)."""
    config = model.config
    if config.attention_type == "MLA":
        return []
    return [i for i, kind in enumerate(config.layer_kinds) if kind.conversion_source]


def recurrent_letter() -> str:
    """The letter of the kind attention converts into (LayerKind.converts_attention)."""
    return next(kind.letter for kind in LAYER_KINDS.values() if kind.converts_attention)


def with_converted(model: GPT, layers: list[int]) -> str:
    """model's layer letters with these layers made the recurrent kind's."""
    letters = model.config.layer_letters
    return "".join(recurrent_letter() if i in layers else x for i, x in enumerate(letters))


@torch.no_grad()
def mean_loss(model: GPT, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The cross-entropy over the batches of (inputs, targets)."""
    return sum(model(x, y)[1].item() for x, y in batches) / len(batches)


@torch.no_grad()
def mean_kl(student: GPT, teacher: GPT, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """kl_to_teacher over every position of the batches."""
    kls = [kl_to_teacher(student(x, y)[0], teacher(x, y)[0]).item() for x, y in batches]
    return sum(kls) / len(kls)


def ranked_layers(
    teacher: GPT,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    by: str,
    decays: dict[int, torch.Tensor] | None = None,
    seed: int = 0,
) -> list[int]:
    """The global attention layers, the one most worth keeping as attention first: by 'loss', what
    converting it alone adds to the loss; by 'kl', how close to the teacher (KL) a model with every
    other one converted comes with it restored (GA-S2 of arXiv 2512.20569); each conversion
    to_hybrid's with seed."""
    layers = global_attention_layers(teacher)
    teacher.eval()  # no dropout in what is measured
    if by == "loss":
        base = mean_loss(teacher, batches)
        cost = {
            i: mean_loss(
                to_hybrid(teacher, with_converted(teacher, [i]), decays, seed).eval(), batches
            )
            - base
            for i in layers
        }
        return sorted(layers, key=lambda i: -cost[i])
    if by == "kl":
        kl = {}
        for i in layers:
            others = [j for j in layers if j != i]
            student = to_hybrid(teacher, with_converted(teacher, others), decays, seed).eval()
            kl[i] = mean_kl(student, teacher, batches)
        return sorted(layers, key=lambda i: kl[i])
    raise UserError(f"a ranking of layers is by {' or '.join(map(repr, RANKINGS))}, not {by!r}")


def mixer_io(
    teacher: GPT, idx: torch.Tensor, layers: list[int]
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each of these layers' mixer input (its block's normed stream) and output, in the teacher's
    forward over idx."""
    io: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []
    for i in layers:

        def keep(module: torch.nn.Module, args: tuple, out: torch.Tensor, i: int = i) -> None:
            io[i] = (args[0].detach(), out.detach())

        hooks.append(teacher.transformer.h[i].attn.register_forward_hook(keep))
    try:
        with torch.no_grad():
            teacher(idx)
    finally:
        for hook in hooks:
            hook.remove()
    return io


def layer_matching_loss(
    student: GPT, io: dict[int, tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """Stage 1: the mean over the converted layers of the MSE between each one's output on the
    teacher's input to that layer and the teacher's attention output there."""
    losses = [
        F.mse_loss(student.transformer.h[i].attn(x, None, None, None), y)
        for i, (x, y) in io.items()
    ]
    return torch.stack(losses).mean()


def train_only(student: GPT, layers: list[int]) -> None:
    """Stage 1's parameters: these layers' mixers train, every other parameter is frozen."""
    mixers = tuple(f"transformer.h.{i}.attn." for i in layers)
    for name, p in student.named_parameters():
        p.requires_grad_(name.startswith(mixers))


def kl_to_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Stage 2: KL(teacher || student) of the next-token distributions, the mean over positions."""
    s = F.log_softmax(student_logits.float().flatten(0, -2), dim=-1)
    t = F.log_softmax(teacher_logits.float().flatten(0, -2), dim=-1)
    return (t.exp() * (t - s)).sum(-1).mean()


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    targets: torch.Tensor,
    ce_weight: float,
) -> torch.Tensor:
    """Stage 2's loss: the KL to the teacher plus ce_weight times the data's cross-entropy."""
    kl = kl_to_teacher(student_logits, teacher_logits)
    if not ce_weight:
        return kl
    flat = student_logits.float().flatten(0, -2)
    return kl + ce_weight * F.cross_entropy(flat, targets.reshape(-1), ignore_index=-1)


def for_uptraining(
    teacher: GPT,
    letters: str,
    layers: str,
    calibrate: bool,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    seed: int = 0,
) -> GPT:
    """train.py's conversion into the hybrid whose layer letters are `letters`: its D layers where
    given, or (layers 'loss' or 'kl') as many attention layers kept as it keeps, the best ranked
    on the batches; calibrated on the batches' inputs if asked; seed: to_hybrid's."""
    if (layers != "given" or calibrate) and not batches:
        raise UserError(f"convert_layers={layers!r} and convert_calibrate read batches: none given")
    teacher.eval()  # its attention maps and losses without dropout
    decays_ = decays(teacher, [x for x, _ in batches]) if calibrate else None
    if layers != "given":
        kept = len(letters) - letters.count(recurrent_letter())
        candidates = global_attention_layers(teacher)
        if not 0 < kept < len(candidates):  # all converted, or none: no choice to rank
            says = "keeps none" if kept == 0 else f"keeps {kept} of {len(candidates)}"
            raise UserError(
                f"convert_layers={layers!r} ranks which of the {len(candidates)} attention "
                f"layers stay attention, and layer_pattern={letters!r} {says}: nothing to choose; "
                f"leave convert_layers out, or keep some attention layers and convert others"
            )
        keep = ranked_layers(teacher, batches, layers, decays_, seed)[:kept]
        letters = with_converted(teacher, [i for i in candidates if i not in keep])
    return to_hybrid(teacher, letters, decays_, seed)
