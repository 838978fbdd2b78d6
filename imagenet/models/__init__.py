"""Models: torchvision's ResNet family, module for module, so state dicts load both ways.

* ``registry`` -- :func:`create_model` (with our kernels swapped in where they run), starting
  weights (``--pretrained``, ``--weights``), fitting state dicts, and ``torch.compile``.

May import: ``imagenet.base``, ``imagenet.kernels``.
"""
