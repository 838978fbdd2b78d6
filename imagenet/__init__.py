"""ImageNet reference trainer: ResNets on ImageFolder data in fp32, fp16 or autocast, on CPU, GPU, DataParallel or DDP."""

__version__ = "0.1.0"
