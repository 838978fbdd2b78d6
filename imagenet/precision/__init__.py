"""Numeric precision behind one interface, so the training loop never branches on the mode.

Modes:

* ``fp32`` -- plain float32 (TF32 on GPUs that have it unless ``--no-tf32``).
* ``fp16`` -- the classic master-weight trainer: the model runs in float16 except BatchNorm,
  which stays float32; the optimizer updates a float32 master copy of every parameter; the
  loss is multiplied by a loss scale before backward, and gradients are copied to the masters,
  unscaled and checked for inf/NaN there. A step with non-finite gradients is skipped (and a
  dynamic scale halved) so one overflow never reaches the weights.
* ``amp-fp16`` / ``amp-bf16`` -- ``torch.autocast``; float16 uses ``torch.amp.GradScaler``.

Every mode offers the same calls::

    model = precision.prepare_model(model)       # before DP/DDP wrapping and the optimizer
    groups = precision.param_groups(groups)      # the tensors the optimizer updates
    logits = precision.forward(model, images)    # float32 logits
    precision.backward(loss)
    stepped = precision.step(optimizer)           # 0-dim bool tensor on the parameters' device:
                                                  # True when the weights changed; read-only
    precision.model_state_dict(model)             # float32 weights, masters in fp16 mode
    precision.state_dict() / load_state_dict()    # the mode and its loss-scaler state

``step`` never returns a host value: a mode that decides the skip on the device (a fused
optimizer) computes the flag there, one that knows it on the host returns a constant tensor it
made once, so the caller can mask its work (the weight average) without waiting for the device.

Modules:

* ``base`` -- :class:`Precision`, float32 and the interface the other modes extend.
* ``autocast`` -- :class:`AutocastPrecision` (``amp-fp16`` / ``amp-bf16``).
* ``master`` -- :class:`MasterWeightPrecision` (``fp16``).
* ``scaler`` -- :class:`LossScaler` of the fp16 mode, and the overflow-skip log both 16-bit modes use.
* ``copies`` -- :func:`dtype_groups`, :func:`copy_by_dtype`: multi-tensor copies across dtypes.
* ``norms`` -- :func:`iter_norm_modules`: the layers every mode keeps in float32.
* ``tf32`` -- :func:`configure_tf32`.
* ``factory`` -- :func:`build_precision` (config -> mode) and :func:`describe` (the banner line).
* ``optim`` -- the SGD optimizer, fused on GPUs (it skips an overflowing step on the device).

The private torch calls these need are in :mod:`imagenet.base.torch_private`.

May import: ``imagenet.base``.
"""

from .autocast import AutocastPrecision
from .base import Precision
from .copies import copy_by_dtype, dtype_groups
from .factory import build_precision, describe
from .master import MasterWeightPrecision
from .norms import iter_norm_modules
from .scaler import LossScaler
from .tf32 import configure_tf32

__all__ = ["AutocastPrecision", "LossScaler", "MasterWeightPrecision", "Precision", "build_precision",
           "configure_tf32", "copy_by_dtype", "describe", "dtype_groups", "iter_norm_modules"]
