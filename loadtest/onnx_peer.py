"""ONNX Runtime as the per-call benchmark's peer, at its best: the plain export and the graph after
its transformers optimizer, in fp32 and dynamic int8 (what fastembed and Infinity ship)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from compile.checkpoint import INPUT_NAMES, BertWrapper, CheckpointInfo, example_inputs, inspect_checkpoint


def _session(path: Path, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    # spin between a run's parallel sections, stop at its end (see loadtest.bench)
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    options.add_session_config_entry("session.force_spinning_stop", "1")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def artifact_checkpoint(manifest) -> CheckpointInfo:
    """The checkpoint an artifact was compiled from, read as its compile read it (task and pooling):
    the peers' reference and the graph they are given."""
    return inspect_checkpoint(Path(manifest.model.path), manifest.task,
                              manifest.pooling if manifest.task == "embed" else "auto")


def export_onnx(model, path: Path, optimize: bool = True) -> Path:
    """The wrapper exported to ONNX with dynamic batch and sequence up to the model's positions (the graph
    every peer reads)."""
    positions = max(512, int(model.bert.config.max_position_embeddings))  # ModernBERT's 8192
    dims = {name: {0: torch.export.Dim("batch", max=1024), 1: torch.export.Dim("seq", max=positions)}
            for name in INPUT_NAMES}
    with torch.no_grad():
        torch.onnx.export(model, example_inputs(2, 8, 30522), str(path), input_names=list(INPUT_NAMES),
                          output_names=["output"], dynamic_shapes=dims, dynamo=True, optimize=optimize, verbose=False)
    return path


def onnx_sessions(wrapper, directory: Path, threads: int, config: dict, int8: bool) -> tuple[dict, dict[str, int]]:
    """ONNX Runtime at its best, fp32 (and with `int8`, dynamic int8: int8 weights per channel,
    activations quantized at run time, what fastembed and Infinity ship): the plain export, and the
    graph after ORT's transformers optimizer (fused Attention, SkipLayerNormalization, BiasGelu,
    EmbedLayerNormalization), which needs the mask laid out as transformers' legacy 4-D mask
    (`FusableMaskWrapper`) to find the attention. Each optimized graph must fuse every layer's
    attention, or the benchmark says so."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    graphs = {"onnxruntime": export_onnx(wrapper, directory / "model.onnx")}
    fusable = export_onnx(FusableMaskWrapper(wrapper), directory / "fusable.onnx", optimize=False)
    layers = int(config.get("num_hidden_layers", config.get("n_layers", 0)))
    fused_attention = {}
    heads, hidden = (int(config.get(key, 0)) for key in ("num_attention_heads", "hidden_size"))
    for label, embed_layer_norm in (("onnxruntime_optimized", True), ("onnxruntime_int8_optimized", False)):
        if label.startswith("onnxruntime_int8") and not int8:
            continue
        options = FusionOptions("bert")
        options.use_raw_attention_mask(True)  # its mask index assumes right padding; the raw mask is exact
        # quantized, the fused embedding op fails at run time (QEmbedLayerNormalization): off for int8
        options.enable_embed_layer_norm = embed_layer_norm
        optimized = optimize_model(str(fusable), model_type="bert", num_heads=heads, hidden_size=hidden,
                                   optimization_options=options)
        fused = fused_attention[label] = optimized.get_fused_operator_statistics().get("Attention", 0)
        if fused != layers:
            print(f"bench: ORT's optimizer fused {fused} of {layers} attention layers for {label}", file=sys.stderr)
        graphs[label] = directory / f"{label}.onnx"
        optimized.save_model_to_file(str(graphs[label]))
    if int8:
        graphs["onnxruntime_int8"] = graphs["onnxruntime"]
    sessions = {}
    for label, graph in graphs.items():
        if label.startswith("onnxruntime_int8"):
            quantized = graph.with_suffix(".int8.onnx")
            quantize_dynamic(str(graph), str(quantized), weight_type=QuantType.QInt8, per_channel=True)
            graph = quantized
        sessions[label] = _session(graph, threads)
    return sessions, fused_attention


class FusableMaskWrapper(BertWrapper):
    """`BertWrapper`'s function with its additive mask built as transformers' legacy 4-D mask
    (expand to [batch, 1, seq, seq], 1 - mask, masked_fill): the same values, in the node pattern
    ONNX Runtime's attention fusion looks for. Export-only; shares the wrapper's modules."""

    def __init__(self, wrapper: BertWrapper):
        torch.nn.Module.__init__(self)
        self.__dict__.update({k: v for k, v in vars(wrapper).items() if not k.startswith("_")})
        for name, module in wrapper.named_children():  # the encoder and any head, shared
            self.add_module(name, module)
        self.eval()

    @staticmethod
    def additive_mask(mask: torch.Tensor) -> torch.Tensor:
        batch, seq = mask.shape
        inverted = 1.0 - mask[:, None, None, :].expand(batch, 1, seq, seq)
        return inverted.masked_fill(inverted.to(torch.bool), torch.finfo(mask.dtype).min)
