"""The ResNet stem's convolution fed four input channels instead of three, on CUDA in half precision.

cuDNN's kernels for a first layer (the 7x7/2 convolution of 3-channel images) read four channels.
Given three, cuDNN pads the image itself on every pass, into a zeroed buffer in a slow kernel, in
the forward and again for the weight's gradient (docs/BENCHMARKS.md). Here the image and the
weight get a zero fourth channel before the call: with torch.compile the image's padding is one
pass of Inductor's, kept for the backward; the weight's is a tiny one. The zero channel against
zero weights adds exact zeros: the arithmetic is cuDNN's own padded convolution's, though cuDNN
may pick another algorithm for it, whose float sums round differently (the weight's gradient, the
first three channels of the padded one, by about one step of the dtype at its largest values).
The parameter keeps its shape and name.
It applies where the model itself is in half precision (``--fp16``) and under a CUDA autocast to
float16 or bfloat16 (``--amp``): there the image and the weight are cast to autocast's dtype
before the padding, which autocast would have cast them to at the convolution anyway, so with
torch.compile the image's cast and padding are one pass.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

# float16's padding by cuDNN measured 0.29 ms a ResNet-50 step at -b 256 on an H200; bfloat16's stem
# convolution runs as fast padded as not there (docs/BENCHMARKS.md), and is padded alike
_DTYPES = (torch.float16, torch.bfloat16)


class PaddedStemConv(nn.Conv2d):
    """``nn.Conv2d`` with three input channels whose channels_last CUDA half-precision inputs are
    padded to four channels (see the module docstring); anything else runs the plain convolution."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = takes(x, self)
        if dtype is None:
            return super().forward(x)
        x = F.pad(x.to(dtype), (0, 0, 0, 0, 0, 1)).contiguous(memory_format=torch.channels_last)
        weight = F.pad(self.weight.to(dtype), (0, 0, 0, 0, 0, 1)).contiguous(memory_format=torch.channels_last)
        return self._conv_forward(x, weight, self.bias)


def takes(x: torch.Tensor, conv: nn.Conv2d) -> Optional[torch.dtype]:
    """The dtype in which ``conv(x)`` (a :class:`PaddedStemConv`, whose geometry :func:`pad_stem`
    checked) runs padded to four input channels: the image's and the weight's half-precision
    dtype, or autocast's inside a CUDA autocast region; None where it runs as torch's own."""
    if not (x.is_cuda and x.dim() == 4 and x.shape[1] == 3 and x.is_contiguous(memory_format=torch.channels_last)):
        return None
    if x.dtype in _DTYPES and conv.weight.dtype == x.dtype:
        return x.dtype
    autocast = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
    return autocast if autocast in _DTYPES else None  # autocast casts both at the convolution anyway


def pad_stem(model: nn.Module) -> nn.Module:
    """``model.conv1`` (a torchvision ResNet's 3-channel stem convolution) made a
    :class:`PaddedStemConv` in place: the same module, parameters and state dict."""
    conv = getattr(model, "conv1", None)
    if type(conv) is nn.Conv2d and conv.in_channels == 3 and conv.groups == 1 and conv.padding_mode == "zeros":
        conv.__class__ = PaddedStemConv
    return model
