"""Compile stage: Hugging Face BERT -> torch.export -> TVM Relax -> validated, bucketed libraries.

Each module holds one concern (import, canonicalisation, combining, parameter lifting,
bucketing, build, validation, manifest, artifact writing); `pipeline` composes them and
`loader` is the one reader of the artifact format, shared by the service and benchmarks.
"""
