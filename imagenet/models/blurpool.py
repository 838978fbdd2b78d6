"""BlurPool (``--blurpool``): each strided convolution of the network sees its input low-pass
filtered first, so that subsampling aliases less (Zhang, "Making Convolutional Networks
Shift-Invariant Again", 2019). FFCV's ResNet recipes use it: a 3x3 binomial blur, per channel,
stride 1 and zero padding 1, before every convolution of stride > 1 with at least 16 input
channels (in torchvision's ResNets the first block of layer2, layer3 and layer4: its strided
convolution and its downsample's 1x1; the 3-channel stem is left alone).

:func:`add_blur` swaps those convolutions' class for :class:`BlurConv2d` in place: every
parameter keeps its name and shape, and the filter is a non-persistent buffer, so the state dict
is torchvision's own and loads both ways. A plain torchvision model loaded with such weights has
no blur, though, and scores lower: :func:`imagenet.models.registry.model_from_checkpoint` builds
the model a checkpoint's config names. The buffer follows the module's device, dtype (``--fp16``
converts it with the convolution's weight) and memory layout; it never changes, so DDP's buffer
broadcast, the weight average's lerp and the ranks' mean of the buffers leave it as it is.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

MIN_CHANNELS = 16  # FFCV's threshold: a strided convolution with fewer input channels keeps its input


class BlurConv2d(nn.Conv2d):
    """``nn.Conv2d`` whose input is blurred first: each channel by the 3x3 binomial filter
    ``[1 2 1]^T [1 2 1] / 16``, stride 1, zero padding 1 (a depthwise convolution). Only
    :func:`add_blur` makes one (it adds the ``blur_filter`` buffer)."""

    def blur(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.blur_filter, padding=1, groups=self.in_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.blur(x))


def binomial_filter(channels: int) -> torch.Tensor:
    """The blur's depthwise weight, [channels, 1, 3, 3]."""
    row = torch.tensor([1.0, 2.0, 1.0])
    return (torch.outer(row, row) / 16).expand(channels, 1, 3, 3).contiguous()


def takes_blur(conv: nn.Module) -> bool:
    """Whether FFCV's rule blurs ``conv``'s input: a plain convolution of stride > 1 with at least
    :data:`MIN_CHANNELS` input channels."""
    return type(conv) is nn.Conv2d and max(conv.stride) > 1 and conv.in_channels >= MIN_CHANNELS


def add_blur(model: nn.Module) -> list:
    """Make every convolution of ``model`` that :func:`takes_blur` a :class:`BlurConv2d`, in place
    (before the model moves to its device and dtype); returns their names."""
    names = []
    for name, module in model.named_modules():
        if takes_blur(module):
            module.__class__ = BlurConv2d
            module.register_buffer("blur_filter", binomial_filter(module.in_channels).to(module.weight.dtype),
                                   persistent=False)
            names.append(name)
    return names


def uses_blur(model: nn.Module) -> bool:
    return any(isinstance(m, BlurConv2d) for m in model.modules())
