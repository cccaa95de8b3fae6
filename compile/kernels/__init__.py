"""CPU kernel families: each writes its kernels (TE computes or TIR) and the schedule that makes them
fast on the host's vector units. `compile/schedule.py` dispatches every fused PrimFunc to the first
family that recognises it.

- `dense`: fp32 linears over packed weight panels, and every matmul-shaped kernel;
- `bf16`: linears over bf16 weights, a C micro-kernel on AVX512_BF16 (`--precision bf16`);
- `int8`: linears over int8 weights (`--precision int8`);
- `amx`: the bf16 and int8 linears' tiles on AMX (Sapphire Rapids and later), `attention_amx` attention's
  products on them; `tiles`: the whole-K tile call and loop nest the bf16 and AMX tiles share;
- `attention`: each layer's attention core in one kernel (written scheduled, see passes/fuse_attention.py);
- `rows`: row kernels (softmax, layer norm, the int8 row quantisation);
- `sparse`: block-sparse (BSR) linears, M-tiled;
- `fallback`: whatever else, parallel and vectorised;
- `fast_math`: vectorisable exp and erf; `common`: the host's lanes and schedule helpers;
- `c/`: the C routines the kernels call where TVM's code generator cannot express them (bf16 and AMX
  tiles, attention's bf16 and int8 products, the claim counter), one object per file (`objects`), linked
  into a library where its kernels call one of their symbols (`linking`).
"""
