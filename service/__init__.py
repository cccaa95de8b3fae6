"""HTTP service over compiled BERT artifacts, shaped after text-embeddings-inference's router.

Modules: `settings` (CLI/env configuration), `app` + `routes` (HTTP layer), `schemas` (request
and response models), `errors` (the JSON error contract), `tokenization`, `planning` (how queued
inputs become padded batches), `batcher` (the queue and worker pool), `backends` (TVM, PyTorch),
`inference` (request-level embed/classify/zero-shot), `runtime` (loading, warm-up, readiness),
`metrics` (Prometheus), `logs` and `cli`.
"""
