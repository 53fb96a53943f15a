"""Train PyTorch modules with rlx_tvm: ``torch.export``, TVM's ``from_exported_program``,
``rlx_tvm.autodiff.grad`` and ``rlx_tvm.compile`` behind one call.

Needs PyTorch (the ``torch`` extra); ``import rlx_tvm`` does not import this package.

>>> step = compile_train_step(model, (x, y), loss=torch.nn.functional.cross_entropy,
...                           optimizer=AdamW(lr=1e-3))
>>> loss = step(x, y)          # forward, loss, gradients and the update, on the device
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("rlx_tvm.torch needs PyTorch: pip install 'rlx-tvm[torch]'") from err

from .optim import SGD, AdamW, Optimizer
from .step import TrainStep, compile_train_step

__all__ = ["compile_train_step", "TrainStep", "SGD", "AdamW", "Optimizer"]
