"""The compiled one-token decoding step on CPU (generation.stream's compile_step=True):
decode_static exported (torch.export) and compiled ahead of time by AOTInductor, holding no
weights of its own. The model lends it its tensors at each stream; the layer products run
inductor's CPU GEMM template, which reads each weight in a blocked layout, so those weights are
lent as blocked copies made from the model's own (docs/performance-cpu.md "Decoding")."""

import atexit
import gc
import hashlib
import io
import json
import re
import warnings
import weakref
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch._inductor import cpp_builder
from torch._inductor.exc import InvalidCxxCompiler
from torch._inductor.runtime.cache_dir_utils import cache_dir
from torch.nn import functional as F

from kv_cache import KVCache
from smallgpt.atomic import atomic_open
from smallgpt.errors import UserError
from smallgpt.fast_paths import SPLIT_COPY_BYTES, Linear, prepare_splits
from smallgpt.quantize import Int8Linear
from smallgpt.static_step import decode_static

# Products of weights up to this size run inductor's CPU GEMM template inside the compiled step,
# faster than MKL's for these small products; larger ones (GPT-2's lm_head) keep Linear's split
# product, which streams them faster (docs/performance-cpu.md "Decoding").
TEMPLATE_MAX_BYTES = SPLIT_COPY_BYTES
# The template is picked per product shape by timing it against ATen's product (inductor's
# autotuning). The package first holds the weights it was compiled with in a side folder: that is
# where the blocked layouts are read from. The timings of each choice stay out of the user's
# terminal.
TEMPLATE_CONFIGS = {
    "max_autotune_gemm": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
    "aot_inductor.package_constants_on_disk_format": "pickle_weights",
    "autotune_num_choices_displayed": 0,
    "max_autotune_report_choices_stats": False,
}


class SplitStep(nn.Module):
    """decode_static of idx at the last of positions (arange(length)), attending over all of them
    in the cache's tensors (KVCache.tensors(): a local layer attends over its ring). With
    template, every fast_paths.Linear of a weight up to TEMPLATE_MAX_BYTES multiplies unsplit
    (the GEMM template takes it), as does every quantize.Int8Linear (faster than torch's int8
    kernel); the others use the split weights that Linear made for this thread count
    (prepare_splits first), buffers here, so that export sees them as weights of the step, as the
    model's parameters."""

    def __init__(self, model: nn.Module, template: bool) -> None:
        super().__init__()
        self.model = model
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        self.unsplit = [m for m in linears if template and m.weight.nbytes <= TEMPLATE_MAX_BYTES]
        self.int8 = [
            m
            for m in model.modules()
            if template and isinstance(m, Int8Linear) and m.weight.nbytes <= TEMPLATE_MAX_BYTES
        ]
        self.template = bool(
            self.unsplit or self.int8
        )  # compiled with the template among its choices
        self.linears = [
            m for m in linears if m.split is not None and all(m is not u for u in self.unsplit)
        ]
        for i, m in enumerate(self.linears):
            rest = m.split.rest or (None, None)
            for name, t in zip("wbrs", (m.split.weight, m.split.bias, *rest)):
                if t is not None:  # (export miscounts buffers that are None)
                    self.register_buffer(f"split{i}_{name}", t, persistent=False)

    def forward(
        self, idx: torch.Tensor, positions: torch.Tensor, *cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits (B, 1, vocab) and each row's greedy token (B,); cache: KVCache.tensors()."""
        made = [(m, m.split) for m in self.linears + self.unsplit]
        try:
            for m in self.unsplit:
                m.split = None
            for i, m in enumerate(self.linears):
                w, b, rw, rb = (getattr(self, f"split{i}_{name}", None) for name in "wbrs")
                m.split = m.split._replace(weight=w, bias=b, rest=None if rw is None else (rw, rb))
            kv_cache = KVCache.of_tensors(list(cache), self.model.config.cache_shape(0))
            logits = decode_static(self.model, idx, positions[-1:], kv_cache, positions.size(0))
            greedy = logits[:, -1].argmax(dim=-1)  # inside the graph: faster than ATen's argmax
            return logits, greedy
        finally:
            for m, split in made:
                m.split = split

    def weights(self) -> dict[str, torch.Tensor]:
        """Every tensor the step reads besides its inputs, by name (a tied weight under each of
        its names)."""
        return dict(self.named_parameters(remove_duplicate=False)) | dict(
            self.named_buffers(remove_duplicate=False)
        )


def blocked(weight: torch.Tensor, block: int, vnni: int = 1) -> torch.Tensor:
    """A Linear's weight (out, in) as inductor's CPU GEMM template reads a constant one: (out /
    block rounded up, in, block), output features padded with zeros to a multiple of block; with
    vnni > 1 (bf16 products on AMX or AVX512-BF16), each run of vnni input features stored
    together for every output feature of a block."""
    n, k = weight.shape
    parts = -(-n // block)
    w = F.pad(weight, (0, 0, 0, parts * block - n)).view(parts, block, k).transpose(1, 2)
    return (
        w.reshape(parts, k // vnni, vnni, block)
        .transpose(2, 3)
        .reshape(parts, k, block)
        .contiguous()
    )


def probe(weight: torch.Tensor, i: int) -> torch.Tensor:
    """A stand-in for the i-th weight while compiling: integers in [0, 128) in a scrambled order
    (exact in bf16 and int8, so that any other layout of them differs), the first one -1 - i %
    128, the order shifted by i // 128 (so that probes of the same shape and first element
    differ)."""
    p = ((torch.arange(weight.numel()) * 7919 + i // 128) % 128).to(weight.dtype).view(weight.shape)
    p.view(-1)[0] = -1 - i % 128
    return nn.Parameter(p, requires_grad=False) if isinstance(weight, nn.Parameter) else p


def blocked_sources(
    package: bytes, probes: list[tuple[str, torch.Tensor]]
) -> dict[str, list] | None:
    """{constant: [name of the weight, block, vnni]} for every constant that inductor made at
    compile time (the package's weights besides the probes and the step's other tensors): the
    probe that it is blocked(probe, block, vnni) of, among those with its first element; None if
    one is anything else."""
    sources = {}
    with zipfile.ZipFile(io.BytesIO(package)) as z:
        config = [n for n in z.namelist() if n.endswith("/weights_config.json")]
        if len(config) != 1:
            return None
        folder = config[0].split("/aotinductor/")[0] + "/weights/"
        for name, (file, shape, *_) in json.loads(z.read(config[0])).items():
            if not name.startswith("constant"):  # the step's own tensors: lent as they are
                continue
            t = torch.load(io.BytesIO(z.read(folder + file)), weights_only=True)
            if t.dim() != 3:
                return None
            candidates = [
                (source, p)
                for source, p in probes
                if p.dtype == t.dtype and p.size(1) == shape[1] and p.view(-1)[0] == t.view(-1)[0]
            ]
            found = next(
                (
                    [source, shape[2], n]
                    for source, p in candidates
                    for n in (1, 2, 4)
                    if shape[1] % n == 0 and torch.equal(t, blocked(p, shape[2], n))
                ),
                None,
            )
            if found is None:
                return None
            sources[name] = found
    return sources


def without_weights(package: bytes) -> bytes:
    """The package with its side folder of weights left out: it then reads only what it is lent."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(package)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            if "/data/weights/" not in info.filename and not info.filename.endswith(
                "/weights_config.json"
            ):
                dst.writestr(info, src.read(info))
    return out.getvalue()


def package_key(what: str) -> str:
    """The cache name of a compiled step: a hash of its program and settings, without the
    program's source comments ('# File: /path/model.py:291 in forward, ...'), so that a checkout
    elsewhere finds the packages compiled here."""
    return hashlib.sha256(re.sub(r"^\s*# File: .*$", "", what, flags=re.M).encode()).hexdigest()[
        :40
    ]


def compile_step(
    step: SplitStep, idx: torch.Tensor, cache: KVCache, block_size: int
) -> tuple[Any, dict] | None:
    """step exported for inputs shaped as idx and as the cache's tensors (MLA's v: no width),
    with any number of filled positions and of cache positions in [2, block_size] (the first at
    most the second; a local layer's ring as the cache's), compiled by AOTInductor with its
    weights left out, loaded; and blocked_sources' map of the blocked weights it reads. The
    package and the map are kept in inductor's cache folder under a hash of the exported program,
    for later processes. None where the template made a constant that is not a blocked weight
    (then compile the step without it)."""
    program = export_step(step, idx, cache, block_size)
    configs = {"aot_inductor.package_constants_in_so": False}
    if step.template:
        configs |= TEMPLATE_CONFIGS
    what = (
        f"{torch.__version__} {torch.backends.cpu.get_cpu_capability()} "
        f"{torch.get_num_threads()} threads {configs}\n{program}"
    )
    path = Path(cache_dir()) / "smallgpt" / f"step-{package_key(what)}.pt2"
    found = load_cached(path)
    if found is not None:
        return found
    compiled = compile_package(program, configs, step.template)
    if compiled is None:
        return None
    package, sources = compiled
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path.with_suffix(".json"), "w") as f:
        f.write(json.dumps(sources))
    with atomic_open(path) as f:
        f.write(package)
    return torch._inductor.aoti_load_package(io.BytesIO(package)), sources


def export_step(
    step: SplitStep, idx: torch.Tensor, cache: KVCache, block_size: int
) -> torch.export.ExportedProgram:
    """step exported with two dynamic sizes: the filled positions and the cache's positions."""
    top = max(block_size, 3)
    length = torch.export.Dim("length", min=2, max=top)
    slots = torch.export.Dim("cache", min=2, max=top)
    # on a small cache of its own, 2 of its 3 positions filled: sizes that tell the two apart
    example = (idx, torch.arange(2, device=idx.device), *cache.example(3))
    dims = tuple({3: slots} if grows else None for grows in cache.growing())  # the *cache inputs
    shapes = (None, {0: length}, dims)
    return torch.export.export(step, example, dynamic_shapes=shapes, strict=False)


def load_cached(path: Path) -> tuple[Any, dict] | None:
    """The package and map compiled before at path, loaded; None where there is none whole."""
    # torch warns on a cut-short one
    if not (zipfile.is_zipfile(path) and path.with_suffix(".json").exists()):
        return None
    try:
        sources = json.loads(path.with_suffix(".json").read_text())
        return torch._inductor.aoti_load_package(str(path)), sources
    except (RuntimeError, ValueError):  # unreadable: compiled again
        return None


def compile_package(
    program: torch.export.ExportedProgram, configs: dict, template: bool
) -> tuple[bytes, dict] | None:
    """The AOTInductor package of program without its weights, and the map of the blocked weights
    it reads (blocked_sources); None where the template made a constant that is no such weight."""
    try:
        cpp_builder.get_cpp_compiler()
    except InvalidCxxCompiler as e:
        raise UserError(
            "compiling the decode step (compile=True) needs a C++ compiler: install g++ (or set "
            "CXX), or decode without compile"
        ) from e
    # compiled on stand-ins of the matrices the template may block (any, as a split's odd rows can
    # be one), each telling which it is in its blocked layout
    probes = [
        (tensors, name, t)
        for tensors in (program.state_dict, program.constants)
        for name, t in tensors.items()
        if t.dim() == 2 and (t.is_floating_point() or t.dtype == torch.int8)
    ]
    probes = [(tensors, name, probe(t, i)) for i, (tensors, name, t) in enumerate(probes)]
    for tensors, name, p in probes:
        tensors[name] = p
    package = io.BytesIO()
    # torch's own warnings, nothing the user can act on: pickling the program's tree specs,
    # autotuning, packing weights that are views
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)`", FutureWarning)
        warnings.filterwarnings("ignore", "TypedStorage is deprecated", UserWarning)
        warnings.filterwarnings("ignore", "No complete tensor found", UserWarning)
        torch._inductor.aoti_compile_and_package(
            program, package_path=package, inductor_configs=configs
        )
    if not template:
        return package.getvalue(), {}
    sources = blocked_sources(package.getvalue(), [(name, p) for _, name, p in probes])
    if sources is None:
        return None
    return without_weights(package.getvalue()), sources


def lend(
    weights: dict[str, torch.Tensor], sources: dict[str, list], before: dict[str, tuple]
) -> dict[str, tuple]:
    """What a compiled step reads, by name, as (tensor, what it was made from): the step's
    weights, and for each blocked constant the blocked copy of its weight, reused from `before`
    while that weight is the same tensor unchanged (weights made under inference_mode have no
    version to tell that by)."""
    lent = {name: (t, None) for name, t in weights.items()}
    for name, (source, *layout) in sources.items():
        w = weights[source]
        made = (w.data_ptr(), None if w.is_inference() else w._version, *layout)
        lent[name] = (
            before[name]
            if name in before and before[name][1] == made
            else (blocked(w, *layout), made)
        )
    return lent


# Each model's compiled steps by what else their code depends on (CompiledStep.__call__): the
# package, its blocked constants' sources, and the tensors last lent
STEPS: "weakref.WeakKeyDictionary[nn.Module, dict[tuple, tuple[Any, dict, dict]]]" = (
    weakref.WeakKeyDictionary()
)


@atexit.register
def release_steps() -> None:
    """Every loaded step let go, at exit: AOTInductor's loader unpacks its package into a folder
    of its own (/tmp/aotinductor_*) and removes it only when the loader is destroyed, which the
    interpreter's clean-up at exit does not always do (the test suite's shared models kept theirs:
    about 14 folders a run)."""
    if STEPS:
        STEPS.clear()
        gc.collect()


class CompiledStep:
    """decode_static exported (torch.export) and compiled ahead of time by AOTInductor for the
    one-token steps on CPU: the step's ~300 small ops become a few fused C++ loops around the
    products (inductor's GEMM template for the layers', fast_paths.Linear's split for the larger
    lm_head), run from C++ with no Python or dynamo guards in between. Attention reads the filled
    cache positions only; their count and the cache's length are the dynamic sizes, so one
    compiled step serves every length and cache of a model at one batch size and thread count. It
    holds no weights: each CompiledStep lends it the model's tensors (no copies) and blocked
    copies of the layer weights (made again when a weight changes), so it reads them as they are
    at each stream (docs/performance-cpu.md "Decoding")."""

    def __init__(self, model: nn.Module, kv_cache: object) -> None:
        self.model, self.cache = model, kv_cache
        device = kv_cache.device
        self.positions = torch.arange(kv_cache.max_len, device=device)
        self.idx = torch.zeros(kv_cache.batch_size, 1, dtype=torch.long, device=device)
        prepare_splits(model)
        self.step = SplitStep(model, template=True)
        self.run: Callable | None = None

    def __call__(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, 1, vocab) of idx (B, 1) at the cache's position, which advances by one, as
        in GPT.forward, and each row's greedy token (B,) where the compiled step computed it
        (None after an eager step)."""
        length = self.cache.pos + 1
        # the one length export cannot leave dynamic (it specializes sizes 0 and 1): eager
        if length < 2:
            return self.model(idx, kv_cache=self.cache)[0], None
        if self.run is None:
            self.run = self.load()
        inputs = [self.idx.copy_(idx), self.positions[:length], *self.cache.tensors()]
        logits, greedy = self.run(inputs)
        self.cache.pos += 1
        return logits, greedy

    def load(self) -> Callable:
        """The compiled step for this model, batch size and thread count (compiled on first use),
        lent its tensors."""
        steps = STEPS.setdefault(self.model, {})
        found = None
        # the step's code depends on these besides the model: compiled once for each
        while found is None:
            weights = self.step.weights()
            key = (
                tuple(self.idx.shape),
                self.cache.dtype,
                self.cache.fixed_shapes(),
                torch.get_num_threads(),
                tuple((name, t.shape, t.stride(), t.dtype) for name, t in weights.items()),
                tuple(
                    name
                    for name, m in self.model.named_modules()
                    if any(m is u for u in self.step.unsplit + self.step.int8)
                ),
            )
            found = (
                steps[key][:2]
                if key in steps
                else compile_step(self.step, self.idx, self.cache, self.model.config.block_size)
            )
            # the template made a constant that is not a blocked weight: the step without it
            if found is None:
                self.step = SplitStep(self.model, template=False)
        package, sources = found
        lent = lend(weights, sources, steps[key][2] if key in steps else {})
        package.load_constants(
            {name: lent[name][0] for name in package.get_constant_fqns()},
            check_full_update=True,
            user_managed=True,
        )
        steps[key] = (
            package,
            sources,
            lent,
        )  # the step points into these tensors: kept while it may run
        return package.loader.boxed_run
