"""scripts/perf/step_matrix.py (row names, the kernel-class account) and bench.py's --inductor option."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / "perf" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


step_matrix = _load("step_matrix")


def test_row_names_become_bench_flags():
    flags = step_matrix.row_flags("ro-b384-cdt-mp").split()
    assert flags == ["--precision", "fp16", "--maxpool-kernel", "triton", "--bn-kernel", "torch", "--compile",
                     "reduce-overhead", "--batch-size", "384", "--tune-kernels"]
    # every speed setting is named, so a dummy: row through main.py takes none of its defaults
    assert step_matrix.row_flags("eager") == "--precision fp16 --maxpool-kernel torch --bn-kernel torch --compile off"
    assert "--bn-kernel triton" in step_matrix.row_flags("ro-bn-mp")
    assert "--precision amp-bf16" in step_matrix.row_flags("default-bf16")


def test_typed_rows_leave_the_speed_settings_to_main_and_take_lars_and_accumulation():
    args = type("A", (), {"arch": "resnet50", "image_size": 224})()
    cmd = step_matrix.dummy_command(step_matrix.check_row("dummy:typed-b400-lars"), args, 256, 10, "/tmp/x")
    assert "-b 400" in cmd and "--fp16" in cmd and "--optimizer lars" in cmd
    assert not any(f in cmd for f in ("--compile", "--bn-kernel", "--maxpool-kernel", "--optimizer-impl"))
    assert "--accum-steps 8" in step_matrix.row_flags("default-b3200-accum8-lars")
    for bench_row in ("typed-b400", "default-accum8"):  # bench.py has no such settings
        with pytest.raises(SystemExit, match="main.py's"):
            step_matrix.check_row(bench_row)
    assert step_matrix.classify("_master_trust").startswith("optimizer")  # the fp16 step's LARS kernel


@pytest.mark.parametrize("name, fragment", [("fast", "unknown mode 'fast'"), ("ro-zz", "unknown modifier 'zz'")])
def test_unknown_row_names_say_what_is_known(name, fragment):
    with pytest.raises(SystemExit, match=fragment):
        step_matrix.row_flags(name)


def test_a_dummy_row_runs_main_with_the_same_flags():
    args = type("A", (), {"arch": "resnet50", "image_size": 224})()
    cmd = step_matrix.dummy_command(step_matrix.row_flags("ro-b384-mp"), args, 256, 10, "/tmp/x")
    assert "main.py --dummy" in cmd and "-b 384" in cmd and "--fp16" in cmd and "--maxpool-kernel triton" in cmd
    assert "--compile reduce-overhead" in cmd and "--batch-size" not in cmd and "--precision" not in cmd
    assert "--dummy-train-size 3840" in cmd


@pytest.mark.parametrize("kernel, cls", [
    ("void cudnn::batchnorm_fwtr_nhwc_semiPersist<__half, float>", "batchnorm"),
    ("sm90_xmma_dgrad_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc", "convolution"),
    ("nvjet_sm90_hsh_256x128_64x4_1x2_h_bz_coopA_TNT", "convolution"),
    ("triton_red_fused__native_batch_norm_legit_functional_9", "inductor reduction"),
    ("triton_poi_fused__native_batch_norm_legit_functional_add_relu_12", "inductor pointwise"),
    ("triton_poi_fused_add_max_pool2d_with_indices_backward_63", "max-pool"),
    ("_stem_maxpool_backward", "max-pool"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedSgdMathFunctor>", "optimizer"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("void at::native::vectorized_elementwise_kernel<8, CUDAFunctor_add<c10::Half>>", "elementwise"),
])
def test_kernels_fall_into_their_class(kernel, cls):
    assert step_matrix.classify(kernel).startswith(cls)


def test_the_account_adds_up_to_the_step(tmp_path):
    path = tmp_path / "p.json"
    ops = [{"name": "aten::convolution", "calls": 2, "self_device_us": 0.0, "kernel": False},
           {"name": "sm90_xmma_fprop_implicit_gemm", "calls": 2, "self_device_us": 6000.0, "kernel": True},
           {"name": "triton_red_fused__native_batch_norm_legit_functional_1", "calls": 2, "self_device_us": 2000.0,
            "kernel": True}]
    path.write_text(json.dumps({"steps": 2, "ops": ops}))
    rows = step_matrix.kernel_account(str(path), step_ms=5.0)
    assert [(cls.split(" ")[0], ms) for cls, ms, _ in rows] == [("convolution", 3.0), ("inductor", 1.0), ("GPU", 1.0)]
    assert sum(share for _, _, share in rows) == pytest.approx(1.0)


def test_bench_sets_inductor_options_and_rejects_unknown_ones():
    sys.path.insert(0, str(REPO / "scripts" / "perf"))
    bench = _load("bench")
    import torch._inductor.config as inductor
    before = (inductor.conv_1x1_as_mm, inductor.max_autotune_gemm_backends)
    try:
        bench.set_inductor_options(["conv_1x1_as_mm=True", "max_autotune_gemm_backends=ATEN"])
        assert inductor.conv_1x1_as_mm is True and inductor.max_autotune_gemm_backends == "ATEN"
    finally:
        inductor.conv_1x1_as_mm, inductor.max_autotune_gemm_backends = before
    with pytest.raises(ValueError, match="no option 'no_such_knob'"):
        bench.set_inductor_options(["no_such_knob=1"])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        bench.set_inductor_options(["conv_1x1_as_mm"])


def test_the_tests_step_reports_pytests_summary(tmp_path):
    (tmp_path / "test_two.py").write_text("def test_a():\n    pass\n\n\ndef test_b():\n    assert False\n")
    log = tmp_path / "log.txt"
    with open(log, "w") as fh:
        result = step_matrix.run_tests(str(tmp_path / "test_two.py"), 120, fh)
    assert result["rc"] == 1 and "1 failed, 1 passed" in result["summary"]
    assert "assert False" in log.read_text()


def test_the_bn_sweep_credits_each_compiled_kernel_to_its_settings(monkeypatch):
    """scripts/perf/bn_kernel_sweep.py: a kernel's registers, spills and shared memory belong to the
    settings it was compiled for (tile, warps, stages), so a candidate that differs only in
    programs a multiprocessor, or equals the settings compiled before the sweep, reports them
    too; the programs that fit a multiprocessor count registers, warps and shared memory."""
    pytest.importorskip("triton")
    sweep = _load("bn_kernel_sweep")
    from types import SimpleNamespace as K

    from imagenet.kernels import bnlaunch
    kernels = []
    monkeypatch.setattr(sweep, "compiled", lambda kernel: list(kernels))
    known, seen = {}, set()
    kernels.append(K(n_regs=128, n_spills=0, metadata=K(shared=65536)))
    assert sweep.resources("stats", bnlaunch.Launch(4096, 4, 2, 4), known, seen) == (128, 0, 65536)
    assert sweep.resources("stats", bnlaunch.Launch(4096, 4, 4, 4), known, seen) == (128, 0, 65536)  # same kernel
    kernels.append(K(n_regs=64, n_spills=2, metadata=K(shared=0)))
    assert sweep.resources("stats", bnlaunch.Launch(4096, 8, 2, 1), known, seen) == (64, 2, 0)
    assert sweep.resources("stats", bnlaunch.Launch(4096, 4, 2, 4), known, seen) == (128, 0, 65536)
    assert sweep.resources("grad", bnlaunch.Launch(2048, 4, 2, 4), known, seen) == (None, None, None)
    assert sweep.resident(128, 0, 4) == 4  # 65536 / (128 * 32 * 4)
    assert sweep.resident(128, 65536, 4) == 3  # 228 KB / 65 KB
    assert sweep.resident(32, 0, 16) == 4  # at most 64 warps
    assert sweep.resident(None, None, 4) is None


def test_the_bn_sweep_times_the_layers_as_the_fused_model_runs_them():
    """Every BatchNorm of ResNet-50 once, in order; the residual BatchNorms of all blocks but the
    last take two gradients (fusedresnet.fuse_resnet forks those outputs), and their gradient sums count one
    pass more."""
    pytest.importorskip("triton")
    sweep = _load("bn_kernel_sweep")
    from imagenet.kernels import bnlaunch
    layers = sweep.resnet50_layers(2)
    assert len(layers) == 53
    forked = [layer for layer in layers if layer[6]]
    assert len(forked) == 15 and all(relu and res for _, _, _, _, relu, res, _, _ in forked)
    assert not layers[-1][6] and layers[-1][5]  # the last block's output feeds the pooling alone
    # each stage's first block: its residual add applies the downsample's BatchNorm, which follows it
    applies = [i for i, layer in enumerate(layers) if layer[7] == "applies"]
    assert len(applies) == 4 and all(layers[i + 1][7] == "folded" and not layers[i + 1][4] for i in applies)
    x = torch.empty(2, 8, 4, 4)
    one = {"x": x, "r": x, "dy2": None, "mask": bnlaunch.MASK_FROM_BITS}
    two = dict(one, dy2=x)
    # the second gradient is read by the gradient sums; the input gradients read the kept masked gradient alone
    assert sweep.phase_bytes("grad", two) - sweep.phase_bytes("grad", one) == x.numel() * 2
    assert sweep.phase_bytes("grad_input", two) == sweep.phase_bytes("grad_input", one) == 3 * x.numel() * 2
    plain = {"x": x, "r": None, "dy2": None, "mask": bnlaunch.MASK_FROM_INPUT}
    assert sweep.phase_bytes("grad_input", plain) == 3 * x.numel() * 2
    assert sweep.phase_bytes("apply", one) == (3 * x.numel() * 2) + x.numel() * 2 // 16  # the mask's bits
    raw = dict(one, shortcut="applies")  # the gradient sums read the shortcut's raw input as well
    assert sweep.phase_bytes("grad", raw) - sweep.phase_bytes("grad", one) == x.numel() * 2
    folded = dict(plain, shortcut="folded")
    assert sweep.phase_bytes("apply", folded) == sweep.phase_bytes("grad", folded) == 0
    assert sweep.phase_call("apply", folded) is None and sweep.phase_call("grad", folded) is None


def test_the_family_phase_packs_its_compilations_and_runs_each_row_as_typed():
    """gpu_verify.py family: the compiled rows go in precompile groups under the memory budget
    (each row once), and each row is main.py as a user types it (the typed row no speed flag)."""
    sys.path.insert(0, str(REPO / "scripts" / "perf"))
    from verify import family
    rows = [(a, r) for a in family.ARCHS for r in family.COMPILED]
    groups = family.pack(rows, 100)
    assert sorted(r for g in groups for r in g) == sorted(rows)
    assert all(sum(family.estimate_gib(*r) for r in g) <= 100 for g in groups if len(g) > 1)
    assert len(family.pack(rows, 1)) == len(rows)  # nothing fits: one a group
    typed = family.command("resnet152", "typed", 2, 25)
    assert "main.py --dummy -a resnet152 -b 256 --fp16 --epochs 2 --dummy-train-size 6400 " in typed
    assert not any(f in typed for f in ("--compile", "--bn-kernel", "--channels-last", "--maxpool-kernel"))
    eager = family.command("resnext50_32x4d", "eager", 2, 25)
    assert "--fp16 --compile off --no-channels-last --bn-kernel torch --maxpool-kernel torch" in eager
    assert "-b 256 --epochs 1 --dummy-train-size 768" in family.command("resnet18", "fp32", 1, 3)
