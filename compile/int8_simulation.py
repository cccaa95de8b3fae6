"""The int8 libraries' arithmetic simulated in PyTorch, on the model itself: what the int8 plan
(int8_plan.py) measures its choices with, before anything is built.

The simulation runs the PyTorch fp32 model with the chosen linears replaced by the int8 kernels'
arithmetic (weights symmetric per output channel, activations asymmetric per token, integer
products: compile/passes/quantize.py), the linears kept out of int8 in their precision (bf16
rounds), and attention's products where they run in int8 or bf16 (attention_products.py) as those
kernels compute them (`fake_quantized_attention`, `fake_bf16_attention`). A sentence's loss of
cosine in the built library is within ~15% of its simulated one (`SIMULATION_TOLERANCE`). One
forward pass over the shipped sentences (in batches of like length: `length_batches`) takes ~0.2 s on
MiniLM and ~1.4 s on a 12 x 768 BERT on 2 cores, where building and running a library takes a minute;
a pass starts after the encoder layers it shares with an earlier one (`LayerCache`).

Linears that read the same input (Q, K and V) form one unit: they share a smoothing vector (one
concatenated projection needs one) and a precision.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .kernels import attention_bf16, attention_int8, int8, row_quantize
from .kernels.attention import REAL_KEY_BIAS
from .passes.smooth import module_key, smoothing_scales, value_projection
from .workers import map_beside_a_child

# How much more of its least cosine a built library may lose than its simulation, as a fraction of the
# simulated loss. The integer products are simulated exactly, but the library's fp32 around them (layer
# norm, GELU, softmax) rounds otherwise than PyTorch's, which moves some activations across a quantization
# step, and bf16 (units kept in bf16, attention's bf16 or AMX products) rounds a little otherwise too:
# MiniLM's sentences lost 0.95-1.16x their simulated loss in its x86-64-v3 library (fp32 kept), 0.86-1.15x
# in its Zen 4 library (bf16 kept and products); their least cosines 1.00x and 1.06x (loadtest.plan_fidelity).
SIMULATION_TOLERANCE = 0.1
EXACT_FP32_INTEGER = 2**24  # fp32 holds every integer below this exactly
ACTIVATION_SHIFT = 128  # u8 activation codes less this fit int8, an operand of PyTorch's int8 matmul
# A forward pass's fixed cost (Python, hooks, operator launches) in padded tokens' time: MiniLM's
# passes on 2 cores took ~0.2 ms a token and ~5 ms besides
FORWARD_COST_TOKENS = 25
LAYER_CACHE_BYTES = 256 * 2**20  # encoder layers' outputs kept from the plan's passes for later ones
# PyTorch threads of the simulation's passes. Their operators are small (a length batch of sentences
# at a time) and the compile builds libraries beside them (compile/workers.py): a second thread waits
# for the first at each operator's end, spinning on a core a build could use, or descheduled by one,
# and MiniLM's passes took several times the CPU and wall time on two threads that they took on one,
# with the same answers.
SIMULATION_THREADS = 1


@dataclass
class Unit:
    """Linears that read one input: named by their module paths (`module_key` spelling)."""

    name: str
    modules: list[torch.nn.Linear]
    keys: list[str]
    activation_max: np.ndarray | None = None

    def weight_max(self) -> np.ndarray:
        return torch.cat([m.weight.detach().abs() for m in self.modules]).amax(0).numpy()

    def multiply_adds(self) -> int:
        """Per token: what int8 speeds up."""
        return sum(m.weight.numel() for m in self.modules)


def weight_scales(weight: torch.Tensor, int16_pairs: bool) -> torch.Tensor:
    """[N, 1]: compile/passes/quantize.py's `weight_scales` in PyTorch, for a kernel that sums pairs
    of products in int16 (`int8.Int8Kernel.int16_pairs`) or not."""
    if int16_pairs:  # a pair's largest sum of like-signed parts: |a + b| for like signs, else max(|a|, |b|)
        pairs = weight.reshape(weight.shape[0], -1, 2)
        first, second = pairs[..., 0], pairs[..., 1]
        largest = torch.maximum((first + second).abs(), torch.maximum(first.abs(), second.abs())).amax(-1, keepdim=True)
    else:
        largest = weight.abs().amax(1, keepdim=True)
    return largest.clamp(min=1e-30) / int8.WEIGHT_CODES


@dataclass(frozen=True)
class WeightCodes:
    """A linear's weight as the compile quantizes it: int8 codes [N, K], their steps [N, 1], and each
    output channel's sum of codes [N] (int32: what `integer_matmul` adds back for its shifted operand)."""

    codes: torch.Tensor
    steps: torch.Tensor
    sums: torch.Tensor


def weight_codes(module: torch.nn.Linear, scale: torch.Tensor | None, int16_pairs: bool) -> WeightCodes:
    """`module`'s weight smoothed by `scale` (None: not smoothed), quantized as the compile does (`weight_scales`)."""
    weight = module.weight if scale is None else module.weight * scale
    step = weight_scales(weight, int16_pairs)
    codes = torch.round(weight / step).to(torch.int8)
    return WeightCodes(codes, step, codes.sum(1, dtype=torch.int32))


def fake_quantized_linear(module: torch.nn.Linear, x: torch.Tensor, scale: torch.Tensor | None,
                          int16_pairs: bool = False, arrives_smoothed: bool = False,
                          codes: WeightCodes | None = None) -> torch.Tensor:
    """The int8 kernels' arithmetic in PyTorch (compile/kernels/int8.py): optional smoothing (x / scale,
    unless x `arrives_smoothed`: divided upstream), per-token asymmetric u8 activations,
    per-output-channel weights (`weight_codes`, or `codes` where computed before), exact integer
    sums (`integer_matmul`: no rounding of large ones)."""
    if scale is not None and not arrives_smoothed:
        x = x / scale
    low, high = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True).clamp(min=0)
    x_scale = (high - low).clamp(min=1e-30) / row_quantize.ACTIVATION_CODES
    inverse = 1.0 / x_scale
    zero = torch.round(-low * inverse)
    xq = (torch.round(x * inverse) + zero).clamp(0, row_quantize.ACTIVATION_CODES)
    weight = codes if codes is not None else weight_codes(module, scale, int16_pairs)
    y = integer_matmul(xq, zero, weight).mul_(x_scale).mul_(weight.steps.T)
    return y.add_(module.bias) if module.bias is not None else y


def _additive_bias(attention_mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor) -> tuple:
    """(the additive float bias of the scores, the real keys `[b, 1, keys, 1]` as 1 and padding as 0) of
    the mask transformers hands an attention function (None, additive float or boolean)."""
    if attention_mask is None:
        attention_mask = torch.zeros(query.shape[0], 1, 1, key.shape[-2])
    elif attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros(attention_mask.shape).masked_fill(~attention_mask, torch.finfo(torch.float32).min)
    return attention_mask, (attention_mask[..., :1, :] > REAL_KEY_BIAS).to(key.dtype).transpose(-1, -2)


def kernel_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x), x <= 0, as the bf16 and int8 attention kernels compute their softmax's (`bert_exp` in
    kernels/attention_bf16.py: 2^n times a cubic in the remainder, 1e-4 from exp): each fused
    multiply-add rounded once, as the kernel's are, by taking it in float64."""
    log2e, ln2, p3, p2, p1, p0 = (float(np.float32(c)) for c in (  # the C source's float constants
        attention_bf16.EXP_LOG2E, attention_bf16.EXP_LN2, *attention_bf16.EXP_POLYNOMIAL))
    x = x.clamp(min=attention_bf16.EXP_FLOOR).double()
    n = torch.round(x * log2e)
    r = (x - n * ln2).float().double()
    p = (p3 * r + p2).float().double()
    p = (p * r + p1).float().double()
    p = (p * r + p0).float()
    return p * torch.exp2(n.float())


def fake_quantized_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                             **_kwargs) -> tuple[torch.Tensor, None]:
    """The int8 attention products' arithmetic (compile/kernels/attention_int8.py) as a transformers
    attention function: scaled queries symmetric per query, keys per key and values per head dim
    with `weight_scales`' pair bound (padding keys left out, as the kernel stages only real ones),
    probabilities exp(s - max) (`kernel_exp`) onto 0..255, the context divided by their sum. Its
    integer products sum to under 2^24 (a head's dims of 127 x 127, 512 keys of 255 x 127), so fp32
    holds them exactly."""
    scaling = query.size(-1) ** -0.5 if scaling is None else scaling
    attention_mask, real = _additive_bias(attention_mask, query, key)
    key, value = key * real, value * real
    queries = query * scaling
    query_step = queries.abs().amax(-1, keepdim=True) / int8.WEIGHT_CODES
    query_step = torch.where(query_step > 0, query_step, 1.0)
    key_step = weight_scales(key.reshape(-1, key.shape[-1]), True).reshape(*key.shape[:-1], 1)
    scores = torch.round(queries / query_step) @ torch.round(key / key_step).transpose(-1, -2)
    scores = scores * query_step * key_step.transpose(-1, -2) + attention_mask
    codes = torch.round(kernel_exp(scores - scores.amax(-1, keepdim=True)) * attention_int8.PROBABILITY_CODES)
    by_dim = torch.nn.functional.pad(value.transpose(-1, -2), (0, value.shape[-2] % 2))  # whole key pairs
    value_step = weight_scales(by_dim.reshape(-1, by_dim.shape[-1]), True).reshape(*by_dim.shape[:-1], 1)
    values = torch.round(by_dim / value_step)[..., :value.shape[-2]].transpose(-1, -2)
    context = (codes @ values) * value_step.transpose(-1, -2) / codes.sum(-1, keepdim=True)
    return context.transpose(1, 2).contiguous(), None


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()  # nearest even, as `vcvtneps2bf16`


def fake_bf16_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                        **_kwargs) -> tuple[torch.Tensor, None]:
    """The bf16 attention products' arithmetic (compile/kernels/attention_bf16.py; AMX's tiles round the
    same operands) as a transformers attention function: scaled queries, keys, values and the
    probabilities exp(s - max) (`kernel_exp`, padding keys left out) rounded to bf16, products summed
    in fp32, the context divided by the sum of the unrounded probabilities."""
    scaling = query.size(-1) ** -0.5 if scaling is None else scaling
    attention_mask, real = _additive_bias(attention_mask, query, key)
    scores = _bf16(query * scaling) @ _bf16(key).transpose(-1, -2) + attention_mask
    probabilities = kernel_exp(scores - scores.amax(-1, keepdim=True)) * real.transpose(-1, -2)
    context = (_bf16(probabilities) @ _bf16(value)) / probabilities.sum(-1, keepdim=True)
    return context.transpose(1, 2).contiguous(), None


@contextmanager
def simulation_threads():
    """PyTorch on `SIMULATION_THREADS` inside the block, as many as before after it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(SIMULATION_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass
class CalibrationPass:
    """One forward pass of the fp32 model over `rows` (`calibration_pass`)."""

    rows: tuple[np.ndarray, ...]
    maxima: dict[str, np.ndarray]  # each Linear's largest |input| per channel, by `module_key`
    outputs: np.ndarray  # the model's: every candidate library's fp32 reference on these rows


def calibration_pass(wrapper: torch.nn.Module, rows: tuple[np.ndarray, ...]) -> CalibrationPass:
    """The int8 smoothing's calibration: each Linear's largest |input| per channel over `rows`' real
    tokens (padding rows are not an input the model is asked about), taken in one batch of the rows as
    given, on one thread. The maxima set the smoothing the library is built with, and batches of other
    shapes round them otherwise in the last bit (MiniLM in length batches: 366 of 5,760 scales an ulp
    apart, and the x86-64-v3 library at 0.999 lost 5e-5 of least cosine that no pass showed). That
    batch is large (the rows padded to the longest: 13 s of a 12 x 768 BERT's), so the compile takes
    it in a child while it exports the model (int8_plan.start_calibration)."""
    tensors = tuple(torch.from_numpy(x) for x in rows)
    keys = {module: module_key(name) for name, module in wrapper.named_modules() if isinstance(module, torch.nn.Linear)}
    mask = tensors[1].bool()
    maxima: dict[str, torch.Tensor] = {}

    def record(module, inputs, output):
        x = inputs[0].detach()
        real = x[mask] if x.dim() == 3 and x.shape[:2] == mask.shape else x.reshape(-1, x.shape[-1])
        found, key = real.abs().amax(0), keys[module]
        maxima[key] = torch.maximum(maxima[key], found) if key in maxima else found

    handles = [module.register_forward_hook(record) for module in keys]
    try:
        with torch.no_grad(), simulation_threads():
            outputs = wrapper(*tensors).float().numpy()
    finally:
        for handle in handles:
            handle.remove()
    return CalibrationPass(rows, {key: found.numpy() for key, found in maxima.items()}, outputs)


def _register_attention(name: str, function: Callable) -> None:
    """`function` as the attention transformers runs where a model's config names `name`, with the
    additive float mask its eager attention gets."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(name, function)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS["eager"])


# The attention function simulating each arithmetic of the products (attention_products.py) but fp32's
SIMULATED_PRODUCTS = {"int8": "bert-int8-products", "bf16": "bert-bf16-products", "amx": "bert-bf16-products"}
_register_attention(SIMULATED_PRODUCTS["int8"], fake_quantized_attention)
_register_attention(SIMULATED_PRODUCTS["bf16"], fake_bf16_attention)


@contextmanager
def simulated_attention(model: torch.nn.Module, products: str):
    """`model`'s attention run as the simulation of `products` (a key of SIMULATED_PRODUCTS) inside the block."""
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values()
    before = [config._attn_implementation for config in configs]
    for config in configs:
        config._attn_implementation = SIMULATED_PRODUCTS[products]
    try:
        yield
    finally:
        for config, implementation in zip(configs, before):
            config._attn_implementation = implementation


def bf16_weights(module: torch.nn.Linear, row_scale: torch.Tensor | None = None) -> tuple:
    """(`module`'s weight rounded to bf16, its bias) as the bf16 kernels read them (compile/kernels/bf16.py):
    the weight's rows and the bias first scaled by `row_scale` where given (a folded smoothing:
    passes/smooth.py), before the rounding, as the compile scales them."""
    weight, bias = module.weight, module.bias
    if row_scale is not None:
        weight, bias = weight * row_scale[:, None], None if bias is None else bias * row_scale
    return _bf16(weight), bias


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The bf16 kernels' arithmetic on `bf16_weights`: the input rounded to bf16 (nearest even),
    products summed in fp32."""
    return torch.nn.functional.linear(_bf16(x), weight, bias)


def integer_matmul(codes: torch.Tensor, zero: torch.Tensor, weight: WeightCodes) -> torch.Tensor:
    """(codes - zero) @ weight.codes.T of u8 activation codes [..., K] (integer-valued fp32) with their
    zero points [..., 1]: the exact integer sums, each rounded once to fp32, as the int8 kernel converts
    its int32 sums. PyTorch's int8 matmul where it is exact on this CPU (`int8_matmul_is_exact`; ~6x an
    fp32 matmul on Zen 4), on the codes shifted to int8, the shift's share added back in int32 (which
    holds 255 x 127 x K for K < 66,000, as the kernel's sums do); else `float_integer_matmul`."""
    if not int8_matmul_is_exact():
        return float_integer_matmul(codes - zero, weight.codes.float(),
                                    row_quantize.ACTIVATION_CODES * int8.WEIGHT_CODES)
    shape = codes.shape
    shifted = (codes - ACTIVATION_SHIFT).to(torch.int8).reshape(-1, shape[-1])
    sums = torch._int_mm(shifted, weight.codes.T).reshape(*shape[:-1], -1)
    return sums.add_((ACTIVATION_SHIFT - zero).to(torch.int32) * weight.sums).float()


@functools.cache
def int8_matmul_is_exact() -> bool:
    """Whether `torch._int_mm` gives the exact int32 sums here at the codes' extremes (a CPU path
    that sums pairs of products in int16 could saturate them), probed once per process."""
    extremes = torch.tensor([127, -128, 127, 127, -128, -128, 0, 1], dtype=torch.int8).repeat(96)
    a = torch.stack([extremes.roll(i) for i in range(32)])
    b = torch.stack([(extremes.roll(3 * i).clamp(min=-int8.WEIGHT_CODES)) for i in range(16)])
    try:
        return torch.equal(torch._int_mm(a, b.T).long(), a.long() @ b.long().T)
    except (AttributeError, RuntimeError):
        return False


def float_integer_matmul(a: torch.Tensor, b: torch.Tensor, largest_product: int) -> torch.Tensor:
    """a @ b.T of integer-valued fp32 tensors whose products are at most `largest_product`: the
    exact sums, each rounded once to fp32. Spans of the inner axis short enough that every partial
    sum stays under 2^24 are summed in fp32, which is exact there in any order (at twice fp64's
    speed); longer axes add their spans' sums in fp64."""
    span = max(1, (EXACT_FP32_INTEGER - 1) // largest_product)
    if a.shape[-1] <= span:
        return a @ b.T
    return sum((a[..., i:i + span] @ b[:, i:i + span].T).double() for i in range(0, a.shape[-1], span)).float()


def length_batches(rows: tuple[np.ndarray, ...]) -> tuple[list[tuple[torch.Tensor, ...]], np.ndarray]:
    """(the rows, `rows[1]` their attention mask, sorted by length and split into batches each cut to
    its longest, the order that puts the batches' outputs back in the rows' order). A row's outputs
    do not depend on its padding (the library computes none), and padding is 72% of the shipped
    sentences' padded tokens; the split minimises the tokens computed plus `FORWARD_COST_TOKENS` a
    batch."""
    lengths = rows[1].sum(1)
    order = np.argsort(lengths, kind="stable")
    longest = lengths[order]
    cost, start = [0], [0]  # the least cost of the first i sorted rows, and where its last batch starts
    for i in range(1, len(order) + 1):
        first = min(range(i), key=lambda j: cost[j] + (i - j) * int(longest[i - 1]))
        cost.append(cost[first] + (i - first) * int(longest[i - 1]) + FORWARD_COST_TOKENS)
        start.append(first)
    batches, end = [], len(order)
    while end:
        chosen = order[start[end]:end]
        batches.insert(0, tuple(torch.from_numpy(np.ascontiguousarray(x[chosen, :int(longest[end - 1])]))
                                for x in rows))
        end = start[end]
    return batches, np.argsort(order)


def encoder_layers(wrapper: torch.nn.Module, linears: list[torch.nn.Module],
                   run: Callable[[], object]) -> list[torch.nn.Module]:
    """The model's encoder layers in order: the ModuleList whose children hold most of `linears`,
    where a forward pass (`run`) calls each once, in order, each on the output of the one before (so
    that a pass may start from a layer's stored output); else none."""
    best: list[torch.nn.Module] = []
    for candidate in wrapper.modules():
        if isinstance(candidate, torch.nn.ModuleList):
            holding = [layer for layer in candidate if any(m in linears for m in layer.modules())]
            if len(holding) > len(best):
                best = list(candidate)
    calls = []

    def record(module, args, kwargs, output):
        calls.append((module, _first_tensor((*args, *kwargs.values())), _first_tensor((output,))))

    handles = [layer.register_forward_hook(record, with_kwargs=True) for layer in best]
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    chained = [module for module, _, _ in calls] == best and all(
        later[1] is not None and later[1] is earlier[2] for earlier, later in zip(calls, calls[1:]))
    return best if chained else []


def _first_tensor(values) -> torch.Tensor | None:
    """The first tensor of `values`, looking into tuples (a layer's output may be one)."""
    for value in values:
        if isinstance(value, tuple):
            value = _first_tensor(value)
        if isinstance(value, torch.Tensor):
            return value
    return None


class LayerCache:
    """Encoder layers' outputs of earlier passes (per length batch), keyed by what decides them: the
    smoothing and which units up to the layer, or outside every layer, are kept. The plan's passes
    change one unit at a time from a configuration it ran before, so a pass starts after the layers
    it shares with one: half the encoder on average. Least recently used first out, `LAYER_CACHE_BYTES`
    in all."""

    def __init__(self, wrapper: torch.nn.Module, units: list[Unit], run: Callable[[], object]):
        self.layers = encoder_layers(wrapper, [m for unit in units for m in unit.modules], run)
        self.depth = {}  # unit name -> the index of its layer; absent: outside every layer
        for unit in units:
            for index, layer in enumerate(self.layers):
                if any(m is unit.modules[0] for m in layer.modules()):
                    self.depth[unit.name] = index
        self.entries: OrderedDict[tuple, list] = OrderedDict()
        self.bytes = 0

    def keys(self, alpha: float, kept: set[str]) -> list[tuple]:
        """Per layer, what its output depends on."""
        return [(index, alpha, frozenset(name for name in kept if self.depth.get(name, -1) <= index))
                for index in range(len(self.layers))]

    @contextmanager
    def reusing(self, keys: list[tuple]):
        """Inside: the leading layers whose outputs for `keys` are cached answer from the cache, in
        batch order; the others compute theirs, which are stored once the pass completes."""
        reused = 0
        while reused < len(keys) and keys[reused] in self.entries:
            self.entries.move_to_end(keys[reused])
            reused += 1
        computed: dict[tuple, list] = {key: [] for key in keys[reused:]}
        handles = [layer.register_forward_hook(lambda module, inputs, output, key=key: computed[key].append(output))
                   for layer, key in zip(self.layers[reused:], keys[reused:])]
        for layer, key in zip(self.layers[:reused], keys[:reused]):
            outputs = iter(self.entries[key])
            layer.forward = lambda *args, outputs=outputs, **kwargs: next(outputs)
        try:
            yield
            for key, outputs in computed.items():
                self._store(key, outputs)
        finally:
            for handle in handles:
                handle.remove()
            for layer in self.layers[:reused]:
                del layer.forward

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0

    def _store(self, key: tuple, outputs: list) -> None:
        self.entries[key] = outputs
        self.bytes += _nbytes(outputs)
        while self.bytes > LAYER_CACHE_BYTES and len(self.entries) > 1:
            self.bytes -= _nbytes(self.entries.popitem(last=False)[1])


def _nbytes(outputs: list) -> int:
    """The bytes of a layer's outputs (tensors, or tuples holding them)."""
    leaves = (leaf for output in outputs for leaf in (output if isinstance(output, tuple) else (output,)))
    return sum(leaf.nbytes for leaf in leaves if isinstance(leaf, torch.Tensor))


class Simulation:
    """The fp32 model with chosen units int8-simulated, and the units kept out of int8 in
    `fallback_precision` (fp32 or bf16), run on the rows a precision is measured on (`accuracy_rows`); with attention's
    products in `attention_products` (fp32, or simulated: SIMULATED_PRODUCTS)."""

    def __init__(self, wrapper: torch.nn.Module, rows: tuple[np.ndarray, ...], quantized_keys: set[str],
                 agreement: Callable[[np.ndarray, np.ndarray], dict], int16_pairs: bool = False,
                 fallback_precision: str = "fp32", attention_products: str = "fp32"):
        self.wrapper = wrapper
        self.int16_pairs = int16_pairs
        self.fallback_precision = fallback_precision
        self.attention_products = attention_products
        self.agreement = agreement
        self.rows = tuple(torch.from_numpy(x) for x in rows)
        self.batches, self.restore = length_batches(rows)
        names = {module: name for name, module in wrapper.named_modules()}
        self.linears = {module_key(name): module for module, name in names.items()
                        if isinstance(module, torch.nn.Linear) and module_key(name) in quantized_keys}
        self.units = self._units(names)
        self.layer_cache = LayerCache(wrapper, self.units, self._probe)
        self.state: dict[torch.nn.Module, torch.Tensor | None] = {}  # quantized module -> its smoothing or None
        self.rounded: set[torch.nn.Module] = set()  # modules kept out of int8 that run in bf16
        # output projection -> the V projection its smoothing is folded into (passes/smooth.py), which
        # the library's bf16 products and bf16 V weights then round scaled
        values = {key: self.linears.get(value_projection(key)) for key in self.linears}
        self.values = {self.linears[key]: value for key, value in values.items()
                       if value is not None and value.bias is not None}
        self.folded: dict[torch.nn.Module, torch.Tensor] = {}  # V projection -> 1 / s of its output channels
        self.codes: dict[torch.nn.Module, WeightCodes] = {}  # at smoothing `codes_alpha`
        self.bf16_weights: dict[tuple, tuple] = {}  # `bf16_weights` of a module (folded or not) at `codes_alpha`
        self.codes_alpha: float | None = None
        self.reference = self.run(reference=True)

    @contextmanager
    def _hooks(self, hook):
        handles = [m.register_forward_hook(hook) for m in self.linears.values()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _probe(self) -> None:
        """A pass over one sentence, for what its hooks see of the model's structure."""
        with simulation_threads():
            self.wrapper(*(x[:1] for x in self.batches[0]))

    def _units(self, names: dict) -> list[Unit]:
        """Group the linears by the input tensor they read in one forward pass (Q, K, V share one)."""
        readers: dict[int, list[torch.nn.Linear]] = {}
        alive = []  # the inputs seen, kept so that no id is reused within the pass

        def record(module, inputs, output):
            alive.append(inputs[0])
            readers.setdefault(id(inputs[0]), []).append(module)

        with torch.no_grad(), self._hooks(record):
            self._probe()
        units = []
        for modules in readers.values():
            keys = [module_key(names[m]) for m in modules]
            units.append(Unit(unit_name([names[m] for m in modules]), modules, keys))
        return units

    def use_products(self, products: str) -> None:
        """Later passes simulate attention's products in `products`; the layers' outputs cached from
        passes with other products are dropped (the calibration and fp32 reference stay: neither
        depends on them)."""
        if products != self.attention_products:
            self.attention_products = products
            self.layer_cache.clear()

    def release_layers(self) -> None:
        """Drop the cached encoder layers' outputs (up to LAYER_CACHE_BYTES): a plan once made is
        rarely simulated again (a re-plan computes them anew), and the compile's builds need the memory."""
        self.layer_cache.clear()

    def calibrate(self, taken: CalibrationPass | None = None) -> None:
        """Each unit's largest |activation| per input channel over the rows (`calibration_pass`, or
        `taken` already: the compile takes it while it exports the model)."""
        maxima = (taken or calibration_pass(self.wrapper, tuple(x.numpy() for x in self.rows))).maxima
        self.codes, self.bf16_weights, self.codes_alpha = {}, {}, None  # they follow from the maxima
        self.layer_cache.clear()
        for unit in self.units:
            unit.activation_max = maxima[unit.keys[0]]

    def _as_built(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """`module`'s output as the int8 library computes it."""
        inverse = self.folded.get(module)
        if module in self.rounded:
            key = (module, inverse is not None)  # a folded smoothing is alpha's, like the codes
            if key not in self.bf16_weights:
                self.bf16_weights[key] = bf16_weights(module, inverse)
            return bf16_linear(x, *self.bf16_weights[key])
        if module in self.state:
            if module not in self.codes:
                self.codes[module] = weight_codes(module, self.state[module], self.int16_pairs)
            output = fake_quantized_linear(module, x, self.state[module], self.int16_pairs,
                                           self.values.get(module) in self.folded, self.codes[module])
        else:
            output = torch.nn.functional.linear(x, module.weight, module.bias)
        return output if inverse is None else output * inverse

    @contextmanager
    def _built_linears(self):
        """The linears the library computes otherwise than in fp32 run as it does inside the block (in
        place of their fp32 forward, which a forward hook would run first: a third of a pass)."""
        modules = set(self.state) | self.rounded | set(self.folded)
        for module in modules:
            module.forward = functools.partial(self._as_built, module)
        try:
            yield
        finally:
            for module in modules:
                del module.forward

    def run(self, reference: bool = False) -> np.ndarray:
        """The model's outputs on the rows: the fp32 `reference`, or as the int8 library computes them."""
        simulated = self.attention_products in SIMULATED_PRODUCTS and not reference
        with torch.no_grad(), simulation_threads(), self._built_linears(), (
                simulated_attention(self.wrapper, self.attention_products) if simulated else nullcontext()):
            return torch.cat([self.wrapper(*batch).float() for batch in self.batches]).numpy()[self.restore]

    def accuracy(self, alpha: float, kept: set[str]) -> dict:
        """`agreement` to the fp32 model with every unit not in `kept` quantized at smoothing `alpha`,
        those in `kept` in `fallback_precision`."""
        self.state, self.rounded = {}, set()
        if alpha != self.codes_alpha:  # the weights' codes are reused while alpha stays (the plan's passes)
            self.codes, self.bf16_weights, self.codes_alpha = {}, {}, alpha
        for unit in self.units:
            if unit.name in kept:
                if self.fallback_precision == "bf16":
                    self.rounded.update(unit.modules)
                continue
            scale = torch.from_numpy(self.scales(unit, alpha)) if alpha > 0 else None
            for module in unit.modules:
                self.state[module] = scale
        self.folded = {self.values[module]: (1.0 / scale).float() for module, scale in self.state.items()
                       if scale is not None and module in self.values}
        with self.layer_cache.reusing(self.layer_cache.keys(alpha, kept)):
            actual = self.run()
        self.state, self.rounded, self.folded = {}, set(), {}
        return self.agreement(actual, self.reference)

    def accuracies(self, runs: list[tuple[float, set[str]]],
                   progress: Callable[[int], None] = lambda done: None) -> list[dict]:
        """`accuracy(alpha, kept)` of each of `runs`, every other one in a child forked now, on the core the
        plan's one PyTorch thread leaves idle (`workers.map_beside_a_child`). Each on one thread: a forked
        child has none of the OpenMP pool a parallel operator would wait for."""
        def one_thread(run: tuple[float, set[str]]) -> dict:
            with simulation_threads():
                return self.accuracy(*run)

        return map_beside_a_child(one_thread, runs, progress)

    @staticmethod
    def scales(unit: Unit, alpha: float) -> np.ndarray:
        return smoothing_scales(unit.activation_max, unit.weight_max(), alpha)


def unit_name(module_names: list[str]) -> str:
    """`encoder.layer.0.attention.self.{query,key,value}` for several linears, else the one's name."""
    if len(module_names) == 1:
        return module_names[0]
    heads = {name.rsplit(".", 1)[0] for name in module_names}
    if len(heads) != 1:
        return "+".join(module_names)
    return f"{heads.pop()}.{{{','.join(name.rsplit('.', 1)[1] for name in module_names)}}}"
