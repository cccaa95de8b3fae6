"""OpenVINO as the per-call benchmark's peer, at its best, on the same ONNX export as ONNX Runtime:

- `openvino`: its default precision on this CPU (bf16 where the CPU has AVX512_BF16 or AMX, as
  `SentenceTransformer(model, backend="openvino")` runs it; `precision()` says which);
- `openvino_f32`: `INFERENCE_PRECISION_HINT=f32`;
- `openvino_int8`: NNCF post-training int8 with its transformer preset (SmoothQuant, bias
  correction), calibrated on the shipped sentences;
- `openvino_int8_sparse` (hosts with AMX-INT8): the same with its sparse-weights path, which stores and
  multiplies sparse the int8 weights at least `SPARSE_WEIGHTS_RATE` zero (a pruned checkpoint's).

Each compiled model runs with the latency hint on `threads` threads. Its idle TBB workers spin
briefly and then sleep; the benchmark's warm call before each timed one covers the rest.
`isa()` says which instruction sets its kernels ran: the peer of a build for another CPU than this
one (x86-64-v3, znver4) is OpenVINO under `loadtest.cpuid_level` that CPU, where it picks the
kernels it picks on a CPU with that CPU's features. Where `cpuid` cannot be held (no `cpuid_fault`,
as on AMD's VMs), `ONEDNN_MAX_CPU_ISA=AVX2` holds its oneDNN kernels alone (`default_hint`).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from artifact.cpu_features import host_flags
from compile.checkpoint import INPUT_NAMES

PRECISION_OF = {"bf16": "bf16", "f16": "fp16", "f32": "fp32"}
# OpenVINO's sparse path for NNCF int8 weights on AMX: a weight at least this fraction zero is stored and
# multiplied sparse (`ov.properties.intel_cpu.sparse_weights_decompression_rate`)
SPARSE_WEIGHTS, SPARSE_WEIGHTS_RATE = "CPU_SPARSE_WEIGHTS_DECOMPRESSION_RATE", 0.5
# `ONEDNN_MAX_CPU_ISA` values (oneDNN's names) whose kernels have no bf16
ISAS_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}


def default_hint() -> str | None:
    """The precision hint that gives OpenVINO's default: none, except where `ONEDNN_MAX_CPU_ISA` holds
    oneDNN to an instruction set without bf16 on a CPU that has it. OpenVINO still reads bf16 from
    `cpuid` there and its bf16 graph fails to compile (a softmax with no kernel); on a CPU of that
    instruction set its default is f32, so f32 is asked for."""
    held = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    return "f32" if held in ISAS_WITHOUT_BF16 else None


def _properties(threads: int, hint: str | None, profiled: bool = False) -> dict:
    properties = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 1}
    if hint is not None:
        properties["INFERENCE_PRECISION_HINT"] = hint
    if profiled:
        properties["PERF_COUNT"] = True
    return properties


def calibration_rows(tokenizer_file: Path, max_seq: int) -> list[dict[str, np.ndarray]]:
    """The shipped sentences, one at a time, as the model's inputs (NNCF's calibration set)."""
    from compile.passes.quantize import sentence_rows

    rows = sentence_rows(tokenizer_file, max_seq)
    samples = []
    for index in range(len(rows[0])):
        length = int(rows[1][index].sum())
        samples.append({name: x[index:index + 1, :length] for name, x in zip(INPUT_NAMES, rows)})
    return samples


class OpenVinoModel:
    """One compiled OpenVINO model: called with the wrapper's four inputs, returns the output."""

    def __init__(self, compiled):
        self.compiled = compiled
        self.request = compiled.create_infer_request()

    def precision(self) -> str:
        """What its matmuls run in, as OpenVINO chose it (fp32, bf16, fp16)."""
        hint = self.compiled.get_property("INFERENCE_PRECISION_HINT")  # an ov.Type: bf16, f16, f32
        return PRECISION_OF.get(hint.to_string(), hint.to_string())

    def isa(self) -> list[str]:
        """The instruction sets in the names of the kernels OpenVINO ran (jit_avx2, brgemm_avx512, ...), and
        "mlas" where a linear ran on MLAS, which picks its own from `cpuid`."""
        found = set()
        for node in self.compiled.get_runtime_model().get_ordered_ops():
            info = node.get_rt_info()
            name = info["primitiveType"].astype(str) if "primitiveType" in info else ""
            found.update(part for part in name.split("_") if part.startswith(("avx", "sse", "amx", "mlas")))
        return sorted(found)

    def __call__(self, feed: dict[str, np.ndarray]) -> np.ndarray:
        return self.request.infer(feed)[0].copy()

    def parts(self, source) -> dict[str, str]:
        """Which part of a BERT layer each node of the compiled graph computes ("linears", "attention"
        or "the rest"), by what it fused of `source` (the ov.Model it was compiled from): its linears
        are FullyConnected nodes, its attention the nodes that fused a Softmax (its MHA subgraphs) or
        multiply two activations (a MatMul that did not become a FullyConnected)."""
        types = {op.get_friendly_name(): op.get_type_name() for op in source.get_ops()}
        parts = {}
        for node in self.compiled.get_runtime_model().get_ordered_ops():
            info = node.get_rt_info()
            kind = info["layerType"].astype(str) if "layerType" in info else node.get_type_name()
            fused = info["originalLayersNames"].astype(str).split(",") if "originalLayersNames" in info else []
            parts[node.get_friendly_name()] = (
                "linears" if kind == "FullyConnected" else
                "attention" if kind in ("MatMul", "ScaledDotProductAttention") or "Softmax" in map(types.get, fused)
                else "the rest")
        return parts

    def node_times(self) -> list[tuple[str, str, float]]:
        """(node, the kernel it ran, seconds) for each node the last call executed; the model must
        be compiled with `PERF_COUNT` (`profiled_openvino`)."""
        return [(info.node_name, info.exec_type, info.real_time.total_seconds())
                for info in self.request.profiling_info if info.status == info.Status.EXECUTED]


def openvino_models(onnx_path: Path, threads: int, int8: bool, tokenizer_file: Path,
                    max_seq: int) -> dict[str, OpenVinoModel]:
    """OpenVINO's f32 and default precision (and, with `int8`, NNCF int8, and on an AMX host NNCF int8 with
    its sparse weights path) on `onnx_path`. Where the
    default is f32 (a CPU without AVX512_BF16 or AMX), both labels hold the one compiled model."""
    import openvino as ov

    core = ov.Core()
    model = core.read_model(str(onnx_path))
    hint = default_hint()
    default = OpenVinoModel(core.compile_model(model, "CPU", _properties(threads, hint)))
    f32 = default if default.precision() == "fp32" else OpenVinoModel(
        core.compile_model(model, "CPU", _properties(threads, "f32")))
    models = {"openvino_f32": f32, "openvino": default}
    if int8:
        import nncf

        samples = calibration_rows(tokenizer_file, max_seq)
        quantized = nncf.quantize(model, nncf.Dataset(samples), model_type=nncf.ModelType.TRANSFORMER,
                                  subset_size=len(samples))
        models["openvino_int8"] = OpenVinoModel(core.compile_model(quantized, "CPU", _properties(threads, hint)))
        if "amx_int8" in (host_flags() or set()):  # its sparse int8 weights run on AMX only
            models["openvino_int8_sparse"] = OpenVinoModel(core.compile_model(
                quantized, "CPU", {**_properties(threads, hint), SPARSE_WEIGHTS: SPARSE_WEIGHTS_RATE}))
    return models


def profiled_openvino(onnx_path: Path, threads: int, f32: bool) -> tuple[OpenVinoModel, OpenVinoModel, object]:
    """OpenVINO on `onnx_path` at its default precision (`f32`: f32) twice, plain and with its per-node
    counters (`PERF_COUNT`), and the ov.Model both were compiled from (`OpenVinoModel.parts`)."""
    import openvino as ov

    core = ov.Core()
    model = core.read_model(str(onnx_path))
    hint = "f32" if f32 else default_hint()
    plain, profiled = (OpenVinoModel(core.compile_model(model, "CPU", _properties(threads, hint, counted)))
                       for counted in (False, True))
    return plain, profiled, model
