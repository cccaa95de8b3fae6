"""compile/passes/canonicalize.py: bias-first adds made matmul-first, embedding gathers clipped."""

from tvm import relax

from compile.passes.canonicalize import canonicalize, matmul_first_add
from tests.support.relax_modules import BiasFirstQKV, calls_of


def test_matmul_first_add_swaps_only_bias_first_adds():
    mod = matmul_first_add(BiasFirstQKV)
    for call in calls_of(mod, "relax.add"):
        assert isinstance(call.args[1], relax.Var) and call.args[1].name.startswith("b")


def test_canonicalisation_clips_embedding_gathers(minilm_imported):
    modes = lambda mod: sorted(c.attrs.mode for c in calls_of(mod, "relax.take"))  # noqa: E731
    assert modes(minilm_imported.mod) == ["fast"] * 3  # word, token-type and position embeddings
    assert modes(canonicalize()(minilm_imported.mod)) == ["clip"] * 3
