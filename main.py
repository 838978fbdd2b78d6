"""Train ResNets on an ImageNet-layout folder: ``python main.py DIR -a resnet50 -b 256 --fp16``.

All logic lives in the ``imagenet`` package; ``python main.py --help`` lists the options.
"""

import sys

from imagenet.cli import main  # torch is imported after the command line is checked

if __name__ == "__main__":
    sys.exit(main())
