"""Every registered rlx op on its declared samples (``rlx_tvm.testing.samples``): the fused and the
decomposed path, float32 and float64, static and symbolic batch, against the op's NumPy reference,
and fp64 central finite differences of each sample's independent forward. Every op's samples are
compiled together, one module per (dtype, shape mode, path)."""

import pytest

from rlx_tvm.ops import all_ops
from rlx_tvm.testing import compare, finite_difference_mismatch
from rlx_tvm.testing.samples import VARIANTS, all_samples, outputs, samples

OPS = sorted(o.name for o in all_ops())
FD_OPS = sorted({c.op for c in all_samples() if c.forward is not None})


def test_every_op_has_samples():
    covered = {c.op for c in all_samples()}
    missing = [name for name in OPS if name not in covered]
    assert not missing, f"ops without samples: {missing}"
    no_symbolic = [name for name in OPS if not any(c.batch is not None for c in samples(name))]
    assert not no_symbolic, f"ops without a symbolic-shape sample: {no_symbolic}"


@pytest.mark.parametrize("dtype,shape_mode,path", [pytest.param(*v, id="-".join(v)) for v in VARIANTS])
@pytest.mark.parametrize("op", OPS)
def test_matches_reference(op, dtype, shape_mode, path):
    symbolic = shape_mode == "symbolic"
    cases = [c for c in samples(op) if c.batch is not None or not symbolic]
    assert cases, f"{op} has no {shape_mode} samples"
    outs = outputs(dtype, symbolic, path)
    failures = [f"{c.name}: {problem}" for c in cases if (problem := compare(outs[c.name], c.reference(dtype), dtype))]
    assert not failures, f"{len(failures)} of {len(cases)} samples differ ({dtype}, {shape_mode}, {path}):\n" + "\n".join(failures)


@pytest.mark.parametrize("op", FD_OPS)
def test_finite_differences(op):
    """The op's fused float64 output equals the central finite-difference VJP of the sample's
    independent NumPy forward (not the op's reference)."""
    cases = [c for c in samples(op) if c.forward is not None]
    outs = outputs("float64", False, "fused")
    failures = [f"{c.name}: {problem}" for c in cases if (problem := finite_difference_mismatch(c, outs[c.name]))]
    assert not failures, f"{len(failures)} of {len(cases)} samples differ from finite differences:\n" + "\n".join(failures)
