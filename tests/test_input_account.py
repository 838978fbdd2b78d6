"""The --decode gpu input account (imagenet.data.inputaccount): the workers' times carried with
each batch, the decode thread's waits and work, the epoch's line."""

import logging
import types

import pytest
import torch

from imagenet.base.config import Config
from imagenet.data.decode import TrainDecoder, ValDecoder
from imagenet.data.gpudecode import CpuDecoded, JpegBatch, JpegJob, TrainJpegReader, ValJpegReader, _read_bytes
from imagenet.data.inputaccount import STAGES, InputAccount, describe
from imagenet.data.prefetch import DeviceLoader
from imagenet.data.shards import SampleBytes
from imagenet.training.runlog import RunLog
from tests.helpers import photo


def stages(**ms) -> dict:
    return {"batches": 50, **dict.fromkeys(STAGES, 0.0), **ms}


# ms a batch: one worker's time for a batch, the decode thread's waits and work
GPU_SLOW = stages(read=5, parse=30, starved=1, busy=44, ahead=0.5)


def test_the_account_sums_per_batch_and_resets():
    account = InputAccount()
    assert account.take() == {}
    for _ in range(4):
        account.batch((0.004, 0.010, 0.002))
        account.add("busy", 0.020)
        account.add("starved", 0.005)
    got = account.take()
    assert got["batches"] == 4 and got["read"] == pytest.approx(4.0) and got["parse"] == pytest.approx(10.0)
    assert got["fallback"] == pytest.approx(2.0) and got["busy"] == pytest.approx(20.0)
    assert account.take() == {}
    assert describe(got, 4) == ("workers read 4.0 ms/batch, parse headers and draw crops 10.0 ms/batch, decode "
                                "fallbacks 2.0 ms/batch (one worker's time for a batch; 4 workers); decode thread "
                                "busy 80% (20.0 ms/batch), waiting for workers 20%, waiting for room 0% (4 batches)")


@pytest.fixture(scope="module")
def jpeg_and_png(tmp_path_factory):
    root = tmp_path_factory.mktemp("account")
    photo(60, 80, 0).save(root / "a.JPEG", "JPEG")
    photo(60, 80, 1).save(root / "b.JPEG", "PNG")
    return str(root / "a.JPEG"), str(root / "b.JPEG")


def test_workers_time_their_reads_and_the_rest_and_the_batch_carries_the_sums(jpeg_and_png):
    jpeg, png = jpeg_and_png
    job, fallback = TrainJpegReader(TrainDecoder(32, 0.3, 0.5))(jpeg), TrainJpegReader(TrainDecoder(32, 0.3, 0.5))(png)
    assert isinstance(job, JpegJob) and job.read_s > 0 and job.parse_s > 0
    assert isinstance(fallback, CpuDecoded) and fallback.read_s > 0 and fallback.decode_s > 0
    val = ValJpegReader(ValDecoder(32, 40))(jpeg)
    assert val.read_s > 0 and val.parse_s > 0
    batch = JpegBatch.collate([job, fallback])
    assert batch.worker_seconds == pytest.approx((job.read_s + fallback.read_s, job.parse_s, fallback.decode_s))
    # a tar shard's sample was read by the dataset: its pread's time comes with it
    data, read_s = _read_bytes(SampleBytes(b"\xff\xd8bytes", "train-000000.tar@512", read_s=0.25))
    assert data == b"\xff\xd8bytes" and read_s >= 0.25


def test_the_decode_thread_accounts_its_waits_and_its_work(jpeg_and_png):
    reader = TrainJpegReader(TrainDecoder(32, 0.3, 0.5))
    batch = JpegBatch.collate([reader(jpeg_and_png[0]), reader(jpeg_and_png[1])])
    batches = [(batch, torch.tensor([0, 1]), [])] * 3
    loader = DeviceLoader(batches, torch.device("cpu"), False, (0.5,) * 3, (0.25,) * 3, background=True)
    assert sum(len(t) for _, t, _ in loader) == 6
    got = loader.stage_account()
    assert got["batches"] == 3 and got["busy"] > 0
    assert got["read"] == pytest.approx(1000 * batch.worker_seconds[0], abs=1e-3)  # rounded to a microsecond
    assert loader.stage_account() == {}


def test_an_epoch_of_gpu_decoding_logs_its_stages(tmp_path, caplog):
    cfg = Config(output_dir=str(tmp_path), decode="gpu", workers=15)
    ctx = types.SimpleNamespace(is_main=True, device=torch.device("cuda"), distributed=False)
    train = types.SimpleNamespace(skipped_steps=0, steps=10, data_wait_frac=0.3, img_per_s=5000.0)
    with caplog.at_level(logging.INFO, logger="imagenet"), RunLog(cfg, ctx) as log:
        log.epoch({"epoch": 0}, train, None, GPU_SLOW)
    text = caplog.text
    assert "=> epoch 0 input stages: workers read 5.0 ms/batch" in text
    assert "decode thread busy 97% (44.0 ms/batch), waiting for workers 2%" in text
    assert "the training loop waited for data 30% of its steady time" in text
    assert "input-bound" in text
