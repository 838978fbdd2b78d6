"""Numeric precision behind one interface, so the training loop never branches on the mode.

Modes: ``fp32`` (TF32 on GPUs that have it unless ``--no-tf32``); ``fp16``, the classic
master-weight trainer (an fp16 model with BatchNorm in fp32, fp32 master weights, a loss scale;
a step with non-finite gradients is skipped and a dynamic scale halved); ``amp-fp16`` /
``amp-bf16``, ``torch.autocast`` (float16 with ``torch.amp.GradScaler``).

Every mode offers ``prepare_model``, ``param_groups``, ``forward``, ``backward(loss)``,
``step(optimizer)``, ``model_state_dict`` and ``state_dict``/``load_state_dict``. ``step``
returns a 0-dim bool tensor on the parameters' device (True when the weights changed), never a
host value, so the caller can mask later work without waiting for the device.

Modules: ``base`` (float32 and the interface), ``autocast``, ``master`` (fp16), ``scaler`` (the
loss scaler, the overflow-skip log), ``copies`` (multi-tensor copies across dtypes), ``norms``
(the layers kept in float32), ``tf32``, ``factory`` (config -> mode, the banner line), ``optim``
(SGD, fused on GPUs), ``lars`` (``--optimizer lars``: SGD with each layer's step scaled by its
trust ratio, MLPerf's rule). Private torch calls live in :mod:`imagenet.base.torch_private`.

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
