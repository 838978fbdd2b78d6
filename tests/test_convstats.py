"""``--bn-kernel cudnn``: the BatchNorm statistics made in the convolution's epilogue by a cuDNN
fusion graph (imagenet/kernels/convstats.py), their finishing kernel and the blocks that use them
(imagenet/kernels/fusedbn.py, imagenet/models/fusedresnet.py), and when ``auto`` chooses them (imagenet/training/defaults.py).

On a CPU the op runs torch's convolution and sums under Triton's interpreter, so the blocks' plumbing,
the finishing kernel and the gradients are checked here; the cuDNN graphs themselves on a GPU."""

import dataclasses
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from imagenet.base.config import parse_config
from imagenet.base.errors import UserError
from imagenet.kernels import convstats
from imagenet.models.registry import use_conv_stats
from imagenet.training.defaults import Machine, resolve
from tests.helpers import ONE_THREAD, Children

REPO = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()


def _lines(plan) -> str:
    return "\n".join(c.line() for c in plan.choices)


def test_auto_takes_cudnns_statistics_where_the_package_runs_under_cuda_graphs():
    here = Machine("cuda", "gpu", triton=True, no_conv_stats=None)
    plan = resolve(parse_config(["--dummy", "--fp16"]), here)
    assert plan.bn_kernel == "cudnn" and plan.compile == "reduce-overhead"
    assert "statistics made by cuDNN's fused convolutions" in _lines(plan) and "--bn-kernel triton" in _lines(plan)
    # without CUDA graphs every cuDNN graph would be launched from Python: the Triton statistics
    plan = resolve(parse_config(["--dummy", "--fp16", "--compile", "off"]), here)
    assert plan.bn_kernel == "triton" and "without CUDA graphs" in _lines(plan)
    # the user's choice stands
    assert resolve(parse_config(["--dummy", "--fp16", "--bn-kernel", "triton"]), here).bn_kernel == "triton"
    assert resolve(parse_config(["--dummy", "--fp16", "--compile", "off", "--bn-kernel", "cudnn"]),
                   here).bn_kernel == "cudnn"
    # bf16 autocast convolutions are served too; fp32 ones are not: the Triton statistics, said why
    assert resolve(parse_config(["--dummy", "--amp", "--amp-dtype", "bfloat16"]), here).bn_kernel == "cudnn"
    plan = resolve(parse_config(["--dummy"]), here)
    assert plan.bn_kernel == "triton" and "this run is fp32" in _lines(plan)
    plan = resolve(parse_config(["--dummy", "--bn-kernel", "cudnn"]), here)
    assert plan.bn_kernel == "cudnn" and any("in this fp32 run the Triton kernels" in n for n in plan.notes)


def test_without_the_package_auto_keeps_the_triton_statistics_and_says_why_in_one_line():
    why = ("the nvidia-cudnn-frontend package is not installed (pip install -r requirements.txt installs it on "
           "Linux, x86_64 or aarch64)")
    plan = resolve(parse_config(["--dummy", "--fp16"]), Machine("cuda", "gpu", triton=True, no_conv_stats=why))
    assert plan.bn_kernel == "triton"
    said = [c.line() for c in plan.choices if "BatchNorm" in c.line()]
    assert len(said) == 1 and "nvidia-cudnn-frontend package is not installed" in said[0]


def test_the_requirements_install_the_frontend_where_its_wheels_exist():
    """requirements.txt installs nvidia-cudnn-frontend on Linux x86_64 and aarch64 (its wheels:
    CPython 3.9-3.14 for the versions allowed), nowhere else (no sdist: pip would fail there), and
    below 1.29, whose dependencies add NVIDIA's CUTLASS DSL (about 600 MB)."""
    from packaging.requirements import Requirement
    from packaging.version import Version
    lines = [line for line in (REPO / "requirements.txt").read_text().splitlines()
             if line.startswith("nvidia-cudnn-frontend")]
    assert len(lines) == 1, lines
    req = Requirement(lines[0])
    assert Version("1.28.0") in req.specifier and Version("1.29.0") not in req.specifier
    for system, machine, python, installs in (("linux", "x86_64", "3.12", True), ("linux", "aarch64", "3.9", True),
                                              ("linux", "x86_64", "3.14", True), ("linux", "x86_64", "3.15", False),
                                              ("linux", "ppc64le", "3.12", False), ("darwin", "arm64", "3.12", False),
                                              ("win32", "AMD64", "3.12", False)):
        env = {"sys_platform": system, "platform_machine": machine, "python_version": python}
        assert req.marker.evaluate(env) == installs, env


def test_a_cpu_run_never_imports_the_frontend(tmp_path):
    """With the package installed, a CPU run (the demo, CI) never imports it: here a stand-in
    ``cudnn`` that warns when imported, first on the path."""
    fake = tmp_path / "site" / "cudnn"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("import warnings\nwarnings.warn('cudnn imported')\n")
    r = subprocess.run([sys.executable, "-W", "default", "main.py", "--dummy", "-a", "resnet18", "-b", "4",
                        "--epochs", "1", "--image-size", "32", "--val-resize", "32", "--dummy-train-size", "8",
                        "--dummy-val-size", "4", "-j", "0", "--output-dir", str(tmp_path / "out")],
                       cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="0",
                                PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(REPO)])))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "cudnn imported" not in r.stderr and "cudnn" not in r.stdout.lower(), r.stderr[-2000:]


def test_asking_for_cudnn_where_the_package_is_missing_names_the_fix(monkeypatch):
    monkeypatch.setattr(convstats, "_frontend", lambda: None)
    why = convstats.why_unavailable(torch.device("cuda"))
    assert why == ("the nvidia-cudnn-frontend package is not installed (pip install -r requirements.txt installs it "
                   "on Linux, x86_64 or aarch64)")
    monkeypatch.setattr(convstats, "why_unavailable", lambda device, dtype=None: why)
    with pytest.raises(UserError, match=r"--bn-kernel cudnn .*\(pip install -r requirements.txt installs it on "
                                        r"Linux, x86_64 or aarch64\): use --bn-kernel triton"):
        use_conv_stats("cudnn", torch.device("cuda"), "float16")
    assert use_conv_stats("triton", torch.device("cuda"), "float16") is False
    assert use_conv_stats("cudnn", torch.device("cuda"), None) is False  # fp32: the Triton kernels (a note)


def test_the_machine_asks_cudnn_about_the_runs_own_convolution_dtype(monkeypatch):
    from imagenet.parallel.distributed import DistContext
    asked = []
    monkeypatch.setattr(convstats, "why_unavailable", lambda device, dtype=None: asked.append(dtype) or
                        ("cuDNN 9.19.0 has no engine for them in bfloat16 here" if dtype is torch.bfloat16 else None))
    gpu = DistContext("gpu", torch.device("cuda", 0), "test")
    bf16 = Machine.of(gpu, "cpu", None, "auto", "bfloat16")
    assert asked == [torch.bfloat16] and "bfloat16" in bf16.no_conv_stats
    plan = resolve(parse_config(["--dummy", "--amp", "--amp-dtype", "bfloat16"]),
                   dataclasses.replace(bf16, triton=True))
    assert plan.bn_kernel == "triton" and "no engine for them in bfloat16" in _lines(plan)
    assert Machine.of(gpu, "cpu", None, "auto", "float16").no_conv_stats is None and asked[-1] is torch.float16
    fp32 = Machine.of(gpu, "cpu", None, "auto", None)
    assert fp32.no_conv_stats == "not looked up" and len(asked) == 2
    plan = resolve(parse_config(["--dummy"]), dataclasses.replace(fp32, triton=True))
    assert plan.bn_kernel == "triton" and "this run is fp32" in _lines(plan) and "looked up" not in _lines(plan)


FAMILY = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnext50_32x4d", "wide_resnet50_2")


@pytest.mark.parametrize("precision", [["--fp16"], ["--amp"], []], ids=["fp16", "amp", "fp32"])
def test_the_typed_command_takes_every_fast_path_for_the_whole_family(precision):
    """``main.py --dummy -a ARCH -b 256 --fp16`` (and --amp, fp32) on a GPU where cuDNN's statistics
    run: every architecture channels_last, both kernels, CUDA graphs and, in half precision, the
    statistics from the convolutions; ResNeXt's grouped convolutions are the one exception, said in
    the same banner line; fp32 keeps the Triton statistics, said once."""
    here = Machine("cuda", "gpu", triton=True, no_conv_stats=None)
    for arch in FAMILY:
        plan = resolve(parse_config(["--dummy", "-a", arch, "-b", "256", *precision]), here)
        assert (plan.channels_last, plan.maxpool_kernel, plan.compile) == (True, "triton", "reduce-overhead"), arch
        assert plan.bn_kernel == ("cudnn" if precision else "triton"), arch
        bn = [c.line() for c in plan.choices if "BatchNorm" in c.line()]
        assert len(bn) == 1 and not plan.notes, (arch, bn, plan.notes)
        grouped = "grouped 3x3 convolutions, which cuDNN's fused convolution + statistics does not take" in bn[0]
        assert grouped == (arch.startswith("resnext") and bool(precision)), (arch, bn)
        assert precision or "this run is fp32" in bn[0]


def test_asking_for_cudnn_statistics_in_resnext_notes_its_grouped_convolutions():
    here = Machine("cuda", "gpu", triton=True, no_conv_stats=None)
    plan = resolve(parse_config(["--dummy", "-a", "resnext50_32x4d", "--fp16", "--bn-kernel", "cudnn"]), here)
    assert plan.bn_kernel == "cudnn" and len(plan.notes) == 1 and "grouped 3x3" in plan.notes[0], plan.notes
    plan = resolve(parse_config(["--dummy", "-a", "resnet50", "--fp16", "--bn-kernel", "cudnn"]), here)
    assert not plan.notes


def test_the_registry_knows_which_architectures_have_grouped_convolutions():
    """has_grouped_convolutions (what the banner says) against the models themselves, built on the
    meta device (no memory, no initialisation); and the fused convolution refuses grouped ones."""
    import torch.nn as nn
    import torchvision

    from imagenet.base.config import ARCHS
    from imagenet.models.registry import has_grouped_convolutions
    for arch in ARCHS:
        with torch.device("meta"):
            model = getattr(torchvision.models, arch)(weights=None, num_classes=10)
        grouped = any(isinstance(m, nn.Conv2d) and m.groups > 1 for m in model.modules())
        assert has_grouped_convolutions(arch) == grouped, arch
    conv = nn.Conv2d(8, 8, 3, padding=1, groups=4, bias=False)
    x = torch.empty(2, 8, 4, 4).contiguous(memory_format=torch.channels_last)
    assert not convstats.applies(x, conv)


def test_the_precision_names_the_convolutions_dtype_that_cudnn_is_asked_about():
    expected = {("--fp16",): "float16", ("--amp",): "float16", ("--amp", "--amp-dtype", "bfloat16"): "bfloat16",
                (): None}
    for argv, dtype in expected.items():
        assert parse_config(["--dummy", *argv]).half_dtype == dtype, argv


def test_main_refuses_cudnn_statistics_on_a_cpu_with_one_line(tmp_path):
    r = subprocess.run([sys.executable, "main.py", "--dummy", "-a", "resnet18", "-b", "4", "--epochs", "1",
                        "--image-size", "32", "--val-resize", "32", "--dummy-train-size", "8", "--dummy-val-size", "4",
                        "-j", "0", "--bn-kernel", "cudnn", "--output-dir", str(tmp_path)], cwd=REPO,
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="0"))
    assert r.returncode == 2 and "--bn-kernel cudnn needs a CUDA GPU" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


BLOCKS = {  # the family's blocks, small: ResNet-50's, ResNet-18's, ResNeXt's (grouped 3x3 convolutions)
    "bottleneck": dict(layers=[2, 1, 1, 1], width_per_group=16),
    "basic": dict(layers=[1, 1, 1, 1]),
    "grouped": dict(layers=[1, 1, 1, 1], groups=4, width_per_group=8),
}


def _compare_blocks(device: str, dtype: str, batch: int = 2, size: int = 16, compiled: str = "",
                    kind: str = "bottleneck") -> dict:
    """A small ResNet of ``kind``'s blocks (:data:`BLOCKS`) fused with the statistics from its
    convolutions against the same fused without them and against torchvision's modules: outputs,
    gradients and buffers after a step, as relative differences, and the groups of the
    convolutions that made their statistics (called in a child: under the interpreter, or on a GPU)."""
    import copy

    import torch.nn as nn
    from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

    from imagenet.models import fusedresnet
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    ref = ResNet(BasicBlock if kind == "basic" else Bottleneck, num_classes=5, **BLOCKS[kind])
    ref.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    ref = ref.to(device, memory_format=torch.channels_last)
    models = {"torch": ref, "triton": fusedresnet.fuse_resnet(copy.deepcopy(ref)),
              "conv": fusedresnet.fuse_resnet(copy.deepcopy(ref), stats_in_conv=True)}
    x = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=torch.channels_last)
    out, groups, conv_stats = {}, [], convstats.conv_stats
    convstats.conv_stats = lambda x, conv: groups.append(conv.groups) or conv_stats(x, conv)
    for name, m in models.items():
        m.train()
        run = torch.compile(m, mode=compiled) if compiled else m
        with torch.autocast(device, dtype=dt, enabled=dt != torch.float32):
            y = run(x)
        y.float().square().sum().backward()
        # copies: under CUDA graphs the outputs and gradients live in the graphs' memory, which the
        # next model's run overwrites (.float() of a float32 tensor is that tensor)
        out[name] = (y.detach().float().clone(), {n: p.grad.float().clone() for n, p in m.named_parameters()},
                     {n: b.float().clone() for n, b in m.named_buffers()})
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()
    convstats.conv_stats = conv_stats

    def rel(a, b):
        return float((a - b).abs().max() / (b.abs().max() + 1e-12))

    result = {"uses": fusedresnet.uses_conv_stats(models["conv"]) and not fusedresnet.uses_conv_stats(models["triton"]),
              "groups": sorted(set(groups)), "grouped": sum(isinstance(m, nn.Conv2d) and m.groups > 1
                                                          for m in ref.modules())}
    for name, other in (("torch", "torch"), ("triton", "triton"), ("triton_vs_torch", "torch")):
        y, g, b = out[other]
        cy, cg, cb = out["triton" if name == "triton_vs_torch" else "conv"]
        result[name] = {"out": rel(cy, y), "grad": max(rel(cg[k], g[k]) for k in g),
                        "buffers": max(rel(cb[k], b[k]) for k in b if "num_batches" not in k),
                        "batches": all(torch.equal(cb[k], b[k]) for k in b if "num_batches" in k)}
    return result


def _children(codes: dict, env: dict) -> dict:
    """Each of ``codes`` run after ``import tests.test_convstats as t`` in a child of its own, all
    at once (the interpreter keeps one core busy each): name -> the JSON its last line printed."""
    with tempfile.TemporaryDirectory() as folder:
        runs = Children(folder)
        try:
            for name, code in codes.items():
                runs.start(name, [sys.executable, "-c", "import json, sys; sys.path.insert(0, '.'); "
                                  "import tests.test_convstats as t; " + code],
                           dict(os.environ, **(ONE_THREAD if len(codes) > 1 else {}), **env))
            return {name: runs.json(name, timeout=900) for name in codes}
        finally:
            runs.stop()


def _child(code: str, env: dict) -> dict:
    return _children({"run": code}, env)["run"]


@pytest.mark.skipif(CUDA, reason="a GPU is here: the cuDNN graphs are tested instead")
def test_blocks_with_the_statistics_from_their_convolutions_train_as_torchvisions_under_the_interpreter():
    """The family's three kinds of block (ResNet-50's bottleneck, ResNet-18's basic block, ResNeXt's
    grouped bottleneck), a child each: the grouped convolutions are never handed to the fused
    convolution (their BatchNorms make their statistics in a pass of their own), the rest are."""
    runs = _children({k: f"print(json.dumps(t._compare_blocks('cpu', 'float32', batch=3, kind={k!r})))" for k in BLOCKS},
                     {"TRITON_INTERPRET": "1"})
    for kind, r in runs.items():
        assert r["uses"] and r["groups"] == [1], (kind, r)
        assert r["grouped"] == (4 if kind == "grouped" else 0), (kind, r)
        for other in ("torch", "triton"):
            assert r[other]["out"] < 1e-3 and r[other]["grad"] < 3e-2 and r[other]["buffers"] < 1e-3, (kind, r)
            assert r[other]["batches"], (kind, r)


# ---------------------------------------------------------------------------------------- GPU

gpu = pytest.mark.gpu
needs_frontend = pytest.mark.skipif(not CUDA or convstats.why_unavailable(torch.device("cuda")) is not None,
                                    reason="needs CUDA and cuDNN's fused engines (nvidia-cudnn-frontend)")


def _op_against_torch(dtype, n, c, k, hw, kernel, stride) -> dict:
    import torch.nn.functional as F
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    cl = dict(memory_format=torch.channels_last)
    x = torch.randn(n, c, hw, hw + 1, device="cuda", dtype=dt).contiguous(**cl).requires_grad_()
    w = (torch.randn(k, c, kernel, kernel, device="cuda", dtype=dt) / (c * kernel * kernel) ** 0.5
         ).contiguous(**cl).requires_grad_()
    pad = kernel // 2
    y, s, sq = convstats.conv_stats_op(x, w, [stride, stride], [pad, pad])
    ref = F.conv2d(x, w, stride=stride, padding=pad)
    dy = torch.randn_like(ref)
    (y * dy).sum().backward()
    dx, dw = x.grad.clone(), w.grad.clone()
    x.grad, w.grad = None, None
    (ref * dy).sum().backward()
    r32 = ref.detach().float()

    def rel(a, b):
        return float((a.float() - b.float()).abs().max() / (b.float().abs().max() + 1e-12))

    built = [plan is not None for key, plan in convstats._PLANS.plans.items()
             if key[1] == dt and key[2] == tuple(x.shape) and key[4] == tuple(w.shape)]
    return {"built": built == [True], "y": rel(y.detach(), ref.detach()), "sum": rel(s, r32.sum((0, 2, 3))),
            "squares": rel(sq, r32.square().sum((0, 2, 3))), "dx": rel(dx, x.grad), "dw": rel(dw, w.grad),
            "channels_last": y.is_contiguous(memory_format=torch.channels_last), "dtype": str(y.dtype)}


@gpu
@needs_frontend
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(1, 64, 64, 9, 3, 1), (2, 24, 40, 7, 1, 2), (2, 256, 64, 14, 1, 1),
                                   (1, 3, 16, 11, 3, 1)], ids=["b1-3x3", "b2-1x1-s2-odd", "b2-1x1", "b1-3ch"])
def test_the_op_matches_torchs_convolution_and_sums_forward_and_backward(dtype, shape):
    r = _op_against_torch(dtype, *shape)
    tol = 2e-2 if dtype == "bfloat16" else 2e-3
    assert r["channels_last"] and r["dtype"] == f"torch.{dtype}", r
    # cuDNN's graph ran, not the fallback, wherever cuDNN says it has an engine for the dtype (cuDNN
    # 9.19 has none for bfloat16; it may refuse 3 channels)
    engine = convstats.why_unavailable(torch.device("cuda"), getattr(torch, dtype)) is None
    assert r["built"] == engine or (shape[1] == 3 and not r["built"]), (engine, r)
    assert r["y"] < tol and r["dx"] < tol and r["dw"] < tol, r
    assert r["sum"] < 1e-3 and r["squares"] < 1e-3, r


@gpu
@needs_frontend
def test_the_op_replays_inside_a_cuda_graph():
    cl = dict(memory_format=torch.channels_last)
    x = torch.randn(4, 64, 28, 28, device="cuda", dtype=torch.float16).contiguous(**cl)
    w = torch.randn(128, 64, 3, 3, device="cuda", dtype=torch.float16).contiguous(**cl) * 0.05
    eager = convstats.conv_stats_op(x, w, [1, 1], [1, 1])  # builds the plan
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = convstats.conv_stats_op(x, w, [1, 1], [1, 1])
    x.copy_(torch.randn_like(x))
    graph.replay()
    again = convstats.conv_stats_op(x, w, [1, 1], [1, 1])
    torch.cuda.synchronize()
    assert torch.equal(captured[0], again[0]) and not torch.equal(captured[0], eager[0])
    for a, b in zip(captured[1:], again[1:]):  # the sums are added with atomics: equal to rounding
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-3)


@gpu
@needs_frontend
@pytest.mark.parametrize("compiled, kind", [("", "bottleneck"), ("", "basic"), ("", "grouped"),
                                            ("reduce-overhead", "bottleneck")],
                         ids=["eager", "eager-basic", "eager-grouped", "cuda-graphs"])
def test_blocks_with_cudnns_statistics_train_as_torchvisions_on_the_gpu(compiled, kind):
    r = _child(f"print(json.dumps(t._compare_blocks('cuda', 'float16', batch=8, size=32, compiled={compiled!r}, "
               f"kind={kind!r})))", {})
    assert r["uses"] and r["groups"] == [1], r
    # fp16 rounds differently in every path: the statistics from the convolutions may move the
    # results from torch's by no more than twice what the Triton kernels already do, and a little
    floor = {"out": 2e-3, "grad": 2e-2, "buffers": 2e-4}
    for metric, least in floor.items():
        assert r["torch"][metric] <= 2 * r["triton_vs_torch"][metric] + least, (metric, r)
        assert r["triton"][metric] <= 2 * r["triton_vs_torch"][metric] + least, (metric, r)
    assert r["torch"]["batches"] and r["triton"]["batches"], r
