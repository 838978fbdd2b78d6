"""GPU kernels of our own, written in Triton, each registered as a ``torch.library`` op (so
``torch.compile`` keeps it and CUDA graphs capture it) and each with a torch fallback.

* ``fusedbn`` -- BatchNorm + residual add + ReLU, forward and backward (``--bn-kernel``): the
  ``torch.library`` ops and their autograd rules, and ``bn_act``/``conv_bn_act``, which the fused
  ResNet blocks (``imagenet.models.fusedresnet``) call. Its kernels are ``bntriton`` (the Triton
  source) and ``bnlaunch`` (their launch settings and geometry, one host function a phase);
  ``fusedbn`` > ``bnlaunch`` > ``bntriton``, none importing upwards.
* ``convstats`` -- a convolution that also makes its output's per-channel sums, through a cuDNN
  fusion graph (``--bn-kernel cudnn``; the nvidia-cudnn-frontend package, where it installs).
* ``maxpool`` -- the stem's 3x3/2 max-pool on channels_last tensors (``--maxpool-kernel``).
* ``compiles`` -- whether the Triton kernels can run here (``available``), asked by the others.
* ``masterstep`` -- ``--fp16``'s optimizer step (inf/NaN check, unscale, SGD on the fp32 masters,
  the fp16 weights written) in two kernels over all parameters (``--optimizer-impl triton``); not
  an op, as it runs outside the compiled model, and torch's four passes are its fallback.
* ``gpugeometry`` -- crop, antialiased resize and flip of a whole batch of images in one launch
  (the GPU decode path and the GPU resize of CPU-decoded crops).

May import: ``imagenet.base``.
"""
