"""Compile stage: Hugging Face BERT -> torch.export -> TVM Relax -> validated, bucketed libraries.

Each module holds one concern (import, canonicalisation, combining, parameter lifting,
bucketing, build, validation, staging the artifact); `pipeline` composes them. The artifact's
format and its one reader live in the `artifact` package, shared with the service.
"""
