"""--decode-share (imagenet.data.gpu.share): the decode thread's load steers the share of the
training JPEGs the workers decode; each worker decodes that fraction of its JPEGs, evenly; the
share crosses into the worker processes, and a change reaches workers already running."""

import os
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from imagenet.base.config import Config, parse_config, validate
from imagenet.base.errors import UserError
from imagenet.data.decode import TrainDecoder
from imagenet.data.gpu import share as sharing
from imagenet.data.gpu.decode import CpuDecoded, JpegBatch, JpegJob, TrainJpegReader, decode_images
from imagenet.data.gpu.share import Credit, DecodeShare
from tests.helpers import photo


def windows(share: DecodeShare, busy: float, n: int) -> None:
    """``n`` windows of batches in which the decode thread was busy ``busy`` of its time."""
    for _ in range(n * sharing.WINDOW):
        share.observe(busy, 1.0 - busy)


def test_the_share_rises_while_the_decode_thread_is_busy_and_falls_when_it_waits():
    share = DecodeShare()
    assert share.auto and share.value == 0.0
    windows(share, 0.99, 1)
    assert share.value == pytest.approx(sharing.STEP)
    for _ in range(sharing.WINDOW - 1):  # a window not yet over moves nothing
        share.observe(1.0, 0.0)
    assert share.value == pytest.approx(sharing.STEP)
    share.observe(1.0, 0.0)  # the window's last batch
    assert share.value == pytest.approx(2 * sharing.STEP)
    windows(share, 1.0, 1000)
    assert share.value == pytest.approx(sharing.MOST)  # never past the most
    windows(share, 0.9, 5)  # between the two bounds: it holds
    assert share.value == pytest.approx(sharing.MOST)
    windows(share, 0.5, 2)  # waiting (for workers or room): it falls
    assert share.value == pytest.approx(sharing.MOST - 2 * sharing.STEP)
    windows(share, 0.0, 1000)
    assert share.value == 0.0


def test_after_a_change_the_batches_under_way_are_left_out_of_the_next_look():
    share = DecodeShare(lag=5)
    windows(share, 1.0, 1)
    assert share.value == pytest.approx(sharing.STEP)
    for _ in range(5):  # made under the share before: busy as they are, they move nothing
        share.observe(1.0, 0.0)
    windows(share, 0.9, 1)  # the first look at the new share: between the bounds, it holds
    assert share.value == pytest.approx(sharing.STEP)
    windows(share, 1.0, 1)  # no change, so nothing to wait out: the next look counts at once
    assert share.value == pytest.approx(2 * sharing.STEP)


def settle(lag: int, workers: int, batches: int = 4000) -> list:
    """The share batch by batch in a pipeline whose batches are made ``2 * workers`` batches after
    their share was set (a DataLoader's prefetch): the step takes 1 a batch, the decode thread
    1.3 * (1 - share), the workers 0.5 + 1.5 * share; the slowest sets the pace. The decode thread
    is busy >= 95% below a share of 0.27 and < 85% above 0.35: the share should settle between."""
    share, made = DecodeShare(lag=lag), []
    for i in range(batches):
        s = made[i - 2 * workers] if i >= 2 * workers else 0.0
        thread, period = 1.3 * (1 - s), max(1.0, 1.3 * (1 - s), 0.5 + 1.5 * s)
        share.observe(thread, period - thread)
        made.append(share.value)
    return made[batches // 2:]


@pytest.mark.parametrize("workers", [2, 8, 16])
def test_the_share_settles_with_many_workers_where_it_swung_without_the_lag(workers):
    steady = settle(2 * workers, workers)
    assert 0.27 - 1e-9 <= min(steady) and max(steady) <= 0.35 + sharing.STEP  # one step at most past the band
    assert max(steady) - min(steady) <= sharing.STEP + 1e-9
    if workers == 16:  # looking before the batches under way were through: it overshot both ways
        swing = settle(0, workers)
        assert max(swing) - min(swing) >= 4 * sharing.STEP


def test_a_fixed_share_never_moves_and_a_share_is_a_fraction():
    share = DecodeShare(0.3)
    windows(share, 1.0, 10)
    assert not share.auto and share.value == pytest.approx(0.3)
    with pytest.raises(ValueError):
        DecodeShare(1.5)


@pytest.mark.parametrize("fraction, taken", [(0.0, 0), (0.25, 25), (0.5, 50), (1.0, 100)])
def test_a_worker_takes_the_shares_fraction_of_its_images_evenly(fraction, taken):
    credit = Credit(DecodeShare(fraction))
    picks = [credit.take() for _ in range(100)]
    assert sum(picks) == taken
    if 0 < fraction <= 0.5:  # spread out: never two in a row
        assert not any(a and b for a, b in zip(picks, picks[1:]))
    assert not any(Credit(None).take() for _ in range(10))


def test_the_share_pickles_to_a_process_as_the_same_shared_memory():
    share = DecodeShare()
    windows(share, 1.0, 3)
    copy = pickle.loads(ForkingPickler.dumps(share))  # as the DataLoader sends a dataset to a worker
    assert copy.value == pytest.approx(3 * sharing.STEP) and copy.auto
    windows(share, 1.0, 2)
    assert copy.value == pytest.approx(5 * sharing.STEP)  # the copy reads what the decode thread writes


@pytest.fixture
def jpeg_and_png(tmp_path):
    photo(60, 80, 0).save(tmp_path / "a.JPEG", "JPEG")
    photo(60, 80, 1).save(tmp_path / "b.JPEG", "PNG")
    return str(tmp_path / "a.JPEG"), str(tmp_path / "b.JPEG")


def test_the_workers_share_is_decoded_as_a_fallback_is_and_counted_apart(jpeg_and_png):
    jpeg, png = jpeg_and_png
    reader = TrainJpegReader(TrainDecoder(32, 0.3, 0.5), DecodeShare(1.0))
    shared, fallback = reader(jpeg), reader(png)
    assert isinstance(shared, CpuDecoded) and shared.shared and shared.image.shape == (32, 32, 3)
    assert isinstance(fallback, CpuDecoded) and not fallback.shared
    assert isinstance(TrainJpegReader(TrainDecoder(32, 0.3, 0.5), DecodeShare(0.0))(jpeg), JpegJob)
    plain = TrainJpegReader(TrainDecoder(32, 0.3, 0.5))(jpeg)
    batch = JpegBatch.collate([shared, fallback, plain], [0, 1, 2])
    assert batch.shared == 1 and len(batch) == 3 and batch.worker_seconds[4] == pytest.approx(shared.decode_s)
    assert batch.worker_seconds[2] == pytest.approx(fallback.decode_s)  # fallbacks' time apart from the share's
    again = pickle.loads(pickle.dumps(batch))  # to the training process
    assert again.shared == 1
    decoded = decode_images(again, torch.device("cpu"))
    assert decoded.counts == {"gpu": 1, "cpu": 1, "share": 1}


def test_a_bad_share_is_one_flag_error():
    for value in ("1.5", "-0.1", "most", "nan"):
        with pytest.raises(UserError, match="--decode-share is auto or a fraction from 0 to 1"):
            validate(parse_config(["DIR", "--decode-share", value]))
    with pytest.raises(UserError, match="with --decode cpu the workers decode every image already"):
        validate(parse_config(["DIR", "--decode", "cpu", "--decode-share", "0.2"]))
    for value in ("auto", "0", "0.35", "1"):
        validate(parse_config(["DIR", "--decode", "gpu", "--decode-share", value]))
    validate(parse_config(["DIR", "--decode", "cpu", "--decode-share", "auto"]))


def test_worker_processes_take_the_share_and_follow_its_changes(jpeg_and_png, tmp_path):
    """build_loaders with --decode gpu and 2 persistent worker processes: no share at first;
    once the decode thread's load raised it, the same workers decode that share of the JPEGs."""
    from imagenet.data.loaders import build_datasets, build_loaders
    from imagenet.parallel.distributed import DistContext

    jpeg, png = jpeg_and_png
    for split in ("train", "val"):
        for c in ("a", "b"):
            d = tmp_path / "data" / split / c
            d.mkdir(parents=True)
            for k in range(8):
                os.link(jpeg, d / f"{k}.JPEG")
            os.link(png, d / "png.JPEG")
    root = str(tmp_path / "data")
    cfg = Config(data=root, decode="gpu", image_size=32, val_resize=40, batch_size=6, workers=2, min_crop_scale=0.3)
    validate(cfg)
    data = build_datasets(cfg, root)
    train, val = build_loaders(cfg, data, DistContext("cpu", torch.device("cpu"), "test"), seed=0)
    assert train.share is data.decode_share and val.share is None and data.decode_share.auto
    assert data.decode_share.lag == 4  # the batches 2 workers have under way

    def epoch(n):
        train.sampler.set_epoch(n)
        seen = sum(t.numel() for _, t, _ in train)
        return seen, train.decode_counts(), train.stage_account()

    seen, counts, stages = epoch(0)
    assert seen == 18 and counts == {"gpu": 16, "cpu": 2, "share": 0} and stages["decode_share"] == 0
    windows(data.decode_share, 1.0, 30)  # as a busy decode thread would
    raised = data.decode_share.value
    assert raised >= 0.5
    seen, counts, stages = epoch(1)
    assert seen == 18 and counts["cpu"] == 2 and counts["gpu"] + counts["share"] == 16
    assert counts["share"] >= 6, counts  # about half of each worker's JPEGs
    assert stages["decode_share"] == pytest.approx(counts["share"] / 18, abs=1e-4) and stages["share"] > 0
    train.close()
    val.close()


def test_deterministic_runs_keep_every_jpeg_on_the_gpu():
    from imagenet.base.config import decode_share
    assert decode_share(parse_config(["DIR", "--deterministic"])) == 0.0
    assert decode_share(parse_config(["DIR"])) is None
    assert decode_share(parse_config(["DIR", "--deterministic", "--decode-share", "0.4"])) == 0.4
    validate(parse_config(["DIR", "--deterministic", "--decode", "cpu"]))  # auto stays quiet beside the workers' decode
    with pytest.raises(UserError, match="--decode-share is auto or a fraction"):
        validate(Config(decode_share=None))  # a config file's null


def test_synthetic_data_decodes_nothing_and_counts_no_share():
    """--dummy with --decode gpu asked for: the epoch's counts (runner._decode_counts) have the share's key."""
    from imagenet.data.synthetic import SyntheticDataset, SyntheticLoader
    loader = SyntheticLoader(SyntheticDataset(8, 2, 16, seed=1), samples=8, drop_last=True,
                             device=torch.device("cpu"), channels_last=False, batch=4)
    assert loader.decode_counts() == {"gpu": 0, "cpu": 0, "share": 0}
