"""Train ResNets on an ImageNet-layout folder: ``python main.py DIR -a resnet50 -b 256 --fp16``.

All logic lives in the ``imagenet`` package; ``python main.py --help`` lists the options.
"""

import sys

from imagenet.runner import main

if __name__ == "__main__":
    sys.exit(main())
