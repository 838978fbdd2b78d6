"""The fast input pipeline: torchvision's pixels (within one level of its PIL resize), every batch once, normalised right."""

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import transforms
from torchvision.transforms import functional as F

from imagenet.data.decode import TrainDecoder, ValDecoder
from imagenet.data.loaders import collate_skipping
from imagenet.data.prefetch import DeviceLoader
from imagenet.data.transforms import IMAGENET_MEAN, IMAGENET_STD


@pytest.fixture(scope="module")
def photo(tmp_path_factory):
    """A real-looking JPEG (smooth gradients plus texture), 451x300 like ImageNet's typical shapes."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:300, 0:451]
    img = np.stack([(x * 255 / 451), (y * 255 / 300), ((x + y) % 64) * 4], axis=-1)
    img = np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)
    path = tmp_path_factory.mktemp("photo") / "photo.JPEG"
    Image.fromarray(img).save(path, quality=90)
    return str(path)


def reference(path):
    return Image.open(path).convert("RGB")


def assert_pil_equal(got: torch.Tensor, ref: Image.Image) -> None:
    """torch's uint8 resize computes PIL's filter with PIL's fixed-point weights: the same pixels
    but for rare one-level steps (0.2-1.5% of them on this photo, never more than one level)."""
    want = torch.from_numpy(np.asarray(ref).copy())
    assert got.dtype == torch.uint8 and got.shape == want.shape
    diff = (got.int() - want.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 0.02, (int(diff.max()), float((diff > 0).float().mean()))


@pytest.mark.parametrize("params", [(20, 30, 200, 260), (0, 0, 300, 451), (100, 100, 70, 64), (5, 200, 290, 250)])
@pytest.mark.parametrize("flip", [False, True])
def test_train_decode_equals_torchvision_for_the_same_crop(photo, params, flip):
    got = TrainDecoder(64, 0.08, 0.5, draft=False).decode(Image.open(photo), params, flip)
    ref = F.resized_crop(reference(photo), *params, [64, 64])
    if flip:
        ref = F.hflip(ref)
    assert got.dtype == torch.uint8 and got.shape == (64, 64, 3)
    assert_pil_equal(got, ref)


@pytest.mark.parametrize("size, resize", [(64, 73), (224, 256), (32, 32)])
def test_val_decode_equals_resize_then_center_crop(photo, size, resize):
    got = ValDecoder(size, resize)(photo)
    ref = F.center_crop(F.resize(reference(photo), resize), size)
    assert_pil_equal(got, ref)


@pytest.fixture(scope="module")
def imagenet_sized(tmp_path_factory):
    """An ImageFolder of real photos (scikit-image's samples) scaled up to two of ImageNet's
    shapes, 1024x683 and 1601x1203, as JPEGs: large enough for libjpeg's reduced-scale decode."""
    data = pytest.importorskip("skimage.data")
    root = tmp_path_factory.mktemp("imagenet_sized")
    for name, size in (("coffee", (1024, 683)), ("chelsea", (1601, 1203))):
        for split in ("train", "val"):
            (root / split / name).mkdir(parents=True)
            Image.fromarray(getattr(data, name)()).resize(size, Image.BICUBIC).save(root / split / name / "a.JPEG",
                                                                                    quality=90)
    return root


@pytest.mark.parametrize("crop, resize", [(224, 232), (224, 256)])
@pytest.mark.parametrize("flags", [[], ["--no-jpeg-draft"]], ids=["default", "no-jpeg-draft"])
def test_fast_validation_is_torchvisions_resize_and_center_crop(imagenet_sized, crop, resize, flags):
    """What --data-pipeline classic runs (torchvision's Resize + CenterCrop), within one level, by
    default: validation never decodes at reduced DCT scale."""
    from imagenet.base.config import parse_config
    from imagenet.data.loaders import build_datasets
    cfg = parse_config([str(imagenet_sized), "--image-size", str(crop), "--val-resize", str(resize), *flags])
    val = build_datasets(cfg, str(imagenet_sized)).val
    torchvisions = transforms.Compose([transforms.Resize(resize), transforms.CenterCrop(crop)])
    for i, (path, _) in enumerate(val.samples):
        got, _, bad = val[i]
        assert bad is None
        want = torch.from_numpy(np.asarray(torchvisions(reference(path))).copy())
        assert got.shape == want.shape == (crop, crop, 3)
        assert int((got.int() - want.int()).abs().max()) <= 1, path


def test_draft_decode_stays_within_a_few_levels(photo):
    # Decoding at 1/2 scale inside the DCT, then resizing, approximates the full decode closely.
    params = (0, 0, 300, 451)
    exact = TrainDecoder(64, 0.08, 0.5, draft=False).decode(Image.open(photo), params, False).float()
    fast = TrainDecoder(64, 0.08, 0.5, draft=True).decode(Image.open(photo), params, False).float()
    assert (fast - exact).abs().mean() < 4.0  # of 255 levels


def test_train_decoder_draws_crops_like_random_resized_crop(photo):
    """Same torch seed -> same crop box and flip as torchvision's RandomResizedCrop + flip."""
    torch.manual_seed(3)
    got = TrainDecoder(48, 0.25, 0.5, draft=False)(photo)
    torch.manual_seed(3)
    tf = transforms.Compose([transforms.RandomResizedCrop(48, scale=(0.25, 1.0)), transforms.RandomHorizontalFlip(0.5)])
    assert_pil_equal(got, tf(reference(photo)))


def test_device_loader_normalises_like_to_tensor_and_normalize(photo):
    img = ValDecoder(32, 40)(photo)
    # the normalisation alone, on the decoder's own pixels (their resize: the tests above)
    ref = transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)(transforms.ToTensor()(Image.fromarray(img.numpy())))
    batch = [(img, 1, None), (img, 2, None)]
    for channels_last in (False, True):
        loader = DeviceLoader([collate_skipping(batch)], torch.device("cpu"), channels_last, IMAGENET_MEAN, IMAGENET_STD)
        (images, targets, skipped), = list(loader)
        assert images.shape == (2, 3, 32, 32) and images.dtype == torch.float32
        assert images.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        torch.testing.assert_close(images[0], ref, rtol=0, atol=1e-5)
        assert targets.tolist() == [1, 2] and skipped == []


def test_on_a_cpu_the_workers_normalise_and_the_training_process_only_passes_batches_on(photo):
    """Training on a CPU, the collate in the workers makes the float batch; what reaches the loop
    is what the device-side conversion of the uint8 batch gives, bit for bit."""
    from imagenet.data.loaders import CollateNormalized, collate_for
    img = ValDecoder(32, 40)(photo)
    batch = [(img, 1, None), (img.flip(1).contiguous(), 2, None), (None, 0, "bad.JPEG")]
    collate = collate_for(torch.device("cpu"))
    assert isinstance(collate, CollateNormalized) and collate_for(torch.device("cuda")) is collate_skipping
    images, targets, skipped = collate(batch)
    assert images.dtype == torch.float32 and images.shape == (2, 3, 32, 32) and skipped == ["bad.JPEG"]
    want, = list(DeviceLoader([collate_skipping(batch)], torch.device("cpu"), True, IMAGENET_MEAN, IMAGENET_STD))
    for channels_last in (False, True):
        got, = list(DeviceLoader([collate(batch)], torch.device("cpu"), channels_last, IMAGENET_MEAN, IMAGENET_STD))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], targets)
        assert got[0].is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    loader = DataLoader([(img, 1, None)] * 4, batch_size=2, num_workers=1, collate_fn=collate)
    assert all(b[0].dtype == torch.float32 for b in loader)  # through a worker process (pickled)


class _Numbered(torch.utils.data.Dataset):
    def __len__(self):
        return 37

    def __getitem__(self, i):
        return torch.full((4, 4, 3), i % 256, dtype=torch.uint8), i, None


@pytest.mark.parametrize("background", [False, True], ids=["inline", "background-thread"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_device_loader_yields_every_batch_exactly_once(device, background):
    loader = DeviceLoader(DataLoader(_Numbered(), batch_size=5, collate_fn=collate_skipping, num_workers=2),
                          torch.device(device), True, (0.0, 0.0, 0.0), (1 / 255, 1 / 255, 1 / 255),
                          background=background)
    seen = []
    for images, targets, _ in loader:
        assert images.device.type == device
        # normalisation with mean 0, std 1/255 gives back the raw value: check batch contents
        assert torch.equal(images[:, 0, 0, 0].round().long().cpu(), targets.cpu() % 256)
        seen += targets.cpu().tolist()
    assert seen == list(range(37))
    assert len(loader) == 8


def _background_loader(dataset, **kw):
    return DeviceLoader(DataLoader(dataset, batch_size=5, collate_fn=collate_skipping, **kw), torch.device("cpu"),
                        False, (0.0, 0.0, 0.0), (1 / 255, 1 / 255, 1 / 255), background=True)


def test_background_loader_stops_its_threads_when_the_loop_breaks_and_starts_again():
    """An early stop (--prof, preemption) must leave no thread on the loader's iterator: with
    persistent workers the next epoch's iterator is the same object. Both threads (the decode
    thread, the finishing thread) are ended and joined."""
    import threading

    def threads():
        return sorted(t.name for t in threading.enumerate() if t.name in ("batch-decode", "batch-finish"))
    loader = _background_loader(_Numbered(), num_workers=2, persistent_workers=True)
    for _ in loader:
        assert threads() == ["batch-decode", "batch-finish"]
        break
    assert threads() == []
    seen = [i for _, targets, _ in loader for i in targets.tolist()]
    assert seen == list(range(37))


class _FailsAt(torch.utils.data.Dataset):
    def __len__(self):
        return 20

    def __getitem__(self, i):
        if i == 12:
            raise ValueError("item 12 is broken")
        return torch.zeros(4, 4, 3, dtype=torch.uint8), i, None


def test_background_loader_raises_the_loaders_error_in_the_training_thread():
    seen = []
    with pytest.raises(ValueError, match="item 12 is broken"):
        for _, targets, _ in _background_loader(_FailsAt(), num_workers=0):
            seen += targets.tolist()
    assert seen == list(range(10))  # the batches before the broken one arrived, in order


def test_unreadable_batch_passes_through_untouched():
    empty = (torch.empty(0), torch.empty(0, dtype=torch.long), ["bad.jpg"])
    (images, targets, skipped), = list(DeviceLoader([empty], torch.device("cpu"), False, IMAGENET_MEAN,
                                                    IMAGENET_STD))
    assert targets.numel() == 0 and skipped == ["bad.jpg"]


@pytest.mark.parametrize("policy", ["randaugment", "trivialaugment", "autoaugment"])
def test_augment_policies_run_in_both_pipelines_and_are_seeded_per_sample(photo, policy):
    from imagenet.data.transforms import augment_policy, train_transform
    fast = TrainDecoder(32, 0.5, 0.5, draft=False, augment=augment_policy(policy))
    torch.manual_seed(7)
    a = fast(photo)
    torch.manual_seed(7)
    b = fast(photo)
    assert a.shape == (32, 32, 3) and a.dtype == torch.uint8 and torch.equal(a, b)
    classic = train_transform(32, 0.5, 0.5, policy, erase=0.5)(reference(photo))
    assert classic.shape == (3, 32, 32)


def test_random_erasing_on_uint8_paints_the_mean_colour(photo):
    erase = transforms.RandomErasing(1.0, value=[round(255 * m) for m in IMAGENET_MEAN])
    out = TrainDecoder(32, 1.0, 0.0, draft=False, erase=erase)(photo)
    mean = torch.tensor([round(255 * m) for m in IMAGENET_MEAN], dtype=torch.uint8)
    painted = (out == mean).all(dim=-1)
    assert painted.sum() >= 0.02 * 32 * 32  # RandomErasing's smallest area
    # after normalisation on the device, the painted pixels are ~0, as in the classic pipeline
    (x, _, _), = list(DeviceLoader([collate_skipping([(out, 0, None)])], torch.device("cpu"), False,
                                   IMAGENET_MEAN, IMAGENET_STD))
    assert x[0][:, painted].abs().max() < 0.02


def test_low_resolution_training_with_a_full_size_validation_crop(digits, tmp_path):
    from imagenet.base.config import parse_config
    from imagenet.data.loaders import build_datasets
    cfg = parse_config([digits, "--image-size", "16", "--val-crop", "24", "--val-resize", "28"])
    data = build_datasets(cfg, digits)
    assert data.train[(0, 1)][0].shape == (16, 16, 3)
    assert data.val[0][0].shape == (24, 24, 3)
    from imagenet.base.errors import UserError
    with pytest.raises(UserError, match="--val-crop"):
        parse_config([digits, "--val-crop", "300"])
