"""Models: torchvision's ResNet family, module for module, so state dicts load both ways.

* ``registry`` -- :func:`create_model` (with our kernels swapped in where they run), starting
  weights (``--pretrained``, ``--weights``), fitting state dicts, and ``torch.compile``.
* ``fusedresnet`` -- torchvision's ResNet, BasicBlock and Bottleneck with their BatchNorms, adds
  and ReLUs through :mod:`imagenet.kernels.fusedbn` (``--bn-kernel``), swapped in place so the
  state dict stays torchvision's.
* ``stem`` -- the stem's 3-channel convolution given a zero fourth channel on GPUs in half
  precision, which cuDNN's first-layer kernels would otherwise pad on every pass.

May import: ``imagenet.base``, ``imagenet.kernels``.
"""
