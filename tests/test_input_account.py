"""The --decode gpu input account (imagenet.data.gpu.account): the workers' times carried with
each batch, the decode thread's waits and work, the epoch's line, and the input-bound line that
reads it (imagenet.training.runlog.input_hint): which stage it names, in which words."""

import logging
import types

import pytest
import torch

from imagenet.base.config import Config
from imagenet.data.decode import TrainDecoder, ValDecoder
from imagenet.data.gpu.decode import CpuDecoded, JpegBatch, JpegJob, TrainJpegReader, ValJpegReader, _read_bytes
from imagenet.data.gpu.account import STAGES, InputAccount, describe, limiting_stage
from imagenet.data.prefetch import DeviceLoader
from imagenet.data.shards.dataset import SampleBytes
from imagenet.training.runlog import RunLog, input_hint
from tests.helpers import photo


def stages(**ms) -> dict:
    return {"batches": 50, **dict.fromkeys(STAGES, 0.0), **ms}


# ms a batch: one worker's time for a batch, the decode thread's waits and work
WORKERS_SLOW = stages(read=5, parse=60, starved=20, busy=9, ahead=0.1)
FILES_SLOW = stages(read=70, parse=15, starved=30, busy=9)
GPU_SLOW = stages(read=5, parse=30, starved=1, busy=44, ahead=0.5)
READY = stages(read=5, parse=30, starved=1, busy=9, ahead=25)
# the decode thread waited for the finishing thread, which worked all the time
FINISH_SLOW = stages(read=5, parse=30, starved=1, busy=9, ahead=24, finish_busy=33, finish_ahead=0.2)
# both threads waited for room: the step took the batches late
READY_BOTH = stages(read=5, parse=30, starved=1, busy=9, ahead=24, finish_busy=5, finish_ahead=27)


@pytest.mark.parametrize("account, stage", [(WORKERS_SLOW, "workers"), (FILES_SLOW, "files"), (GPU_SLOW, "gpu"),
                                            (READY, "ready"), (FINISH_SLOW, "gpu"), (READY_BOTH, "ready")])
def test_the_stage_that_held_the_batches_up(account, stage):
    assert limiting_stage(account) == stage


def hint(account, workers=4, cpus=16, decode="gpu", processes=1, **flags):
    return input_hint(Config(workers=workers, decode=decode, **flags), cuda=True, cpus=cpus, processes=processes,
                      stages=account)


def test_idle_workers_and_a_busy_decode_thread_name_the_gpu_decoding_stage():
    """With 15 idle workers and a busy decode thread, the GPU stage is the limit, not the CPUs."""
    line = hint(GPU_SLOW, workers=15)
    assert line.startswith("the GPU decoding stage was the limit: its thread was busy 44 ms a batch")
    assert "the 15 data workers kept up (it waited 1 ms a batch for them)" in line
    assert "already have every CPU" not in line and line.endswith("try --decode cpu -j 15, which decodes in the workers")
    assert "--decode cpu is unlikely to do better" in hint(GPU_SLOW, cpus=8)
    assert hint(READY).startswith("the GPU decoding stage was the limit: its thread had the batches ready ahead")


def test_a_busy_finishing_thread_is_named_with_the_decode_threads_wait_for_it():
    line = hint(FINISH_SLOW, workers=15)
    assert line.startswith("the GPU decoding stage was the limit: its finishing thread was busy 33 ms a batch (the "
                           "geometry kernel's table and launches, the normalisation) while the decode thread waited "
                           "24 ms a batch for it and the 15 data workers kept up; try --decode cpu -j 15")
    assert describe(FINISH_SLOW, 15).endswith("waiting for room 71%; finishing thread busy 33.0 ms/batch, waiting "
                                              "for room 0.2 ms/batch (50 batches)")


def test_slow_workers_and_slow_reads_are_named_with_what_to_try():
    line = hint(WORKERS_SLOW, workers=4, cpus=16)
    assert line.startswith("the CPU workers were the limit: the GPU decoding stage waited 20 ms a batch for "
                           "the 4 data workers (65 ms of work a batch each")
    assert line.endswith("try more data workers (-j, now 4; 16 CPUs here)")
    assert hint(WORKERS_SLOW, workers=15, cpus=16).endswith("the 15 data workers already have every CPU here")
    # eight processes share 128 cores: 16 a process
    assert hint(WORKERS_SLOW, workers=15, cpus=16, processes=8).endswith("every CPU a process here (8 processes)")
    line = hint(FILES_SLOW)
    assert line.startswith("reading files was the limit") and "spent 70 of their 85 ms a batch reading files" in line
    assert line.endswith("try more data workers (-j, now 4; 16 CPUs here), or the dataset on faster or local storage")


def test_cpu_decoding_names_the_workers_and_offers_the_gpu():
    line = hint(None, workers=15, cpus=16, decode="cpu")
    assert line == "the CPU workers (decoding) were the limit: try --decode gpu (JPEG decoding on the GPU)"
    line = hint(None, workers=15, cpus=16, decode="cpu", auto_augment="randaugment")
    assert line.endswith("the 15 data workers already have every CPU here: this machine's input rate is the limit")


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


def test_the_line_names_the_parts_it_timed():
    """The finer stages (the collate, the hand-off, the decoder call, the thread's CPU, the GPU's
    kernels, the training thread's wait) join the line where they were timed."""
    line = describe(stages(read=5, parse=30, collate=2, starved=1, handoff=0.4, busy=44, decode=30, decode_cpu=3,
                           thread_cpu=12, ahead=0.5, geometry=1.25, normalise=0.5, train_wait=0.2), 15)
    assert line == ("workers read 5.0 ms/batch, parse headers and draw crops 30.0 ms/batch, decode fallbacks 0.0 "
                    "ms/batch, collate 2.0 ms/batch (one worker's time for a batch; 15 workers); decode thread busy "
                    "97% (44.0 ms/batch: decoder call 30.0 ms, 3.0 of it on the CPU), waiting for workers 2% "
                    "(hand-off 0.4 ms/batch), waiting for room 1%, CPU 12.0 ms/batch; on the GPU: geometry 1.25 "
                    "ms/batch, normalise 0.50 ms/batch; training thread waited 0.2 ms/batch (50 batches)")
    line = hint(stages(read=5, parse=30, starved=1, busy=44, decode=30, ahead=0.5), workers=15)
    assert line.startswith("the GPU decoding stage was the limit: its thread was busy 44 ms a batch (the decoder "
                           "call 30 ms of it)")
    assert hint(stages(read=5, parse=30, starved=1, busy=9, ahead=25, geometry=1.5, normalise=0.5)).endswith(
        "so the loop waited for the decode's kernels on the GPU (2.0 ms a batch of GPU time)")


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
    assert batch.worker_seconds[:3] == pytest.approx((job.read_s + fallback.read_s, job.parse_s, fallback.decode_s))
    assert batch.worker_seconds[3] > 0 and batch.worker_seconds[4] == 0  # the batch laid out; no share decoded
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
    assert got["batches"] == 3 and got["busy"] > 0 and got["collate"] > 0 and got["finish_busy"] > 0
    assert set(got) == {"batches", "decode_share", *STAGES}  # stages, the batch count and the share, nothing else
    assert got["decode_share"] == 0.0  # no share given: every JPEG to the decoder
    assert 0 < got["decode"] <= got["busy"] and got["thread_cpu"] > 0
    assert got["geometry"] == got["normalise"] == 0  # GPU stages: none on a CPU
    assert got["read"] == pytest.approx(1000 * batch.worker_seconds[0], abs=1e-3)  # rounded to a microsecond
    assert loader.stage_account() == {}


def test_an_epoch_of_gpu_decoding_logs_its_stages_and_names_the_stage_it_waited_for(tmp_path, caplog):
    cfg = Config(output_dir=str(tmp_path), decode="gpu", workers=15)
    ctx = types.SimpleNamespace(is_main=True, device=torch.device("cuda"), distributed=False)
    train = types.SimpleNamespace(skipped_steps=0, steps=10, data_wait_frac=0.3, img_per_s=5000.0)
    with caplog.at_level(logging.INFO, logger="imagenet"), RunLog(cfg, ctx) as log:
        log.epoch({"epoch": 0}, train, None, GPU_SLOW)
    text = caplog.text
    assert "=> epoch 0 input stages: workers read 5.0 ms/batch" in text
    assert "decode thread busy 97% (44.0 ms/batch), waiting for workers 2%" in text
    assert "the training loop waited for data 30% of its steady time" in text
    assert "input-bound" in text and "the GPU decoding stage was the limit" in text
    assert "already have every CPU" not in text


@pytest.mark.parametrize("workers, cpus, says", [
    (1, 2, "the 1 data worker already has every CPU here"),
    (2, 2, "the 2 data workers already have every CPU here"),
    (0, 1, "the training process, loading its own batches (-j 0), already has every CPU here"),
])
def test_the_workers_that_have_every_cpu_are_named_in_good_grammar(workers, cpus, says):
    assert hint(WORKERS_SLOW, workers=workers, cpus=cpus).endswith(says)
    assert hint(None, workers=workers, cpus=cpus, decode="cpu", auto_augment="randaugment").endswith(
        says + ": this machine's input rate is the limit")
