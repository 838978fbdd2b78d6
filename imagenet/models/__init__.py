"""Models: torchvision's ResNet family, module for module, so state dicts load both ways.

* ``registry`` -- :func:`create_model` (with our kernels swapped in where they run), starting
  weights (``--pretrained``, ``--weights``), fitting state dicts, a checkpoint's model
  (``model_from_checkpoint``), and ``torch.compile``.
* ``fusedresnet`` -- torchvision's ResNet, BasicBlock and Bottleneck with their BatchNorms, adds
  and ReLUs through :mod:`imagenet.kernels.fusedbn` (``--bn-kernel``), swapped in place so the
  state dict stays torchvision's.
* ``stem`` -- the stem's 3-channel convolution given a zero fourth channel on GPUs in half
  precision, which cuDNN's first-layer kernels would otherwise pad on every pass.
* ``blurpool`` -- FFCV's blur before each strided convolution (``--blurpool``), torchvision's
  state dict kept.
* ``evaluation`` -- the validation forward pass: flip averaging (``--val-flip``), a module of its
  own so ``torch.compile`` gives it graphs of its own, and batches padded to one size.

May import: ``imagenet.base``, ``imagenet.kernels``.
"""
