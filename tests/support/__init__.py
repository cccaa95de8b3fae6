"""Code the tests share: tiny checkpoints and compiled artifacts (`checkpoints`, `artifacts`), TVM
functions built and run on numpy arrays (`tvm_run`), kernel operands (`kernels`), service answers
(`service`), and the CPU capabilities tests require (`capabilities`). Imported as `tests.support.*`;
tests/conftest.py holds only fixtures and hooks."""
