"""Relax-to-Relax rewrites of the imported model, one per module, in the order compile/pipeline.py
runs them: `canonicalize` and the matmul-combining `strategy` (`combine`, `combine_batched`),
`sparsity`, `precision` (CUDA dtypes), `quantize` or `bf16` (the CPU's linear precision),
`packing`, then `lift` (weight-only work done once, at compile time); per bucket, `specialize`
rewrites our kernels for its static shapes. `linears` finds the linear layers the weight passes
rewrite, and rewrites them.
"""
