"""The stem max-pool's Triton kernels (imagenet/kernels/maxpool.py, --maxpool-kernel) against torch's max-pool.

On a CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: the
variable is read when the kernels are defined); on a GPU, compiled, also inside torch.compile,
and through main.py in tests/test_gpu_runs.py.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from imagenet.base.errors import UserError
from imagenet.kernels.maxpool import StemMaxPool, is_stem_pool
from imagenet.models.registry import create_model, use_stem_kernels, has_stem_kernels
from tests.helpers import interpreted

REPO = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
# odd/even sizes, C over one block, 1-px sides, more output columns than a forward program takes
SHAPES = [(2, 5, 7, 8), (1, 70, 9, 6), (2, 3, 1, 2), (1, 2, 2, 1), (1, 3, 5, 70)]


def compare(device: str = "cpu", dtypes=("float32", "float16")) -> list:
    """Kernel vs F.max_pool2d on few-valued inputs (many ties), a NaN, integer gradients (exact
    sums) and a gradient that is not channels_last: forward, backward and layout, per case."""
    from imagenet.kernels import maxpool
    g = torch.Generator().manual_seed(0)
    out = []
    for name in dtypes:
        dtype = getattr(torch, name)
        for n, c, h, w in SHAPES:
            x = torch.randint(0, 4, (n, c, h, w), generator=g).to(dtype)
            if h * w > 4:
                x[0, 0, 1, 1] = float("nan")
            x = x.to(device).contiguous(memory_format=torch.channels_last)
            a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
            ya, yb = StemMaxPool()(a), F.max_pool2d(b, 3, 2, 1)
            grad = torch.randint(-8, 8, ya.shape, generator=g).to(dtype).to(device).contiguous()  # NCHW
            ya.backward(grad)
            yb.backward(grad)
            out.append({"case": f"{name} {n}x{c}x{h}x{w}", "kernel": maxpool.takes(x),
                        "forward": torch.equal(ya.nan_to_num(-1), yb.nan_to_num(-1)),
                        "backward": torch.equal(a.grad, b.grad),
                        "channels_last": ya.is_contiguous(memory_format=torch.channels_last)
                        and a.grad.is_contiguous(memory_format=torch.channels_last)})
    return out


def _check(rows: list) -> None:
    bad = [r for r in rows if not (r["kernel"] and r["forward"] and r["backward"] and r["channels_last"])]
    assert not bad, bad


@pytest.mark.skipif(CUDA, reason="a GPU is here: the compiled kernels are tested instead")
def test_kernels_match_torch_under_the_interpreter():
    pytest.importorskip("triton")
    _check(interpreted("test_maxpool", "compare()"))


def test_without_the_kernels_the_module_is_torchs_max_pool():
    # A CPU tensor (no interpreter) or an NCHW one: torch's own max-pool, same values and gradients.
    x = torch.randn(2, 4, 9, 9, requires_grad=True)
    y = StemMaxPool()(x)
    ref = x.detach().clone().requires_grad_(True)
    assert torch.equal(y, F.max_pool2d(ref, 3, 2, 1))
    y.sum().backward()
    F.max_pool2d(ref, 3, 2, 1).sum().backward()
    assert torch.equal(x.grad, ref.grad)


def test_the_model_keeps_torchvisions_state_dict_and_outputs():
    torch.manual_seed(0)
    plain = create_model("resnet18", 10)
    torch.manual_seed(0)
    fast = create_model("resnet18", 10, stem_kernels=True)
    assert isinstance(fast.maxpool, StemMaxPool) and has_stem_kernels(fast) and not has_stem_kernels(plain)
    assert list(plain.state_dict()) == list(fast.state_dict())
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(plain(x), fast(x))
    assert not has_stem_kernels(create_model("resnet18", 10, small_stem=True, stem_kernels=True))


def test_only_the_stem_geometry_counts_as_a_stem_pool():
    assert is_stem_pool(create_model("resnet18", 10).maxpool)
    assert not is_stem_pool(nn.MaxPool2d(2))
    assert not is_stem_pool(nn.MaxPool2d(3, 2, 1, ceil_mode=True))
    assert not is_stem_pool(nn.MaxPool2d(3, 2, 1, dilation=2))
    assert not is_stem_pool(StemMaxPool())  # already swapped


def test_which_runs_choose_the_kernels():
    cpu = torch.device("cpu")
    assert not use_stem_kernels("auto", cpu, True, False)
    assert not use_stem_kernels("torch", cpu, True, False)
    with pytest.raises(UserError, match="--maxpool-kernel triton needs a CUDA GPU"):
        use_stem_kernels("triton", cpu, True, False)
    if CUDA:
        gpu = torch.device("cuda")
        assert use_stem_kernels("auto", gpu, True, False)
        assert not use_stem_kernels("auto", gpu, False, False)  # NCHW: torch's kernel
        assert not use_stem_kernels("auto", gpu, True, True)  # small stem: no max-pool


def test_main_refuses_the_kernels_where_they_cannot_run(tmp_path):
    r = subprocess.run([sys.executable, "main.py", "--dummy", "-a", "resnet18", "--epochs", "1", "-b", "4",
                        "--image-size", "32", "--dummy-train-size", "8", "--dummy-val-size", "4", "-j", "0",
                        "--maxpool-kernel", "triton", "--channels-last", "--output-dir", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--maxpool-kernel triton needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr


# ---------------------------------------------------------------------------------------- GPU

gpu = pytest.mark.gpu


@gpu
def test_compiled_kernels_match_torch_on_the_gpu():
    _check(compare("cuda", ("float32", "float16", "bfloat16")))


@gpu
def test_kernels_match_torch_on_a_resnet_stem_sized_batch():
    # Random (not few-valued) fp16 input of the ResNet-50 stem's shape at a small batch; the
    # gradient is a float one, so the at most four-term sums may round differently from torch's.
    torch.manual_seed(0)
    x = torch.randn(8, 64, 112, 112, device="cuda", dtype=torch.float16).relu()
    x = x.contiguous(memory_format=torch.channels_last)
    a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = StemMaxPool()(a), F.max_pool2d(b, 3, 2, 1)
    assert torch.equal(ya, yb)
    grad = torch.randn_like(ya)
    ya.backward(grad)
    yb.backward(grad)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-3, atol=1e-3)


@gpu
def test_kernels_inside_torch_compile_give_the_eager_results():
    torch.manual_seed(0)
    pool = StemMaxPool()

    def f(x):
        return pool(torch.relu(x) * 2).sum()

    x = torch.randn(4, 16, 15, 16, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ref = f(a)
    ref.backward()
    got = torch.compile(f)(b)
    got.backward()
    assert torch.equal(ref, got) and torch.equal(a.grad, b.grad)
