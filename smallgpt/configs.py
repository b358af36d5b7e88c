"""The keys of train.py, sample.py and compare.py: one dataclass each, its defaults and its checks
(a ValueError naming the numbers, said by configurator.py as one line), importable by the modules
below the scripts."""

import itertools
import re
from dataclasses import dataclass, field, fields

from configurator import build, given_values
from model import LAYER_KINDS, GPTConfig
from smallgpt.checkpoint import Source, parse_source, start_from
from smallgpt.convert import CONVERT_METHODS
from smallgpt.errors import UserError
from smallgpt.fieldtypes import checked_values, with_fields_of
from smallgpt.generation import check_sampling
from smallgpt.hf import GPT2_NAMES
from smallgpt.hybridize import RANKINGS
from smallgpt.quantize import QUANTIZE
from smallgpt.recall import LONG_TASKS, task_problems
from smallgpt.variant import Variant

CONVERT_LAYERS = ("given", *RANKINGS)  # convert_layers
DISTILL = ("", "layers", "logits")  # distill
PRETRAINED_KEYS = ("dropout", "block_size", "n_kv_head")  # model keys pretrained weights take


@with_fields_of(
    GPTConfig, block_size=256, n_layer=6, n_head=6, n_embd=384, bias=False, vocab_size=None
)
@dataclass(slots=True)
class TrainConfig:
    """train.py's keys: these, then GPTConfig's (the model), its defaults but for those above."""

    # I/O
    out_dir: str = "out"
    eval_interval: int = 250
    log_interval: int = 10
    eval_iters: int = 50
    eval_only: bool = False
    eval_at_start: bool = True  # also evaluate before the first step (False: faster timed runs)
    always_save_checkpoint: bool = False  # False: save only when val loss improves
    keep_last: int = 0  # also keep the last K checkpoints, ckpt-<iteration>.pt (hard links)
    # 'scratch', 'resume' (out_dir/ckpt.pt), 'auto' (resume if there is one: for restarts),
    # 'convert:<ckpt or out_dir>' (MHA made GQA/MQA by n_kv_head, or MLA by kv_lora_rank:
    # uptraining), GPT-2 ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl') or 'hf:<local folder>'
    # (GPT-2, or export.py's Starcoder2/GPTBigCode): pretrained weights decide the model but for
    # PRETRAINED_KEYS
    init_from: str = "scratch"
    # a K/V group's head: its heads' 'mean', 'first' or 'random' (MLA: SVD)
    convert_method: str = "mean"
    # converting attention into a hybrid (layer_pattern with D, smallgpt/hybridize.py): which
    # layers stay attention, 'given' (as layer_pattern places them), or as many as it keeps,
    # ranked on 4 training batches by the 'loss' converting each alone costs or the 'kl' to the
    # teacher with each restored; and each converted head's decay calibrated from the teacher's
    # attention maps on those batches (False: the layer's initial decays)
    convert_layers: str = "given"
    convert_calibrate: bool = True
    # distillation from a teacher (its run folder or checkpoint; empty: the convert: source):
    # 'layers' (stage 1: only the converted layers train, on the MSE to the teacher's attention
    # output), 'logits' (stage 2: the KL to its next-token distributions, plus distill_ce times
    # the data's cross-entropy), or '' (the data's cross-entropy alone)
    distill: str = ""
    distill_ce: float = 0.0
    teacher: str = ""
    # logging: wandb honours WANDB_MODE (online, offline, disabled); log.jsonl is always written
    wandb_log: bool = False
    wandb_project: str = "smallgpt"
    wandb_run_name: str | None = None  # None: '<dataset>-<attention kind>'
    wandb_group: str | None = None
    wandb_tags: list[str] = field(default_factory=list)
    # data
    dataset: str = "pycode_char"  # a folder under data/, or a path to one
    gradient_accumulation_steps: int = 1  # in total over all DDP ranks
    batch_size: int = 12
    # AdamW and the learning-rate schedule (linear warm-up, cosine decay to min_lr)
    learning_rate: float = 1e-3
    max_iters: int = 5000
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # 0 disables clipping
    optimizer: str = "adamw"  # or 'muon': Muon for the blocks' matrices, AdamW for the rest
    muon_lr: float = 0.02  # docs/peers.md
    # a NaN/inf loss: 'stop' (seen at log steps, no extra host sync; the last good checkpoint stays)
    # or 'skip' (drop each step whose gradient is not finite: one host sync a step)
    nonfinite: str = "stop"
    # smallgpt/recall.py's tasks on the final model, logged at the last evaluation: induction,
    # position, mqar (an MQAR dataset)
    final_evals: list[str] = field(default_factory=list)
    # an MQAR dataset: stop at the first evaluation whose val accuracy on the answers reaches this
    # (Zoology's early stop, 0.99; on a mix, every pair count's), and make it the final one; None:
    # train to max_iters
    stop_at_accuracy: float | None = None
    decay_lr: bool = True
    warmup_iters: int = 100
    lr_decay_iters: int = 5000
    min_lr: float = 1e-4
    # system
    device: str = "auto"  # 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'
    dtype: str = "auto"  # 'float32', 'bfloat16', 'float16', or 'auto': bf16 where it is faster
    compile: bool = False
    # under torchrun: 'ddp' (each process holds all weights, gradients and AdamW moments) or 'fsdp'
    # (each holds its shard of them: docs/training.md "FSDP")
    parallel: str = "ddp"
    seed: int = 1337
    peak_flops: float | None = None  # the device's peak FLOP/s for MFU; None: a table or a probe

    def __post_init__(self) -> None:
        problems = self.count_problems()
        problems += task_problems("final_evals", self.final_evals)
        past = [task for task in self.final_evals if task in LONG_TASKS]
        if past and self.pos_encoding == "learned":
            problems.append(
                f"final_evals: {', '.join(past)} read past block_size, where learned positions "
                "have no embedding: train with pos_encoding='rope', or leave them out"
            )
        problems += repeat_problems("final_evals", self.final_evals)
        if self.stop_at_accuracy is not None and not 0 <= self.stop_at_accuracy <= 1:
            problems.append(f"stop_at_accuracy={self.stop_at_accuracy} must be in [0, 1]")
        try:
            source = parse_source(self.init_from)
        except ValueError as e:
            problems.append(str(e))
            source = Source("scratch")
        problems += self.choice_problems()
        problems += self.schedule_problems()
        problems += self.unread_problems()
        problems += self.unread_conversion_problems(source)
        if problems:
            raise ValueError("invalid config: " + "; ".join(problems))
        # the model's own checks, before any work (pretrained weights decide their own model)
        if source.kind in ("scratch", "auto", "convert"):
            self.model_config(vocab_size=1)

    def count_problems(self) -> list[str]:
        """Sizes and counts that must be positive, and those that must not be negative."""
        positive = (
            "eval_interval",
            "log_interval",
            "eval_iters",
            "gradient_accumulation_steps",
            "batch_size",
            "block_size",
        )
        not_negative = (
            "max_iters",
            "warmup_iters",
            "lr_decay_iters",
            "learning_rate",
            "min_lr",
            "weight_decay",
            "grad_clip",
            "keep_last",
            "seed",
        )
        problems = []
        for key in positive:
            if getattr(self, key) < 1:
                problems.append(f"{key}={getattr(self, key)} must be positive")
        for key in not_negative:
            if getattr(self, key) < 0:
                problems.append(f"{key}={getattr(self, key)} must not be negative")
        return problems

    def choice_problems(self) -> list[str]:
        """Keys that name one of a few choices, and the choices that do not go together."""
        problems = []
        if self.nonfinite not in ("stop", "skip"):
            problems.append(f"nonfinite={self.nonfinite!r} must be 'stop' or 'skip'")
        if self.convert_method not in CONVERT_METHODS:
            methods = ", ".join(CONVERT_METHODS)
            problems.append(f"convert_method={self.convert_method!r} must be one of {methods}")
        if self.convert_layers not in CONVERT_LAYERS:
            choices = ", ".join(CONVERT_LAYERS)
            problems.append(f"convert_layers={self.convert_layers!r} must be one of {choices}")
        if self.distill not in DISTILL:
            problems.append(f"distill={self.distill!r} must be 'layers', 'logits' or ''")
        if self.distill_ce < 0:
            problems.append(f"distill_ce={self.distill_ce} must not be negative")
        if self.parallel not in ("ddp", "fsdp"):
            problems.append(f"parallel={self.parallel!r} must be 'ddp' or 'fsdp'")
        if self.optimizer not in ("adamw", "muon"):
            problems.append(f"optimizer={self.optimizer!r} must be 'adamw' or 'muon'")
        elif self.optimizer == "muon" and self.parallel == "fsdp":
            problems.append(
                "optimizer='muon' does not go with parallel='fsdp' (Muon orthogonalises whole "
                "matrices, FSDP shards them): use optimizer='adamw', or parallel='ddp'"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            problems.append(f"dtype={self.dtype!r} must be one of auto, float32, bfloat16, float16")
        return problems

    def unread_problems(self) -> list[str]:
        """Training keys set away from their defaults where the run would not read them: Muon's
        rate without Muon, the decay's end and floor without a decay."""
        defaults = TrainConfig.__dataclass_fields__
        problems = []
        if self.optimizer != "muon" and self.muon_lr != defaults["muon_lr"].default:
            problems.append(
                f"muon_lr={self.muon_lr} is Muon's rate and optimizer={self.optimizer!r}: set "
                f"optimizer='muon', or leave muon_lr out"
            )
        for key in ("lr_decay_iters", "min_lr"):
            if not self.decay_lr and getattr(self, key) != defaults[key].default:
                problems.append(
                    f"{key}={getattr(self, key)} shapes the decay and decay_lr=False keeps the "
                    f"rate constant: leave {key} out, or decay_lr on"
                )
        if not self.distill:
            for key in self.changed("distill_ce", "teacher"):
                problems.append(
                    f"{key}={getattr(self, key)!r} steers a distillation and distill='' "
                    f"trains on the data alone: add --distill=logits (or layers), or leave "
                    f"{key} out"
                )
        return problems

    def unread_conversion_problems(self, source: Source) -> list[str]:
        """The conversion's keys set away from their defaults by a run that converts nothing: one
        from scratch or from pretrained weights (a resumed run carries its conversion's keys)."""
        if source.kind in ("convert", "resume", "auto"):
            return []
        return [
            f"{key}={getattr(self, key)!r} steers a conversion and init_from={self.init_from!r} "
            f"converts nothing: give --init_from=convert:<run>, or leave {key} out"
            for key in self.changed("convert_method", "convert_layers", "convert_calibrate")
        ]

    def changed(self, *keys: str) -> list[str]:
        """Those of keys set away from their defaults."""
        defaults = TrainConfig.__dataclass_fields__
        return [key for key in keys if getattr(self, key) != defaults[key].default]

    def schedule_problems(self) -> list[str]:
        """A learning-rate schedule that would rise as it decays, or end before its warm-up."""
        problems = []
        if self.decay_lr and self.min_lr > self.learning_rate:
            problems.append(
                f"min_lr={self.min_lr} is above learning_rate={self.learning_rate}: "
                f"the rate would rise as it decays"
            )
        if self.decay_lr and self.lr_decay_iters < self.warmup_iters:
            problems.append(
                f"lr_decay_iters={self.lr_decay_iters} is below warmup_iters="
                f"{self.warmup_iters}: the decay would end before the warm-up does"
            )
        return problems

    def model_config(self, vocab_size: int) -> GPTConfig:
        """The model these keys describe; vocab_size is the dataset's unless the config sets one."""
        keys = {f.name: getattr(self, f.name) for f in fields(GPTConfig)}
        return GPTConfig(**keys | {"vocab_size": self.vocab_size or vocab_size})


def parse_train(argv: list[str]) -> tuple[TrainConfig, dict | None]:
    """TrainConfig from files and flags, and the checkpoint a resume or conversion reads (or None):
    keys not given come from it (docs/reliability.md "Resume")."""
    given = given_values(TrainConfig, argv)
    default = {f.name: f.default for f in fields(TrainConfig)}
    init_from = given.get("init_from", default["init_from"])
    try:
        source = parse_source(init_from)
    except ValueError as e:
        raise UserError(str(e)) from e
    model_keys = [k for k in given if k in GPTConfig.__dataclass_fields__]
    fixed = [f"--{k}" for k in model_keys if k not in PRETRAINED_KEYS]
    if source.pretrained and fixed:  # the weights decide the model: a shape key would not train
        raise UserError(
            f"init_from={init_from} trains its weights' own model: drop "
            f"{', '.join(fixed)} (of the model keys only {', '.join(PRETRAINED_KEYS)} "
            f"apply to pretrained weights)"
        )
    ckpt, stored, where = start_from(source, given.get("out_dir", default["out_dir"]))
    from_run = {k: v for k, v in stored.items() if k in default}
    given = checked_values(TrainConfig, from_run, where) | given
    return build(TrainConfig, given), ckpt


@dataclass(slots=True)
class SampleConfig:
    init_from: str = "resume"  # 'resume' (out_dir/ckpt.pt), 'gpt2' ... 'gpt2-xl', or 'hf:<folder>'
    out_dir: str = "out"
    start: str = "\n"  # the prompt, or FILE:path, or LINES:path (one prompt per line)
    num_samples: int = 1  # samples per prompt, all decoded in one batch
    max_new_tokens: int = 500
    temperature: float = 0.8  # 0: greedy
    top_k: int | None = 200
    top_p: float | None = None
    stop: str | None = None  # end a sample at this string (kept); \n and \t are a newline and a tab
    seed: int = 1337
    device: str = "auto"
    dtype: str = "auto"  # float32, bfloat16, float16 or auto: bf16 where it decodes faster
    kv_cache: bool = True  # False recomputes the whole context every token, for comparison
    cuda_graph: bool = True  # on CUDA, replay each one-token step as a CUDA graph (docs/gpu.md)
    compile: bool = False  # on CPU, compile the one-token step (faster after a compile)
    quantize: str = ""  # 'int8': int8 weights, one scale per output feature (smallgpt/quantize.py)

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p)  # a ValueError: one line
        problems = []
        if self.num_samples < 1:
            problems.append(f"num_samples={self.num_samples} must be at least 1")
        if self.max_new_tokens < 0:
            problems.append(f"max_new_tokens={self.max_new_tokens} must not be negative")
        if self.quantize not in QUANTIZE:
            problems.append(f"quantize={self.quantize!r} must be one of {QUANTIZE}")
        try:
            kind = parse_source(self.init_from).kind
        except ValueError as e:
            problems.append(str(e))
            kind = "resume"
        if kind not in ("resume", "gpt2", "hf"):
            problems.append(
                f"init_from={self.init_from!r} must be 'resume' (out_dir/ckpt.pt), "
                f"{', '.join(GPT2_NAMES)} or 'hf:<folder from save_pretrained>'"
            )
        if self.stop == "":
            problems.append(
                "stop='' would end every sample at once: give a string, or leave stop out"
            )
        if self.stop:  # typed in a shell, --stop='\n' is a backslash and an n: the newline meant
            self.stop = re.sub(r"\\([nt\\])", lambda match: ESCAPES[match[1]], self.stop)
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            problems.append(f"dtype={self.dtype!r} must be auto, float32, bfloat16 or float16")
        if self.compile and not self.kv_cache:
            problems.append(
                "compile=True compiles the cached one-token step: not with kv_cache=False"
            )
        if self.seed < 0:
            problems.append(f"seed={self.seed} must not be negative")
        if problems:
            raise ValueError("; ".join(problems))


ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}  # what \n, \t and \\ typed in --stop stand for
# the recall accuracy at which a run counts as having solved a task (compare.py's solved_threshold):
# below an early stop's usual 0.99, so a run that stops on just reaching that is judged solved
SOLVED_THRESHOLD = 0.9


@dataclass(slots=True)
class CompareConfig:
    # 'train' (the sweep), 'report', 'all' (both), 'plan' (the runs and their time) or 'costs'
    mode: str = "all"
    # the variants by their K/V heads; empty: n_head, a middle divisor, 1
    kv_heads: list[int] = field(default_factory=list)
    # or by name (smallgpt/variant.py): mha, gqa2, mqa, mla32, mha-sssl64...
    variants: list[str] = field(default_factory=list)
    seeds: int = 1  # train every run this many times, with seeds seed, seed + 1, ...
    # learning rates (AdamW's peak, learning_rate) to train every variant at; the report takes each
    # variant at the one of lowest mean final val loss and measures it on the test split. Empty:
    # the base run's learning_rate alone. min_lr follows each in the base run's proportion
    lrs: list[float] = field(default_factory=list)
    # with optimizer='muon', Muon's rate for each of lrs (as many); empty: the base muon_lr scaled
    # as each of lrs is from the base learning_rate
    muon_lrs: list[float] = field(default_factory=list)
    # with lrs: up to this many more rates for a variant whose chosen rate is the lowest or highest
    # it trained at, each one grid step further out (smallgpt/rate_bracket.py); 0: lrs alone
    bracket: int = 0
    # 'width': every variant keeps the base n_embd and MLP (fewer K/V heads, fewer parameters);
    # 'params': the GQA/MQA variants' MLP is widened to MHA's parameter count (within 1%); both:
    # each variant twice
    match: list[str] = field(default_factory=lambda: ["width"])
    # (n_layer, n_embd), 'LxD' or a preset name
    sizes: list[tuple[int, int] | str] = field(default_factory=list)
    # also convert each seed's MHA model to each GQA/MQA/MLA variant (all global) and each hybrid
    # of global attention and Gated DeltaNet (mha-dddl, gqa2-dl: smallgpt/hybridize.py), uptrain it
    convert: bool = False
    # K/V heads: mean, first or random
    convert_methods: list[str] = field(default_factory=lambda: ["mean"])
    # of the base run's max_iters (0: none)
    uptrain_fractions: list[float] = field(default_factory=lambda: [0.1])
    # uptraining's peak learning rates (after its own warm-up), over the base run's
    uptrain_lr_scale: float = 1.0
    # uptraining's loss: '' the data's cross-entropy, 'logits' the KL to the MHA model converted
    # (train.py --distill=logits)
    uptrain_distill: str = ""
    # True: train the runs trained at another budget (max_iters, warmup_iters, lr_decay_iters,
    # decay_lr) on to this one, from their checkpoints; False: refuse to, before any training
    extend: bool = False
    kv_seq_len: int = 8192  # the KV-cache column for a sequence length and batch of your choice
    kv_batch: int = 8
    kv_dtype: str = "bfloat16"
    # decode speed where the KV cache dominates what a step reads: this batch, this many positions
    # cached (each variant's shape with random weights, float32; the median of decode_steps
    # one-token steps), measured speed_repeats times per shape, interleaved, after the runs, and
    # stored in <out_dir>/speed.json
    decode_batch: int = 8
    decode_context: int = 4096
    decode_steps: int = 16
    speed_repeats: int = 3
    # a run whose accuracy on a recall task reaches this solved it (the report's "solved k/n")
    solved_threshold: float = SOLVED_THRESHOLD
    # lm-evaluation-harness tasks (eval.py --lm_eval: hellaswag, arc_easy, lines...) scored on each
    # run once it is trained, each a column of the report (mean over seeds, seed-paired vs MHA);
    # lm_eval_limit: items per task (None: all)
    lm_eval: list[str] = field(default_factory=list)
    lm_eval_limit: int | None = None
    # filled from the command line: files and train.py flags, and those of train.py's flags that
    # steer a conversion (compare.py's CONVERSION_KEYS), for the conversion runs alone
    train_args: list[str] = field(default_factory=list)
    conversion_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        problems = []
        for key, choices in (
            ("mode", ("train", "report", "all", "plan", "costs")),
            ("kv_dtype", ("float32", "bfloat16", "float16")),
        ):
            if getattr(self, key) not in choices:
                problems.append(f"{key}={getattr(self, key)!r} must be one of {', '.join(choices)}")
        sizes = (
            "seeds",
            "kv_seq_len",
            "kv_batch",
            "decode_batch",
            "decode_context",
            "decode_steps",
            "speed_repeats",
        )
        if bad := [f"{k}={getattr(self, k)}" for k in sizes if getattr(self, k) < 1]:
            problems.append(f"{', '.join(bad)}: must be positive")
        problems += self.rate_problems()
        problems += repeat_problems("lm_eval", self.lm_eval)
        if self.lm_eval_limit is not None and self.lm_eval_limit < 1:
            problems.append(f"lm_eval_limit={self.lm_eval_limit} must be positive")
        if self.lm_eval_limit is not None and not self.lm_eval:
            problems.append(
                f"lm_eval_limit={self.lm_eval_limit} is read by lm_eval's tasks, and lm_eval=[] "
                "names none: leave lm_eval_limit out, or give --lm_eval=[<task>,...]"
            )
        if not 0 < self.solved_threshold <= 1:
            problems.append(f"solved_threshold={self.solved_threshold} must be in (0, 1]")
        if min(self.kv_heads, default=1) < 1:
            problems.append(f"kv_heads={self.kv_heads} must be positive")
        if self.kv_heads and self.variants:
            problems.append(
                f"kv_heads={self.kv_heads} and variants={self.variants}: give one of them"
            )
        problems += variant_problems(self.variants)
        if not self.match or any(m not in ("width", "params") for m in self.match):
            problems.append(f"match={self.match} must be width, params or [width,params]")
        unknown_methods = [m for m in self.convert_methods if m not in CONVERT_METHODS]
        if not self.convert_methods or unknown_methods:
            methods = ", ".join(CONVERT_METHODS)
            problems.append(
                f"convert_methods={self.convert_methods}: each must be one of {methods}"
            )
        if not self.uptrain_fractions or any(not 0 <= f <= 1 for f in self.uptrain_fractions):
            problems.append(f"uptrain_fractions={self.uptrain_fractions}: each must be in [0, 1]")
        if self.uptrain_distill not in ("", "logits"):
            problems.append(f"uptrain_distill={self.uptrain_distill!r} must be 'logits' or ''")
        if not self.uptrain_lr_scale > 0:
            problems.append(f"uptrain_lr_scale={self.uptrain_lr_scale} must be positive")
        problems += self.repeats()
        if problems:
            raise ValueError("; ".join(problems))

    def rate_problems(self) -> list[str]:
        """What is wrong with lrs, muon_lrs and bracket."""
        problems = []
        if min(self.lrs + self.muon_lrs, default=1) <= 0:
            problems.append(f"lrs={self.lrs}, muon_lrs={self.muon_lrs}: rates must be positive")
        if self.muon_lrs and len(self.muon_lrs) != len(self.lrs):
            problems.append(
                f"muon_lrs={self.muon_lrs} pairs with lrs={self.lrs}: give one Muon rate for each "
                "of lrs"
            )
        if self.bracket < 0:
            problems.append(f"bracket={self.bracket} must not be negative")
        elif self.bracket and len(set(self.lrs)) < 2:
            problems.append(
                f"bracket={self.bracket} with lrs={self.lrs}: a step past the grid's edge is the "
                "ratio of its two rates there; give two or more different lrs"
            )
        return problems

    def rates(self) -> list[tuple[float, float | None]]:
        """The sweep's learning rates: (AdamW's, Muon's where muon_lrs gives it apart) for each of
        lrs."""
        muon = self.muon_lrs if len(self.muon_lrs) == len(self.lrs) else [None] * len(self.lrs)
        return list(zip(self.lrs, muon, strict=True))

    def repeats(self) -> list[str]:
        """A problem for each list key with an item twice (the same runs again, same folders), and
        each bad size."""
        sizes = []
        problems = []

        for size in self.sizes:
            try:
                sizes.append("{}x{}".format(*size_of(size)))
            except ValueError as e:
                problems.append(str(e))
        named = {
            "kv_heads": self.kv_heads,
            "variants": self.variants,
            "match": self.match,
            "sizes": sizes,
            "uptrain_fractions": [f"{f:g}" for f in self.uptrain_fractions],  # as in folders
            "convert_methods": self.convert_methods,
            "lrs": [rate_label(*rate) for rate in self.rates()],
        }
        for key, items in named.items():
            if (again := repeated(items)) is not None:
                problems.append(
                    f"{key}={getattr(self, key)} lists {again} twice: each item names its own "
                    f"runs, so a repeat would train the same runs again; list it once"
                )
        return problems


def rate_label(lr: float, muon_lr: float | None = None) -> str:
    """A learning rate as a sweep's folders and tags name it: '0.003', '0.003/0.02' with a Muon rate
    given apart."""
    return f"{lr:g}" if muon_lr is None else f"{lr:g}/{muon_lr:g}"


def label_rates(label: str) -> tuple[float, float | None]:
    """The rates a label of rate_label names: (AdamW's, Muon's where given apart, else None)."""
    lr, *muon = (float(x) for x in label.split("/"))
    return lr, muon[0] if muon else None


def variant_problems(names: list[str]) -> list[str]:
    """What is wrong with names of --variants (Variant.parse): a name in upper case, a name of
    nothing."""
    problems = []
    bad = [name for name in names if not is_variant(name)]
    cased = [name for name in bad if is_variant(name.lower())]
    if cased:
        lower = ", ".join(name.lower() for name in cased)
        problems.append(
            f"variants: {', '.join(cased)}: variant names are lower case: {lower} "
            f"(train.py's --window_pattern=SL is -sl<window> here)"
        )
    reordered = {name: in_order(name) for name in bad if name not in cased and in_order(name)}
    for name, fixed in reordered.items():
        problems.append(f"variants: {name}: a name's parts go in the order {NAME_PARTS}: {fixed}")
    unknown = [name for name in bad if name not in cased and name not in reordered]
    if unknown:
        # the kinds of layer that do not attend, by their letters in the table
        others = [kind for kind in LAYER_KINDS.values() if not kind.attends]
        letters = " or ".join(f"{kind.letter} for {kind.name}" for kind in others)
        hybrid = f"gqa2-{3 * others[0].letter.lower()}l"
        problems.append(
            f"variants: {', '.join(unknown)} is not mha, gqa<n_kv_head>, mqa or "
            f"mla<kv_lora_rank>, each with -<window_pattern><window> for local layers "
            f"or without (e.g. mha-sssl64), -<layer_pattern> with {letters} layers "
            f"({hybrid}), then -gate or -headgate, -qknorm, -rope<percent> ({hybrid}-gate-qknorm), "
            f"-sink, and -nope or -rp<letters of R and N, a layer each> (mha-sink-rprn)"
        )
    return problems


# the parts of a variant's name after its kind, in their order (smallgpt/variant.py's grammar)
NAME_PARTS = (
    "kind, pattern, -gate or -headgate, -qknorm, -rope<percent>, -sink, -nope or -rp<letters>"
)


def in_order(name: str) -> str | None:
    """name with its parts after the kind put in the order a variant's name takes, where that makes
    one (mha-qknorm-gate -> mha-gate-qknorm); None where no order does."""
    kind, *parts = name.split("-")
    if len(parts) > 6:  # more parts than a name has: no order makes one
        return None
    for order in itertools.permutations(parts):
        candidate = "-".join((kind, *order))
        if is_variant(candidate):
            return candidate
    return None


def is_variant(name: str) -> bool:
    """Whether name is a variant's name (Variant.parse reads it)."""
    try:
        Variant.parse(name)
    except ValueError:
        return False
    return True


def repeated(items: list) -> object | None:
    """The first item listed again in items, None if they are distinct."""
    return next((item for i, item in enumerate(items) if item in items[:i]), None)


def repeat_problems(key: str, items: list) -> list[str]:
    """A line where key's list (of tasks, of distances) names an item twice: the repeat would
    measure nothing new."""
    again = repeated(items)
    if again is None:
        return []
    return [f"{key}={items} lists {again!r} twice: a repeat measures nothing new, so list it once"]


# named --sizes: (n_layer, n_embd)
SIZE_PRESETS = {"tiny": (2, 64), "mini": (4, 128), "small": (6, 256), "medium": (8, 384)}


def size_of(size: str | list[int] | tuple[int, ...]) -> tuple[int, int]:
    """(n_layer, n_embd) of one item of --sizes: 'LxD' (two positive decimal integers), a preset
    name or a pair; a ValueError saying what a size is otherwise."""
    pair = tuple(size) if not isinstance(size, str) else SIZE_PRESETS.get(size, ())
    if match := isinstance(size, str) and re.fullmatch(r"([0-9]+)x([0-9]+)", size):
        pair = int(match[1]), int(match[2])
    if len(pair) != 2 or min(pair) < 1:
        presets = ", ".join(f"{k}={L}x{D}" for k, (L, D) in SIZE_PRESETS.items())
        raise ValueError(
            f"sizes: {size!r} is neither n_layer x n_embd (two positive decimal integers, "
            f"e.g. 4x128, or a pair (4, 128)) nor a preset ({presets})"
        )
    return pair
