"""The test suite. Its files follow the code: tests of compile/X.py in tests/compile/test_X.py, of
compile/kernels/X.py in tests/compile/kernels/test_X.py, of compile/passes/X.py in
tests/compile/passes/test_X.py; end-to-end, artifact/, service/ and loadtest/ tests in tests/. Code they
share is in tests/support/; tests/conftest.py holds the fixtures and hooks."""
