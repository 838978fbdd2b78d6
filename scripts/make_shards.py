#!/usr/bin/env python
"""Convert an ImageNet-layout folder (DIR/train, DIR/val) into tar shards the trainer reads
(``python main.py OUT ...``), in the WebDataset layout other tools read too.

    python scripts/make_shards.py /data/imagenet /data/imagenet-shards              # 1 GB shards
    python scripts/make_shards.py /data/imagenet /data/imagenet-shards --shard-size 256MB --workers 16

OUT gets train-NNNNNN.tar and val-NNNNNN.tar (KEY.jpg + KEY.cls), classes.txt, the index
(index.json, written last, and train-index.npy / val-index.npy) and, if any image could not
be read, bad_files.txt: such files are not packed (the index lists them, and a run from the
shards counts them as skipped, as a run from the folder does). The training images are shuffled
once (--seed) before packing. Rerun the same command after an interruption (Ctrl-C, a full disk):
it continues. Rerun it after files of DIR changed (a bad file repaired): it writes the shards
from the first one whose files changed, and a new index, under new names beside the old ones,
so a job reading OUT meanwhile keeps reading the files it started with. The files of an older
index go once no job reads them (the previous index's are kept; --prune removes them too).
"""

import os
import sys

# Runs as `python scripts/make_shards.py` from anywhere: make the repo's package importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import logging  # noqa: E402

from imagenet.base.errors import UserError, user_error  # noqa: E402

SHOWN_BAD = 10  # bad files listed on the terminal; all of them are in OUT/bad_files.txt
INTERRUPTED = 130  # the shell's status for a process ended by Ctrl-C


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="DIR", help="image folder with train/ and val/, one sub-folder per class")
    p.add_argument("out", metavar="OUT", help="folder for the shards and their index")
    p.add_argument("--shard-size", default="1GB", help="largest shard, e.g. 1GB, 500MB, 256MiB (default 1GB)")
    p.add_argument("--seed", type=int, default=0, help="seed of the one shuffle of the training images (0)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="processes reading and checking images (default: one per CPU core; 0: none)")
    p.add_argument("--overwrite", action="store_true", help="replace a finished conversion of other images or settings in OUT")
    p.add_argument("--prune", action="store_true",
                   help="also remove the previous index's files (kept by default, for jobs that read it) once no job "
                        "reads them")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # force: a call in a process that logged before (a test) still logs to the stderr of now
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s", force=True)
    try:
        # here, not at the top: importing torch and PIL takes seconds, and a Ctrl-C then is one line too
        from imagenet.data.shards.writer import BAD_FILES, make_shards, parse_size
        if args.workers < 0:
            raise UserError(f"--workers must be 0 or more, got {args.workers}")
        report = make_shards(args.src, args.out, shard_size=parse_size(args.shard_size), seed=args.seed,
                             workers=args.workers, progress=not args.quiet, overwrite=args.overwrite,
                             prune=args.prune)
    except UserError as e:
        return user_error(e)
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to continue where it stopped", file=sys.stderr, flush=True)
        return INTERRUPTED
    _tidied(report, args.out)
    if report.finished_before:
        if report.note:
            print(f"{args.out} already holds these shards (index.json); {report.note}")
        else:
            print(f"{args.out} already holds these shards (index.json), and no file of {args.src} changed since; "
                  "nothing to do")
        return 0
    if report.changed_source:
        print(f"files of {args.src} changed since these shards were made: kept the shards before the first "
              f"changed one ({report.continued_from} images), wrote the rest and a new index under new names; jobs "
              "that read the old index keep reading its files")
    elif report.continued_from:
        print(f"continued an interrupted conversion after {report.continued_from} images")
    for split, path, reason in report.bad[:SHOWN_BAD]:
        print(f"not packed, unreadable: {split}/{path} ({reason})")
    if report.bad:
        more = f" ({len(report.bad) - SHOWN_BAD} more)" if len(report.bad) > SHOWN_BAD else ""
        print(f"{len(report.bad)} unreadable image(s) not packed{more}; listed in "
              f"{os.path.join(args.out, BAD_FILES)}")
    print(f"wrote {report.samples['train']} train / {report.samples['val']} val images in "
          f"{report.shards['train']} + {report.shards['val']} shards to {args.out}")
    return 0


def _tidied(report, out: str) -> None:
    """What happened to the files of earlier versions of the index."""
    if report.removed:
        print(f"removed the files of {len(report.removed)} earlier version(s) of the index that no job reads")
    if report.in_use:
        print(f"kept the files of {len(report.in_use)} earlier version(s) of the index that a job still reads (or "
              f"this file system cannot tell: no file locks); a later run of this command removes them")


if __name__ == "__main__":
    sys.exit(main())
