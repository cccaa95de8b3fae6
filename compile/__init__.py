"""Compile stage: Hugging Face BERT -> torch.export -> TVM Relax -> validated, bucketed libraries.

`plan` decides what a compile builds; `pipeline` declares and runs the phases (`phases/`):
`importer` (torch.export and Relax import), `passes/` (Relax rewrites, one sequence per strategy:
canonicalisation, combining, quantisation, packing, lifting), `build` (bucket
specialisation and the fusing pipeline, with `schedule` dispatching every kernel to its family in
`kernels/`), `validate` and `timing`, then `staging` writes the artifact. The artifact's format and
its one reader live in the `artifact` package, shared with the service.
"""
