"""HTTP service over compiled BERT artifacts, shaped after text-embeddings-inference's router.

Modules: `settings` (CLI/env configuration), `app` + `routes` (HTTP layer), `schemas` (request
and response models), `errors` (the JSON error contract), `tokenization`, `inference`
(request-level embed/classify/zero-shot), and the batching path: `admission` (the bounded queue,
deadlines, arrival rate), `planning` (queued inputs into the batches of least measured cost),
`topology` (the cores the process may use and how workers share them), `lanes` (the worker
threads within those cores), `batcher` (the supervised loop that ties them together), `backends`
(TVM, PyTorch); `runtime` (loading, warm-up, readiness), `model_cache` (a --model-id compiled once
into the compile cache, then loaded from it), `metrics` (Prometheus), `logs`, `cli`,
and `ray_serve` (the same app in Ray Serve replicas).
"""
