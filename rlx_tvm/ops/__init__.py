"""The ``relax.rlx.*`` operators.

Importing this package registers every op with TVM (idempotently) and installs the ``R.rlx``
TVMScript namespace, so modules that use the ops print and parse back.
"""

from __future__ import annotations

import types

from . import registry
from .registry import OpDef, OpError, all_ops, get_op, is_rlx_call

# One module per op family; importing it declares its ops.
from . import activation, attention, conv, indexing, loss, norm, pool, quantize, rope, scan  # noqa: E402,F401


def _install_tvmscript_namespace() -> None:
    """Make ``R.rlx.<name>(...)`` resolve to the op builders, for printing and for parsing."""
    import tvm.relax.script as relax_script
    import tvm.relax.script.parser as relax_parser

    ns = types.ModuleType("R.rlx", "rlx_tvm operators")
    for opdef in all_ops():
        setattr(ns, opdef.name, opdef)
    relax_script.rlx = ns
    relax_parser.rlx = ns


_install_tvmscript_namespace()

# The op builders, ``rlx_tvm.ops.<name>(...)``. Some ops share their family module's name
# (``attention``, ``rope``): the builder wins the attribute, the module stays importable as
# ``rlx_tvm.ops.attention`` through ``sys.modules``.
globals().update({o.name: o for o in all_ops()})

__all__ = ["OpDef", "OpError", "all_ops", "get_op", "is_rlx_call", "registry"] + [o.name for o in all_ops()]
