"""torchvision's ResNet blocks with their BatchNorms, residual adds and ReLUs fused (``--bn-kernel``).

:func:`fuse_resnet` swaps the classes of a torchvision ResNet, BasicBlock and Bottleneck, in
place, for subclasses whose ``forward`` calls :func:`imagenet.kernels.fusedbn.conv_bn_act` and
``bn_act`` on the same modules, so every module, parameter and buffer keeps its name and the
state dict stays torchvision's. In a whole ResNet every block but the last forks its output (the
next block reads it twice: its first convolution and its shortcut), and a block whose shortcut
is a convolution and a BatchNorm hands the residual add that convolution's raw output, which the
add normalises itself. ``stats_in_conv`` (``--bn-kernel cudnn``): the blocks' convolutions make
their BatchNorms' sums (not the stem's, whose 3-channel input cuDNN's fused engines refuse, nor a
grouped convolution's, which :func:`imagenet.kernels.convstats.applies` refuses: those BatchNorms
make their statistics in a pass of their own).
Layers the kernels cannot compute (evaluation, SyncBatchNorm, other layouts) take torch's modules.
"""

import torch
import torch.nn as nn
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

from ..kernels.fusedbn import bn_act, conv_bn_act, conv_with_sums


def _block_input(x) -> tuple:
    """A block's input as (for its first convolution, for its shortcut): a forked pair or one tensor."""
    return x if isinstance(x, tuple) else (x, x)


def _residual(block: nn.Module, x: torch.Tensor) -> tuple:
    """A block's residual for :func:`bn_act`: (the tensor to add, None), or where the shortcut is a
    convolution and a BatchNorm, (the convolution's raw output, (the BatchNorm, the output's sums
    or None)), which the residual add normalises itself."""
    ds = block.downsample
    if ds is None:
        return x, None
    if isinstance(ds, nn.Sequential) and len(ds) == 2 and isinstance(ds[1], nn.BatchNorm2d):
        y, sums = conv_with_sums(x, ds[0], ds[1], block.stats_in_conv)
        return y, (ds[1], sums)
    return ds(x), None


class FusedBasicBlock(BasicBlock):
    """torchvision's BasicBlock with its BatchNorms, add and ReLUs through :func:`bn_act`; with
    ``fork_output`` (set by :func:`fuse_resnet` where another block follows) its output is a forked
    pair, and its input may be one."""

    fork_output = False
    stats_in_conv = False  # set by fuse_resnet: the convolutions make their BatchNorms' sums

    def forward(self, x):
        x, shortcut = _block_input(x)
        out = conv_bn_act(x, self.conv1, self.bn1, stats_in_conv=self.stats_in_conv)
        residual, residual_bn = _residual(self, shortcut)
        return conv_bn_act(out, self.conv2, self.bn2, residual=residual, residual_bn=residual_bn,
                           fork=self.fork_output, stats_in_conv=self.stats_in_conv)


class FusedBottleneck(Bottleneck):
    """torchvision's Bottleneck with its BatchNorms, add and ReLUs through :func:`bn_act`; forked
    output and input as :class:`FusedBasicBlock`'s."""

    fork_output = False
    stats_in_conv = False  # set by fuse_resnet: the convolutions make their BatchNorms' sums

    def forward(self, x):
        x, shortcut = _block_input(x)
        stats = self.stats_in_conv
        out = conv_bn_act(x, self.conv1, self.bn1, stats_in_conv=stats)
        out = conv_bn_act(out, self.conv2, self.bn2, stats_in_conv=stats)
        residual, residual_bn = _residual(self, shortcut)
        return conv_bn_act(out, self.conv3, self.bn3, residual=residual, residual_bn=residual_bn,
                           fork=self.fork_output, stats_in_conv=stats)


class FusedResNet(ResNet):
    """torchvision's ResNet with the stem's BatchNorm and ReLU through :func:`bn_act`."""

    def _forward_impl(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(bn_act(self.conv1(x), self.bn1))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def fuse_resnet(model: nn.Module, stats_in_conv: bool = False) -> nn.Module:
    """``model`` (a torchvision ResNet) with its blocks' classes swapped for the fused ones, in
    place: every module, parameter and buffer keeps its name, so the state dict is unchanged. In a
    whole ResNet every block but the last forks its output (the next block reads it twice), so
    a layer's output (layer1-layer3, or a block's) is a pair of one tensor: (output, a view of it).
    ``stats_in_conv``: the blocks' convolutions make their BatchNorms' sums (:func:`conv_bn_act`;
    not the stem's, whose 3-channel input cuDNN's fused engines refuse)."""
    swaps = {ResNet: FusedResNet, BasicBlock: FusedBasicBlock, Bottleneck: FusedBottleneck}
    for module in model.modules():
        if type(module) in swaps:
            module.__class__ = swaps[type(module)]
            if stats_in_conv and type(module) is not FusedResNet:
                module.stats_in_conv = True
    if isinstance(model, FusedResNet):  # its blocks run one after another: layer1's first .. layer4's last
        blocks = [b for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for b in layer]
        fused = (FusedBasicBlock, FusedBottleneck)
        for block, following in zip(blocks, blocks[1:]):  # a pair only for a block that takes one
            if isinstance(block, fused):
                block.fork_output = isinstance(following, fused)
    return model


def uses_bn_kernels(model: nn.Module) -> bool:
    return any(isinstance(m, (FusedResNet, FusedBasicBlock, FusedBottleneck)) for m in model.modules())


def uses_conv_stats(model: nn.Module) -> bool:
    """Whether ``model``'s fused blocks take their BatchNorms' sums from their convolutions."""
    return any(getattr(m, "stats_in_conv", False) for m in model.modules())
