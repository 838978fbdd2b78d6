"""--decode cpu on a GPU: workers crop, the batched kernel resizes and flips (imagenet.data.images.cropbatch).

The kernel runs under Triton's interpreter on a CPU (in a subprocess: TRITON_INTERPRET is read
when the kernel is defined), compiled on a GPU.
"""

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from imagenet.base.config import Config
from imagenet.data.images.cropbatch import CpuCrop, CropBatch, TrainCropReader
from imagenet.data.decode import TrainDecoder, path_identity
from imagenet.data.images.folder import SafeImageFolder
from imagenet.data.loaders import build_datasets, collate_skipping
from imagenet.data.transforms import resize_on_device, set_output_size
from imagenet.kernels import gpugeometry
from tests.helpers import interpreted, photo

SHAPES = [(375, 500), (500, 375), (97, 131), (64, 64), (240, 180)]


def write_images(folder: Path) -> list:
    """JPEGs of several shapes, a PNG and a CMYK JPEG (every format takes this path)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (h, w) in enumerate(SHAPES):
        paths.append(str(folder / f"{i}.JPEG"))
        photo(h, w, i).save(paths[-1], "JPEG", quality=90)
    paths.append(str(folder / "png.png"))
    photo(70, 90, 8).save(paths[-1], "PNG")
    paths.append(str(folder / "cmyk.JPEG"))
    photo(80, 100, 7).convert("CMYK").save(paths[-1], "JPEG")
    return paths


def against_pil(folder: str, size: int = 56, draft: bool = True) -> dict:
    """The batch the kernel makes from the workers' crops vs the workers' own PIL resize, for
    the same seeds: the largest and mean difference, and whether every flip landed."""
    paths = write_images(Path(folder))
    make = lambda: TrainDecoder(size, 0.08, 0.5, draft=draft)  # noqa: E731
    crops, wants = [], []
    for k, path in enumerate(paths):
        torch.manual_seed(k)
        crops.append(TrainCropReader(make())(path))
        torch.manual_seed(k)
        wants.append(make()(path))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    got = CropBatch.collate(crops).to_device(device).cpu()
    want = torch.stack(wants)
    diff = (got.int() - want.int()).abs()
    return {"shape": list(got.shape), "max": int(diff.max()), "mean": float(diff.float().mean()),
            "flips": sum(c.flip for c in crops)}


def check(res: dict, n: int, size: int = 56) -> None:
    assert res["shape"] == [n, size, size, 3]
    # PIL's filter computed in float and rounded once; PIL rounds to 8 bits between its
    # horizontal and vertical passes, so about one pixel in six is one level off, never more
    assert res["max"] <= 1 and res["mean"] < 0.25, res
    assert 0 < res["flips"] < n  # both kinds are in the batch


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the compiled kernel is tested instead")
def test_kernel_resizes_the_workers_crops_as_pil_does_under_the_interpreter(tmp_path):
    pytest.importorskip("triton")
    # 30 px: 900 output pixels an image, 3.5 of the kernel's blocks (gpugeometry.BLOCK), so a
    # partial last block is still covered; the interpreter takes 3 s where 56 px took 10
    check(interpreted("test_cropbatch", f"against_pil({str(tmp_path)!r}, size=30)"), len(SHAPES) + 2, size=30)
    assert (30 * 30) % gpugeometry.BLOCK, "30 px no longer leaves a partial last block"


@pytest.mark.gpu
@pytest.mark.parametrize("draft", [True, False])
def test_kernel_resizes_the_workers_crops_as_pil_does_on_the_gpu(tmp_path, draft):
    check(against_pil(str(tmp_path), size=56, draft=draft), len(SHAPES) + 2)
    check(against_pil(str(tmp_path / "224"), size=224, draft=draft), len(SHAPES) + 2, size=224)


def test_workers_ship_each_crop_unresized_with_its_table(tmp_path):
    """Through real worker processes: one buffer holding every crop's pixels, the table pointing
    at each, the flips drawn per sample, an unreadable file skipped."""
    root = tmp_path / "train"
    write_images(root / "a")
    (root / "b").mkdir()
    (root / "b" / "broken.JPEG").write_bytes(b"not a jpeg")
    ds = SafeImageFolder(str(root), TrainCropReader(TrainDecoder(32, 0.3, 0.5)), loader=path_identity)
    keys = [(i, 1000 + i) for i in range(len(ds))]
    loader = DataLoader(ds, batch_size=len(ds), sampler=keys, num_workers=1, collate_fn=collate_skipping)
    images, targets, skipped = next(iter(loader))
    assert isinstance(images, CropBatch) and len(images) == len(ds) - 1 and images.size == 32
    assert [Path(p).name for p in skipped] == ["broken.JPEG"] and len(targets) == len(images)
    offset = 0
    for row, (index, seed) in enumerate(k for k in keys if not ds.samples[k[0]][0].endswith("broken.JPEG")):
        torch.manual_seed(seed)
        want = ds.transform(ds.samples[index][0])
        h, w = want.image.shape[:2]
        assert images.ints[row, gpugeometry.SRC] == offset
        assert images.ints[row, gpugeometry.HEIGHT:gpugeometry.WIDTH + 1].tolist() == [h, w]
        assert images.ints[row, gpugeometry.FLIP] == int(want.flip)
        assert images.scales[row].tolist() == pytest.approx([h / 32, w / 32])
        assert torch.equal(images.flat[offset:offset + h * w * 3].view(h, w, 3), want.image)
        offset += h * w * 3
    assert offset == images.flat.numel()


def test_the_crop_is_the_region_the_worker_resize_reads(tmp_path):
    """Crop, then PIL's resize, is exactly what the workers do when they resize themselves."""
    path = write_images(tmp_path)[0]
    dec = TrainDecoder(48, 0.08, 0.5)
    torch.manual_seed(5)
    crop = TrainCropReader(dec)(path)
    torch.manual_seed(5)
    whole = dec(path)
    from PIL import Image
    resized = Image.fromarray(crop.image.numpy()).resize((48, 48), Image.BILINEAR)
    if crop.flip:
        resized = resized.transpose(Image.FLIP_LEFT_RIGHT)
    assert torch.equal(torch.from_numpy(__import__("numpy").array(resized)), whole)
    assert isinstance(crop, CpuCrop) and crop.out == 48 and min(crop.image.shape[:2]) >= 1


def test_resize_moves_to_the_device_only_where_the_kernel_runs_and_no_recipe_needs_pixels(tmp_path, monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(gpugeometry, "available", lambda device: device.type == "cuda")
    assert resize_on_device(Config(), cuda)
    assert not resize_on_device(Config(), torch.device("cpu"))
    assert not resize_on_device(Config(), None)
    assert not resize_on_device(Config(decode="gpu"), cuda)  # nvJPEG's own path
    assert not resize_on_device(Config(data_pipeline="classic"), cuda)
    assert not resize_on_device(Config(auto_augment="randaugment"), cuda)
    assert not resize_on_device(Config(random_erase=0.25), cuda)
    write_images(tmp_path / "train" / "a")
    write_images(tmp_path / "val" / "a")
    data = build_datasets(Config(data=str(tmp_path)), str(tmp_path), device=cuda)
    assert isinstance(data.train.transform, TrainCropReader)
    set_output_size(data.train.transform, 40)  # --progressive-resize reaches the crop's output size
    assert data.train.transform.size == 40 and data.train.transform.cpu.size == 40
    assert isinstance(build_datasets(Config(data=str(tmp_path)), str(tmp_path)).train.transform, TrainDecoder)
