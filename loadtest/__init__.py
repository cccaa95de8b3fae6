"""Benchmarks and load tests: compiled TVM libraries against PyTorch eager and ONNX Runtime."""
