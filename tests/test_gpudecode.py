"""--decode gpu: workers ship JPEG bytes and crop boxes; the device decodes. On the CPU the same
code runs with torchvision's CPU decoder, which proves the geometry against the CPU pipeline."""

import builtins
import io
import os
import pickle
import threading
import warnings
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from PIL import Image

from imagenet.base.config import Config, validate
from imagenet.base.errors import UserError
from imagenet.cli import main
from imagenet.data.gpu import jpeg as gpujpeg
from imagenet.data.decode import TrainDecoder, ValDecoder, path_identity
from imagenet.data.images.folder import SafeImageFolder
from imagenet.data.gpu.decode import (CpuDecoded, JpegBatch, JpegJob, TrainJpegReader, ValJpegReader, decode_batch,
                                      decode_images, finish_batch)
from imagenet.data.gpu.account import STAGES
from imagenet.data.loaders import collate_skipping
from imagenet.data.prefetch import DeviceLoader
from imagenet.data.transforms import set_output_size
from tests.helpers import garbage_job, photo

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("jpegs")
    paths = []
    for i, (h, w) in enumerate([(120, 160), (160, 120), (97, 131), (64, 64)]):
        p = root / f"{i}.JPEG"
        photo(h, w, i).save(p, "JPEG", quality=90)
        paths.append(str(p))
    grey = root / "grey.JPEG"
    photo(90, 70, 9).convert("L").save(grey, "JPEG")
    cmyk = root / "cmyk.JPEG"
    photo(80, 100, 7).convert("CMYK").save(cmyk, "JPEG")
    png = root / "png-named.JPEG"
    photo(70, 90, 8).save(png, "PNG")
    bad = root / "truncated.JPEG"
    data = io.BytesIO()
    photo(120, 160, 5).save(data, "JPEG")
    bad.write_bytes(data.getvalue()[:200])
    progressive = root / "progressive.JPEG"
    photo(100, 120, 6).save(progressive, "JPEG", progressive=True)
    rotated = root / "rotated.JPEG"
    exif = Image.Exif()
    exif[0x0112] = 6  # EXIF orientation: turn 90 degrees to show
    photo(100, 120, 4).save(rotated, "JPEG", exif=exif.tobytes())
    return {"jpeg": paths, "grey": str(grey), "cmyk": str(cmyk), "png": str(png), "bad": str(bad),
            "progressive": str(progressive), "rotated": str(rotated)}


def decode_one(reader, path, seed=0):
    torch.manual_seed(seed)
    item = reader(path)
    images, keep, _, counts = decode_batch(JpegBatch.collate([item]), CPU)
    return item, images, keep, counts


@pytest.mark.parametrize("size", [32, 56])
def test_train_crops_match_the_cpu_decoder_within_rounding(files, size):
    for k, path in enumerate(files["jpeg"] + [files["grey"]]):
        cpu = TrainDecoder(size, 0.3, 0.5, draft=False)
        torch.manual_seed(k)
        want = cpu(path)
        item, got, keep, counts = decode_one(TrainJpegReader(TrainDecoder(size, 0.3, 0.5, draft=False)), path, k)
        assert isinstance(item, JpegJob) and keep == [True] and counts == {"gpu": 1, "cpu": 0, "share": 0}
        assert got.shape == (1, size, size, 3) and got.dtype == torch.uint8
        diff = (got[0].int() - want.int()).abs()
        # the same crop box and flip; PIL's fixed-point filter vs torch's float one: rounding only
        assert diff.float().mean() < 1.0 and diff.max() <= 3, (path, diff.float().mean(), diff.max())


def test_val_resize_and_center_crop_match_the_cpu_decoder(files):
    for path in files["jpeg"]:
        want = ValDecoder(48, 56)(path)
        _, got, _, _ = decode_one(ValJpegReader(ValDecoder(48, 56)), path)
        diff = (got[0].int() - want.int()).abs()
        assert got.shape == (1, 48, 48, 3) and diff.float().mean() < 1.0 and diff.max() <= 3


def test_non_jpegs_fall_back_to_the_worker_and_are_counted(files):
    reader = TrainJpegReader(TrainDecoder(32, 0.3, 0.5))
    # progressive: the hardware decoder takes baseline JPEGs only; EXIF-rotated: TorchCodec
    # would turn it, the CPU path does not
    for path in (files["png"], files["cmyk"], files["progressive"], files["rotated"]):
        item, images, keep, counts = decode_one(reader, path)
        assert isinstance(item, CpuDecoded) and counts == {"gpu": 0, "cpu": 1, "share": 0} and images.shape == (1, 32, 32, 3)
        torch.manual_seed(0)
        assert torch.equal(images[0], TrainDecoder(32, 0.3, 0.5)(path))  # the CPU path's own image


def test_each_file_is_opened_once(files, monkeypatch):
    opened = []
    real_open = builtins.open

    def counting(path, *args, **kwargs):
        opened.append(str(path))
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", counting)
    for reader in (TrainJpegReader(TrainDecoder(32, 0.3, 0.5)), ValJpegReader(ValDecoder(32, 40))):
        for path in (files["jpeg"][0], files["png"]):
            opened.clear()
            reader(path)
            assert opened == [path]


def test_a_batch_travels_as_one_shared_buffer(files):
    """Targets, table, fallbacks and the JPEGs' bytes in one tensor: pickled for the trip to the
    training process it is a file descriptor and a few numbers, not the bytes."""
    reader = TrainJpegReader(TrainDecoder(32, 0.3, 0.5))
    items = [reader(p) for p in files["jpeg"]] + [reader(files["png"])]
    batch = JpegBatch.collate(items, [3, 1, 4, 1, 5])
    assert batch.targets.tolist() == [3, 1, 4, 1, 5] and batch.ready_rows == [4]
    assert batch.data.numel() == sum(os.path.getsize(p) for p in files["jpeg"])
    for view in (batch.targets, batch.ints, batch.scales, batch.ready, batch.data):
        assert view.untyped_storage().data_ptr() == batch.blob.untyped_storage().data_ptr()
    message = ForkingPickler.dumps((batch, batch.targets, []))
    assert len(message) < 2000 + sum(len(p) for p in batch.paths), len(message)
    got, targets, _ = pickle.loads(message)
    assert torch.equal(got.blob, batch.blob) and torch.equal(targets, batch.targets) and got.lengths == batch.lengths
    assert got.handoff >= 0 and got.worker_seconds == batch.worker_seconds and len(got.worker_seconds) == 5


def test_the_decoder_is_found_and_named(monkeypatch):
    decoder = gpujpeg.find()
    assert decoder is not None and decoder.name in gpujpeg.BACKENDS
    monkeypatch.setenv(gpujpeg.ENV, "nonsense")
    with pytest.raises(UserError, match="names no JPEG decoder"):
        gpujpeg.find()
    if gpujpeg.find("torchcodec") is None:
        with pytest.raises(UserError, match=r"torchcodec: not installed.*torchcodec>=0.16"):
            gpujpeg.require("torchcodec")


def _stub(name, fails=None):
    def batched(datas, device):
        if fails is not None:
            raise fails
        return [torch.zeros(3, 8, 16, dtype=torch.uint8) for _ in datas]
    return gpujpeg.JpegDecoder(name, batched, lambda data, device: batched([data], device)[0])


@pytest.fixture
def fresh_lookup(monkeypatch):
    monkeypatch.setattr(gpujpeg, "_lookups", {})
    monkeypatch.delenv(gpujpeg.ENV, raising=False)


def test_a_decoder_that_cannot_decode_on_the_gpu_is_passed_over(monkeypatch, fresh_lookup):
    """TorchCodec's CPU wheels (no nvJPEG) fail every CUDA call: with a GPU visible, find() probes
    each backend with a small JPEG and takes the first that decodes it; require() says why none
    did. Without the probe every image would fall back to PIL in the decode thread, unreported."""
    no_nvjpeg = RuntimeError("torchcodec was not compiled with nvJPEG support")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpujpeg, "_FACTORIES", {"torchvision": lambda: _stub("torchvision", no_nvjpeg),
                                                "torchcodec": lambda: _stub("torchcodec")})
    assert gpujpeg.find().name == "torchcodec" and gpujpeg.gpu_capable(gpujpeg.find())
    with pytest.raises(UserError, match="torchvision: RuntimeError: torchcodec was not compiled with nvJPEG"):
        gpujpeg.require("torchvision")
    monkeypatch.setattr(gpujpeg, "_lookups", {})
    monkeypatch.setattr(gpujpeg, "_FACTORIES", {"torchvision": lambda: None,
                                                "torchcodec": lambda: _stub("torchcodec", no_nvjpeg)})
    assert gpujpeg.find() is None and not gpujpeg.gpu_capable(gpujpeg.find())
    with pytest.raises(UserError, match="torchvision: not installed.*torchcodec: RuntimeError.*CUDA build of "
                                        "torchvision.*torchcodec>=0.16.*--decode cpu"):
        gpujpeg.require()


def test_the_decoders_are_tried_in_the_measured_order(monkeypatch, fresh_lookup):
    """torchvision's op fed the training step fastest; TorchCodec, its successor, takes over where
    the op is missing."""
    stubs = {name: (lambda name=name: _stub(name)) for name in gpujpeg.BACKENDS}
    monkeypatch.setattr(gpujpeg, "_FACTORIES", stubs)
    assert gpujpeg.find().name == "torchvision"
    monkeypatch.setitem(stubs, "torchvision", lambda: None)
    monkeypatch.setattr(gpujpeg, "_lookups", {})
    assert gpujpeg.find().name == "torchcodec"


@pytest.mark.parametrize("name", ["nvimgcodec", "nvjpeg", "dali", "torchvision@2"])
def test_only_the_kept_decoders_can_be_asked_for(monkeypatch, fresh_lookup, name):
    """The package keeps torchvision's op and TorchCodec; any other IMAGENET_GPU_JPEG (a backend it
    no longer has, a typo) is one clear error naming the choices."""
    assert gpujpeg.BACKENDS == ("torchvision", "torchcodec")
    monkeypatch.setenv(gpujpeg.ENV, name)
    with pytest.raises(UserError, match=rf"IMAGENET_GPU_JPEG={name} names no JPEG decoder; choose one of auto, "
                                        r"torchvision, torchcodec \(or unset it\)"):
        gpujpeg.require()


def test_device_errors_are_not_bad_images():
    """Out of memory, or a CUDA fault of earlier kernels surfacing at the decoder's sync, is no
    bad file: it propagates instead of sending the batch image by image to the CPU."""
    for error in (torch.OutOfMemoryError("CUDA out of memory"), RuntimeError("CUDA error: an illegal memory access")):
        with pytest.raises(type(error)):
            _stub("oom", error).decode([torch.zeros(4, dtype=torch.uint8)] * 2, CPU)
    assert _stub("bad", RuntimeError("Not a JPEG file")).decode([torch.zeros(4, dtype=torch.uint8)] * 2, CPU) == \
        [None, None]


def test_an_image_of_another_shape_than_its_header_is_decoded_again_on_the_cpu(files):
    """A decoder that turned an image (EXIF) would mislead the kernel: the CPU decodes it instead."""
    turned = gpujpeg.JpegDecoder("turning", lambda datas, device: [torch.zeros(3, 7, 5, dtype=torch.uint8)
                                                                 for _ in datas], None)
    reader = TrainJpegReader(TrainDecoder(32, 0.3, 0.5, draft=False))
    torch.manual_seed(3)
    batch = JpegBatch.collate([reader(files["jpeg"][0])])
    images, keep, bad, counts = decode_batch(batch, CPU, decoder=turned)
    want, _, _, _ = decode_batch(batch, CPU)
    assert counts == {"gpu": 0, "cpu": 1, "share": 0} and keep == [True] and not bad
    assert (images.int() - want.int()).abs().max() <= 3  # PIL's decode against libjpeg through torchvision


def test_a_bad_image_fails_alone_and_nothing_warns(files):
    """One unreadable image in a batched call: the others still decode. torchvision 0.29 warns
    on every call of its deprecated decoder; the op behind it is called without the warning."""
    good = torch.frombuffer(bytearray(open(files["jpeg"][0], "rb").read()), dtype=torch.uint8)
    garbage = torch.frombuffer(bytearray(b"\xff\xd8garbage" * 8), dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = gpujpeg.find().decode([good, garbage, good], CPU)
    assert out[1] is None and out[0].shape == out[2].shape == (3, 120, 160) and out[0].dtype == torch.uint8




def test_an_undecodable_jpeg_is_skipped_and_the_rest_of_the_batch_survives(files):
    reader = TrainJpegReader(TrainDecoder(32, 0.3, 0.5))
    items = [reader(files["jpeg"][0]), garbage_job(), reader(files["jpeg"][1])]
    images, keep, bad, counts = decode_batch(JpegBatch.collate(items), CPU)
    assert keep == [True, False, True] and bad == ["garbage.JPEG"] and images.shape[0] == 2
    assert counts == {"gpu": 2, "cpu": 0, "share": 0}


def test_the_two_halves_make_what_decode_batch_made(files):
    """decode_images then finish_batch (the background path's two threads) give decode_batch's
    batch: JPEGs, a worker's fallback and an unreadable file among them, at their places."""
    reader = TrainJpegReader(TrainDecoder(32, 0.3, 0.5))
    torch.manual_seed(5)
    items = [reader(files["jpeg"][0]), reader(files["png"]), garbage_job(), reader(files["jpeg"][2]),
             reader(files["grey"])]
    batch = JpegBatch.collate(items, [0, 1, 2, 3, 4])
    want = decode_batch(batch, CPU)
    decoded = decode_images(batch, CPU)
    assert decoded.counts == {"gpu": 3, "cpu": 1, "share": 0} and decoded.images[1] is None  # not finished yet
    got = finish_batch(decoded, CPU)
    assert torch.equal(got.images, want.images) and got.images.shape == (4, 32, 32, 3)
    assert got.keep == want.keep == [True, True, False, True, True]
    assert got.bad == want.bad == ["garbage.JPEG"] and got.counts == want.counts


def test_a_file_whose_header_is_cut_is_skipped_by_the_dataset(files, tmp_path):
    (tmp_path / "a").mkdir()
    os.link(files["bad"], tmp_path / "a" / "cut.JPEG")
    ds = SafeImageFolder(str(tmp_path), TrainJpegReader(TrainDecoder(32, 0.3, 0.5)), loader=path_identity)
    assert ds[(0, 1)][0] is None and ds[(0, 1)][2].endswith("cut.JPEG")


@pytest.mark.parametrize("background", [False, True], ids=["inline", "background-thread"])
def test_the_device_loader_drops_targets_of_skipped_images(files, background):
    reader = TrainJpegReader(TrainDecoder(32, 0.3, 0.5))
    batch = collate_skipping([(reader(files["jpeg"][0]), 3, None), (garbage_job(files["bad"]), 4, None),
                              (reader(files["png"]), 5, None), (None, 6, "unreadable.JPEG")])
    assert isinstance(batch[0], JpegBatch)
    loader = DeviceLoader([batch], CPU, False, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), background=background)
    images, targets, skipped = next(iter(loader))
    assert images.shape == (2, 3, 32, 32) and images.dtype == torch.float32
    assert targets.tolist() == [3, 5] and skipped == ["unreadable.JPEG", files["bad"]]
    assert loader.decode_counts() == {"gpu": 1, "cpu": 1, "share": 0} and loader.decode_counts() == {"gpu": 0, "cpu": 0, "share": 0}


def test_the_reader_follows_progressive_resizing(files):
    reader = TrainJpegReader(TrainDecoder(32, 0.3, 0.5))
    set_output_size(reader, 24)
    assert reader(files["jpeg"][0]).out == 24


def test_same_seed_same_crop_as_the_cpu_pipeline(files, tmp_path):
    """Through the dataset with (index, seed) keys: the boxes are drawn like the CPU decoder's."""
    root = tmp_path / "train" / "a"
    root.mkdir(parents=True)
    for p in files["jpeg"]:
        os.link(p, root / os.path.basename(p))
    cpu = SafeImageFolder(str(tmp_path / "train"), TrainDecoder(32, 0.3, 0.5, draft=False), loader=path_identity)
    gpu = SafeImageFolder(str(tmp_path / "train"),
                          TrainJpegReader(TrainDecoder(32, 0.3, 0.5, draft=False)), loader=path_identity)
    for key in [(0, 11), (1, 12), (2, 13)]:
        want, _, _ = cpu[key]
        job, _, _ = gpu[key]
        got = decode_batch(JpegBatch.collate([job]), CPU)[0][0]
        assert (got.int() - want.int()).abs().float().mean() < 1.0


@pytest.mark.parametrize("kw, msg", [(dict(data_pipeline="classic"), "fast pipeline"),
                                     (dict(auto_augment="randaugment"), "--decode cpu"),
                                     (dict(random_erase=0.25), "--decode cpu")])
def test_combinations_that_need_pixels_in_the_workers_are_refused(kw, msg):
    with pytest.raises(UserError, match=msg):
        validate(Config(decode="gpu", **kw))


def test_gpu_decode_without_a_gpu_is_a_clear_error(digits, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main([digits, "--decode", "gpu", "--epochs", "1", "-b", "8", "--output-dir", str(tmp_path)]) == 2
    assert "--decode gpu needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("background", [False, True], ids=["inline", "background-thread"])
def test_a_batch_of_fallbacks_only_is_still_counted(files, background):
    reader = TrainJpegReader(TrainDecoder(32, 0.3, 0.5))
    batch = collate_skipping([(reader(files["png"]), 1, None), (reader(files["cmyk"]), 2, None)])
    assert isinstance(batch[0], JpegBatch)
    loader = DeviceLoader([batch, batch], CPU, False, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), background=background)
    for images, targets, _ in loader:
        assert images.shape == (2, 3, 32, 32)
        break  # the second batch is never taken: it must not be counted
    assert loader.decode_counts() == {"gpu": 0, "cpu": 2, "share": 0}


def _decoder_calling(hook):
    """The CPU's decoder behind the same interface, calling ``hook()`` first at each call."""
    real = gpujpeg.find()

    def batched(datas, device):
        hook()
        return real._batched(datas, device)
    return gpujpeg.JpegDecoder("hooked", batched)


def _jpeg_batches(files, n):
    """``n`` batches of a JPEG and a worker's fallback, targets (2k, 2k + 1)."""
    reader = TrainJpegReader(TrainDecoder(32, 0.3, 0.5))
    batch = JpegBatch.collate([reader(files["jpeg"][0]), reader(files["png"])])
    return [(batch, torch.tensor([2 * k, 2 * k + 1]), []) for k in range(n)]


def _background(batches, decoder):
    return DeviceLoader(batches, CPU, False, (0.5,) * 3, (0.25,) * 3, background=True, decoder=decoder)


def _pipeline_threads() -> list:
    return [t for t in threading.enumerate() if t.name in ("batch-decode", "batch-finish")]


def test_the_next_batch_decodes_while_this_one_is_finished_and_the_order_is_kept(files):
    """Two background threads: the decoder's call on one, the rest (the geometry, the
    normalisation) on the other, so batch k + 1's decoder call starts before batch k is finished;
    the batches still arrive in order."""
    calls, started = [], [threading.Event() for _ in range(6)]

    def decoding():
        calls.append(threading.current_thread().name)
        started[len(calls) - 1].set()
    loader = _background(_jpeg_batches(files, 5), _decoder_calling(decoding))
    normalize, finishers, overlapped = loader.normalize, [], []

    def normalising(images):  # batch k's last step waits for batch k + 1's decoder call to start
        k = len(finishers)
        finishers.append(threading.current_thread().name)
        if k < 4 and all(overlapped):
            overlapped.append(started[k + 1].wait(timeout=5))
        return normalize(images)
    loader.normalize = normalising
    seen = [t for _, targets, _ in loader for t in targets.tolist()]
    assert seen == list(range(10))
    assert set(calls) == {"batch-decode"} and set(finishers) == {"batch-finish"}
    assert overlapped == [True] * 4
    assert loader.decode_counts() == {"gpu": 5, "cpu": 5, "share": 0} and not _pipeline_threads()


@pytest.mark.parametrize("stage", ["batch-decode", "batch-finish"])
def test_an_error_in_either_thread_reaches_the_loop_after_the_batches_before_it(files, stage):
    """A decoder's device error (the decode thread) or a failing kernel (the finishing thread)
    on the third batch: the loop gets the two before it, then the error, and both threads end."""
    calls, raised_in = [], []

    def fail_third():
        calls.append(1)
        if len(calls) == 3:
            raised_in.append(threading.current_thread().name)
            raise RuntimeError("CUDA error: an illegal memory access")
    loader = _background(_jpeg_batches(files, 5), _decoder_calling(fail_third if stage == "batch-decode"
                                                                    else lambda: None))
    if stage == "batch-finish":
        normalize = loader.normalize
        loader.normalize = lambda images: (fail_third(), normalize(images))[1]
    seen = []
    with pytest.raises(RuntimeError, match="illegal memory access"):
        for _, targets, _ in loader:
            seen += targets.tolist()
    assert seen == [0, 1, 2, 3] and raised_in == [stage]
    assert not _pipeline_threads()


def test_worker_processes_ship_jobs_through_the_real_loaders(files, tmp_path):
    """build_loaders with --decode gpu and 2 worker processes (the decode itself on the CPU here,
    in the one decode thread): jobs and fallbacks cross process boundaries, every image arrives
    once, counts add up, and the epoch's account has every stage."""
    from imagenet.data.loaders import build_datasets, build_loaders
    from imagenet.parallel.distributed import DistContext

    for split, n in (("train", 2), ("val", 1)):
        for c in ("a", "b"):
            d = tmp_path / split / c
            d.mkdir(parents=True)
            for k, p in enumerate(files["jpeg"] * n):
                os.link(p, d / f"{k}.JPEG")
            os.link(files["png"], d / "png.JPEG")
    cfg = Config(data=str(tmp_path), decode="gpu", image_size=32, val_resize=40, batch_size=6, workers=2,
                 min_crop_scale=0.3)
    validate(cfg)
    ctx = DistContext("cpu", CPU, "test")
    train, val = build_loaders(cfg, build_datasets(cfg, str(tmp_path)), ctx, seed=0)
    train.sampler.set_epoch(0)
    shapes, seen = set(), 0
    for images, targets, skipped in train:
        shapes.add(tuple(images.shape[1:]))
        seen += targets.numel()
    assert shapes == {(3, 32, 32)} and seen == 18 and skipped == []
    assert train.decode_counts() == {"gpu": 16, "cpu": 2, "share": 0}
    stages = train.stage_account()  # the epoch's account: every stage timed, per batch
    assert stages["batches"] == 3 and set(stages) == {"batches", "decode_share", *STAGES}
    assert all(stages[k] > 0 for k in ("read", "parse", "fallback", "collate", "handoff", "busy", "decode",
                                       "thread_cpu"))
    assert stages["geometry"] == stages["normalise"] == 0  # GPU times: none on a CPU
    assert train.stage_account() == {}
    total = sum(t.numel() for _, t, _ in val)
    assert total == 10 and val.decode_counts() == {"gpu": 8, "cpu": 2, "share": 0}


cuda = pytest.mark.gpu


@cuda
def test_on_the_gpu_every_image_arrives_once_with_the_cpu_paths_crop(files, tmp_path):
    """Worker processes, the background thread, the decoder and the kernel on the GPU: every
    readable image of the epoch arrives once, the fallbacks are counted, the unreadable file is
    skipped, and each image is the CPU path's crop and flip for its seed (the CPU decoder's own
    pixels for the fallbacks; nvJPEG's decode within its bounds for the rest)."""
    from torch.utils.data import DataLoader

    from imagenet.data.transforms import IMAGENET_MEAN, IMAGENET_STD
    sources = [(375, 500), (500, 375), (333, 444), (480, 360), (300, 300), (375, 500)]
    paths = []
    for k, (h, w) in enumerate(sources):
        paths.append(str(tmp_path / f"{k}.JPEG"))
        photo(h, w, 20 + k).save(paths[-1], "JPEG", quality=90)
    paths += [files["png"], files["cmyk"], files["progressive"], files["rotated"], files["bad"]]
    root = tmp_path / "train"
    for k, p in enumerate(paths):  # one class per file: the target names the image
        (root / f"c{k:02d}").mkdir(parents=True)
        os.link(p, root / f"c{k:02d}" / "img.JPEG")
    make = lambda: TrainDecoder(56, 0.3, 0.5, draft=False)  # noqa: E731
    ds = SafeImageFolder(str(root), TrainJpegReader(make()), loader=path_identity)
    keys = [(i, 100 + i) for i in (3, 9, 0, 7, 10, 1, 5, 2, 8, 4, 6)]
    loader = DeviceLoader(DataLoader(ds, batch_size=4, sampler=keys, num_workers=2, collate_fn=collate_skipping,
                                     pin_memory=True), torch.device("cuda"), True, IMAGENET_MEAN, IMAGENET_STD,
                          background=True)
    mean = torch.tensor(IMAGENET_MEAN, device="cuda").view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device="cuda").view(1, 3, 1, 1)
    seen, skipped = [], []
    for images, targets, bad in loader:
        skipped += bad
        pixels = ((images * std + mean) * 255).cpu()  # NCHW, the uint8 batch again (within float error)
        for x, t in zip(pixels, targets.tolist()):
            seen.append(t)
            torch.default_generator.manual_seed(100 + t)
            want = make()(ds.samples[t][0]).permute(2, 0, 1).float()
            diff = (x - want).abs()
            if t >= len(sources):  # decoded by the worker's CPU decoder: the CPU path's pixels
                assert diff.max() < 0.01, (t, diff.max())
            else:
                assert diff.mean() < 1.0 and diff.max() <= 8.5, (t, diff.mean(), diff.max())
    assert sorted(seen) == list(range(10)) and skipped == [ds.samples[10][0]]
    assert loader.decode_counts() == {"gpu": 6, "cpu": 4, "share": 0}
    stages = loader.stage_account()
    assert stages["batches"] == 3 and stages["decode"] > 0 and stages["geometry"] > 0 and stages["normalise"] > 0


@cuda
@pytest.mark.parametrize("other", [b for b in gpujpeg.BACKENDS if b != "torchvision"])
def test_the_decoders_agree_on_the_gpu(files, other):
    """TorchCodec against torchvision's op (whose pixels the other GPU tests hold against PIL's):
    the same nvJPEG decode, so within a level or two; each image an RGB CHW uint8 on the GPU of its
    own shape, the second batch as the first (buffers reused)."""
    codec, vision = gpujpeg.find(other), gpujpeg.find("torchvision")
    if codec is None or vision is None:
        pytest.skip(f"needs both {other} and torchvision's nvJPEG op")
    datas = [torch.frombuffer(bytearray(open(p, "rb").read()), dtype=torch.uint8) for p in files["jpeg"]] * 3
    for _ in range(2):
        a, b = codec.decode(datas, torch.device("cuda")), vision.decode(datas, torch.device("cuda"))
        for x, y in zip(a, b):
            diff = (x.int() - y.int()).abs()
            assert x.shape == y.shape and x.dtype == torch.uint8 and x.device.type == "cuda"
            assert diff.float().mean() < 1.0 and diff.max() <= 2, (other, diff.float().mean(), diff.max())


def test_the_decoder_benchmark_runs_alone_and_beside_a_load(files, tmp_path, capsys):
    """scripts/perf/jpeg_decoders.py (each decoder alone and beside a training loop) on a CPU
    device: a row per decoder, rates for both conditions; a decoder the trainer does not have, a
    load that cannot train and a folder without JPEGs are refused with exit 2 instead of hanging
    or a traceback."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location(
        "jpeg_decoders", Path(__file__).resolve().parents[1] / "scripts" / "perf" / "jpeg_decoders.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    (tmp_path / "train" / "a").mkdir(parents=True)
    for k, path in enumerate(files["jpeg"]):
        os.link(path, tmp_path / "train" / "a" / f"{k}.JPEG")
    common = [str(tmp_path), "--device", "cpu", "--batch-size", "2", "--passes", "1", "--load-size", "32"]
    # the load on the default stream and profiled, then on a stream of its own; every decoder the
    # trainer has by default (TorchCodec's row says where it is not installed)
    for extra in (["--profile"], ["--load-stream", "side"]):
        assert bench.main(common + ["--load-batch", "2"] + extra) == 0
        out = capsys.readouterr().out
        for name in ("torchvision", "torchcodec"):
            row = next(line for line in out.splitlines() if line.startswith(f"| {name} |"))
            if name != "torchvision" and "not available" in row:
                continue
            cells = [c.strip() for c in row.split("|")[2:-1]]
            assert float(cells[0].split()[0]) > 0 and float(cells[2].split()[0]) > 0 and 0 < float(cells[1]) <= 1.05, \
                cells
        assert ("one pass beside the load" in out) == (extra == ["--profile"])
    for decoders in ("nvimgcodec", "torchvision,nvjpeg:gpu", ","):
        assert bench.main(common + ["--load", "none", "--decoders", decoders]) == 2
        assert f"--decoders {decoders!r}: give GPU JPEG decoders of the trainer" in capsys.readouterr().err
    assert bench.main(common + ["--decoders", "torchvision", "--load-batch", "1"]) == 2  # BatchNorm: one image at 1x1
    assert "the load's training step failed" in capsys.readouterr().err
    assert bench.main([str(tmp_path / "train"), "--device", "cpu"]) == 2
