"""compile/kernels/objects.py: the C micro-kernels' object files live as long as the process's compiles."""

from __future__ import annotations


def test_a_c_micro_kernel_object_lives_until_the_process_exits():
    """The object file the libraries link stays for the process's compiles, and its scratch
    directory goes when the process does (a compile leaves nothing behind in the temp dir)."""
    import subprocess
    import sys
    from pathlib import Path

    script = ("from compile.kernels.objects import c_object\n"
              "obj = c_object('probe', 'int probe(void) { return 1; }', ())\nassert obj.is_file()\nprint(obj)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    obj = Path(result.stdout.strip())
    assert obj.name.startswith("probe-") and obj.suffix == ".o" and not obj.parent.exists()
