"""Fast by default: what ``auto`` resolves to, as a pure function of the config and the machine
(imagenet/training/defaults.py), and the banner lines that say so."""

import pytest

from imagenet.base.config import parse_config
from imagenet.training.defaults import Machine, resolve

GPU = Machine("cuda", "gpu", triton=True)
DDP = Machine("cuda", "ddp", triton=True)
DP = Machine("cuda", "dp", triton=True)
CPU = Machine("cpu", "cpu", triton=False)
OLD_GPU = Machine("cuda", "gpu", triton=False)


def plan_of(argv, machine):
    return resolve(parse_config(argv), machine)


def settings(plan):
    return plan.channels_last, plan.maxpool_kernel, plan.bn_kernel, plan.compile


def lines(plan):
    return "\n".join(c.line() for c in plan.choices)


@pytest.mark.parametrize("machine", [GPU, DDP], ids=["1-gpu", "ddp"])
@pytest.mark.parametrize("precision", [["--fp16"], ["--amp"], ["--amp", "--amp-dtype", "bfloat16"], []])
def test_the_plain_command_on_a_gpu_takes_the_fastest_mode(machine, precision):
    plan = plan_of(["DIR", "-a", "resnet50", "-b", "256", *precision], machine)
    assert settings(plan) == (True, "triton", "triton", "reduce-overhead")
    text = lines(plan)
    for flag in ("--no-channels-last", "--maxpool-kernel torch", "--bn-kernel torch", "--compile off", "--decode"):
        assert flag in text, text  # every automatic choice names the flag that changes it
    fp16 = "--fp16" in precision
    assert plan.optimizer_impl == ("triton" if fp16 else "fused")
    assert ("--optimizer-impl fused" in text) == fp16
    assert len(plan.choices) == (6 if fp16 else 5)


def test_a_cpu_run_is_what_it_was():
    plan = plan_of(["DIR", "--epochs", "1"], CPU)
    assert settings(plan) == (False, "torch", "torch", "off")
    assert len(plan.choices) == 1 and "--channels-last" in lines(plan)


def test_the_demo_config_resolves_as_before_on_a_cpu():
    cfg = parse_config(["--config", "configs/demo.yaml"])
    plan = resolve(cfg, CPU)
    resolved = plan.apply(cfg)
    assert (resolved.channels_last, resolved.compile, resolved.bn_kernel, resolved.maxpool_kernel,
            resolved.tune_kernels) == (False, "off", "torch", "torch", False)


def test_explicit_flags_are_never_overridden():
    plan = plan_of(["DIR", "--compile", "off", "--no-channels-last", "--maxpool-kernel", "torch", "--decode", "cpu"], GPU)
    assert settings(plan) == (False, "torch", "torch", "off")
    # the one automatic choice left says why the fused kernels cannot run
    assert len(plan.choices) == 1 and "channels_last tensors only" in lines(plan)
    plan = plan_of(["DIR", "--channels-last", "--compile", "default"], CPU)
    assert settings(plan)[::3] == (True, "default")


def test_fp16_steps_in_the_triton_kernels_where_it_can_and_says_why_not_elsewhere():
    assert plan_of(["DIR", "--fp16"], DDP).optimizer_impl == "triton"
    assert plan_of(["DIR", "--fp16"], CPU).optimizer_impl == "foreach"
    clip = plan_of(["DIR", "--fp16", "--clip-grad-norm", "1"], GPU)
    assert clip.optimizer_impl == "fused" and "--clip-grad-norm needs the unscaled gradients" in lines(clip)
    old = plan_of(["DIR", "--fp16"], OLD_GPU)
    assert old.optimizer_impl == "fused" and "the kernels need Triton" in lines(old)
    # a flag the user gave stays; where it cannot apply, a note says what runs instead
    assert plan_of(["DIR", "--fp16", "--optimizer-impl", "fused"], GPU).optimizer_impl == "fused"
    amp = plan_of(["DIR", "--amp", "--optimizer-impl", "triton"], GPU)
    assert amp.optimizer_impl == "fused" and "torch's fused SGD steps this run" in " ".join(amp.notes)
    old_amp = plan_of(["DIR", "--amp", "--optimizer-impl", "triton"], OLD_GPU)
    assert old_amp.optimizer_impl == "fused"  # the note is what runs: no error for want of Triton
    cpu = plan_of(["DIR", "--optimizer-impl", "triton"], CPU)
    assert cpu.optimizer_impl == "foreach" and "multi-tensor SGD steps this run" in " ".join(cpu.notes)
    # --fp16 on a CPU asked for the kernels: the plan keeps the flag; building the optimizer says what is missing
    assert plan_of(["DIR", "--fp16", "--optimizer-impl", "triton"], CPU).optimizer_impl == "triton"
    assert parse_config(["DIR", "--fp16"]).optimizer_impl == "auto"


def test_a_gpu_without_triton_falls_back_with_a_reason():
    plan = plan_of(["DIR", "--fp16"], OLD_GPU)
    assert settings(plan) == (True, "torch", "torch", "off")
    assert "Triton" in lines(plan)


def test_dataparallel_is_not_compiled_and_keeps_torchs_batchnorm():
    plan = plan_of(["DIR", "--fp16"], DP)
    assert settings(plan) == (True, "triton", "torch", "off")
    assert "python -m multiproc" in lines(plan)


@pytest.mark.parametrize("flags, expect, reason", [
    (["--sync-bn"], (True, "triton", "torch", "off"), "--sync-bn"),
    (["--deterministic"], (True, "triton", "torch", "off"), "--deterministic"),
    (["--accum-steps", "2"], (True, "triton", "triton", "reduce-overhead"), None),
    (["--blurpool"], (True, "triton", "triton", "off"), "--blurpool's model under torch.compile did not reach"),
    (["-e"], (True, "triton", "torch", "off"), "-e "),
    (["--small-stem"], (True, "torch", "triton", "reduce-overhead"), None),
    (["--progressive-resize", "128", "--epochs", "4"], (True, "triton", "triton", "reduce-overhead"), None),
])
def test_each_case_that_cannot_take_the_whole_fast_path(flags, expect, reason):
    plan = plan_of(["DIR", "--fp16", *flags], DDP)
    assert settings(plan) == expect
    if reason is not None:
        assert reason in lines(plan), lines(plan)
    resolved = plan.apply(parse_config(["DIR", "--fp16", *flags]))  # a resolved config passes the checks
    assert resolved.compile == expect[3]


def test_tune_kernels_without_compilation_is_dropped_with_a_line():
    plan = plan_of(["DIR", "--tune-kernels"], CPU)
    assert plan.compile == "off" and not plan.tune_kernels
    assert "--tune-kernels ignored" in lines(plan)
    assert plan_of(["DIR", "--tune-kernels"], GPU).tune_kernels


def test_explicit_kernels_bring_channels_last_along():
    # --bn-kernel triton under Triton's interpreter (the CPU tests) needs channels_last tensors
    assert plan_of(["DIR", "--bn-kernel", "triton"], CPU).channels_last
    assert plan_of(["DIR", "--maxpool-kernel", "triton"], CPU).channels_last


@pytest.mark.skipif(__import__("torch").cuda.is_available(),
                    reason="the CPU run's banner; a GPU's is tests/test_gpu_runs.py's")
def test_the_banner_prints_every_choice(tmp_path, capsys):
    from imagenet.cli import main
    rc = main(["--dummy", "--dummy-train-size", "8", "--dummy-val-size", "4", "--dummy-classes", "2", "-a", "resnet18",
               "-b", "4", "--image-size", "16", "--epochs", "1", "-j", "0", "--output-dir", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "=> default: contiguous tensors, torch's kernels, not compiled" in out
    assert "=> first step done" in out
    written = (tmp_path / "config.yaml").read_text()  # what was asked, and what it became here
    assert "compile: auto" in written and "channels_last: null" in written, written
    decided = written.splitlines()[1]
    assert decided.startswith("# {") and "channels_last: false" in decided and "compile: 'off'" in decided, written


# --decode auto: where JPEGs are decoded, decided with the other defaults (imagenet/data/gpu/choice.py)
def machine(cpus_per_gpu, device="cuda", mode="gpu", gpu_decode=True, gpus_per_process=1, jpeg=None):
    return Machine(device, mode, triton=device == "cuda", cpus_per_gpu=cpus_per_gpu,
                   gpus_per_process=gpus_per_process, gpu_decode=gpu_decode, jpeg=jpeg)


@pytest.mark.parametrize("flags, host, decode, words", [
    # one GPU a process: the GPU decodes JPEGs at every worker count (on an H200 it fed the step
    # faster than 2-15 decoding workers once its stream had a hardware queue of its own)
    ([], machine(16), "gpu", "4 workers, 16 CPU cores per GPU (on an H200 the GPU decode fed the step faster"),
    (["-j", "15"], machine(16), "gpu", "15 workers"),
    (["-j", "2"], machine(16), "gpu", "2 workers"),
    (["-j", "64"], machine(64), "gpu", "64 workers"),
    (["-j", "15"], machine(8, mode="ddp"), "gpu", "8 CPU cores per GPU"),
    (["-j", "15"], machine(16, mode="ddp"), "gpu", "15 workers"),
    # DataParallel: one process's workers feed every GPU
    (["-j", "24"], machine(16, mode="dp", gpus_per_process=2), "cpu", "12 decoding for each GPU, where one decode"),
    (["-j", "16"], machine(16, mode="dp", gpus_per_process=2), "gpu", "8 decoding for each GPU would hold"),
    ([], machine(16, gpu_decode=False), "cpu", "no GPU JPEG decoder"),
    ([], machine(2, jpeg=False), "cpu", "the training images are not JPEGs: nvJPEG decodes only JPEGs"),
    ([], machine(2, jpeg=True), "gpu", "4 workers, 2 CPU cores per GPU"),
    (["--data-pipeline", "classic"], machine(2), "cpu", "--data-pipeline classic"),
    (["--auto-augment", "randaugment"], machine(2), "cpu", "work on decoded pixels in the workers"),
    (["--random-erase", "0.25"], machine(2), "cpu", "work on decoded pixels in the workers"),
])
def test_decode_auto_chooses_by_the_machine_and_says_why(flags, host, decode, words):
    plan = plan_of(["DIR", "--decode", "auto", *flags], host)
    assert plan.decode == decode
    line = [c.line() for c in plan.choices if "--decode auto" in c.what]
    assert len(line) == 1 and words in line[0], lines(plan)
    assert line[0].startswith(f"JPEGs decoded {'on the GPU' if decode == 'gpu' else 'in the CPU workers'}")
    cfg = parse_config(["DIR", "--decode", "auto", *flags])
    assert plan.apply(cfg).decode == decode  # what the run and its config.yaml take


def test_decode_auto_is_the_default_and_a_cpu_run_says_nothing_of_it():
    assert parse_config(["DIR"]).decode == "auto"
    plan = plan_of(["DIR", "-j", "2"], machine(2, device="cpu", mode="cpu", gpu_decode=False))
    assert plan.decode == "cpu" and "--decode" not in lines(plan)  # a CPU run decodes in its workers, as always
    plan = plan_of([], machine(2, jpeg=False))  # no DIR: the built-in dataset, PNGs
    assert plan.decode == "cpu" and "the built-in dataset is stored as PNGs" in lines(plan)


def test_images_are_jpeg_looks_at_the_first_class_folder(tmp_path):
    from imagenet.data.probe import images_are_jpeg
    assert images_are_jpeg(str(tmp_path)) is None  # nothing to look at: shards, a URL, no folder yet
    (tmp_path / "train" / "a" / "sub").mkdir(parents=True)
    (tmp_path / "train" / "a" / "notes.txt").write_text("x")
    assert images_are_jpeg(str(tmp_path)) is None
    (tmp_path / "train" / "a" / "sub" / "1.JPEG").write_bytes(b"")
    assert images_are_jpeg(str(tmp_path)) is True
    (tmp_path / "train" / "a" / "sub" / "1.JPEG").unlink()
    (tmp_path / "train" / "a" / "0.png").write_bytes(b"")
    assert images_are_jpeg(str(tmp_path)) is False


def test_decode_auto_names_the_flag_that_changes_it():
    def line(argv, host):
        plan = plan_of(["DIR", "--decode", "auto", *argv], host)
        return next(c.line() for c in plan.choices if "--decode auto" in c.what)
    assert line([], machine(16)).endswith("(--decode cpu decodes in the workers)")
    dp = {"mode": "dp", "gpus_per_process": 2}
    assert line([], machine(16, **dp)).endswith("(-j 24 --decode cpu decodes in the workers)")  # enough cores for it
    assert line([], machine(8, **dp)).endswith("(--decode cpu decodes in the workers)")  # too few to help
    assert line(["-j", "32"], machine(16, **dp)).endswith("(--decode gpu decodes on the GPU)")


def test_decode_auto_on_synthetic_data_and_decode_as_asked_say_nothing():
    plan = plan_of(["--dummy", "--decode", "auto"], machine(2))
    assert plan.decode == "cpu" and "--decode" not in lines(plan)
    for decode in ("cpu", "gpu"):  # asked for: stands, whatever the machine
        plan = plan_of(["DIR", "--decode", decode], machine(64))
        assert plan.decode == decode and "--decode auto" not in lines(plan)


def test_the_machine_is_read_from_the_launch_context(monkeypatch):
    import torch

    from imagenet.parallel.distributed import DistContext
    monkeypatch.setattr("imagenet.training.defaults.usable_cpus", lambda: 64)
    cpu = Machine.of(DistContext("cpu", torch.device("cpu"), "test"), "auto", "/no/such/dir")
    assert cpu.cpus_per_gpu == 64 and not cpu.gpu_decode and cpu.jpeg is None  # looked up only for a GPU
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # eight processes, one GPU each, share the 64 cores
    ddp = Machine.of(DistContext("ddp", torch.device("cpu"), "test", world_size=16))
    assert ddp.cpus_per_gpu == 8 and ddp.gpus_per_process == 1


def test_a_gpu_machine_looks_at_the_images_only_for_decode_auto(monkeypatch, tmp_path):
    import torch

    from imagenet.parallel.distributed import DistContext
    monkeypatch.setattr("imagenet.training.defaults.gpu_decoder_available", lambda: True)
    monkeypatch.setattr("imagenet.kernels.compiles.available", lambda: True)
    (tmp_path / "train" / "a").mkdir(parents=True)
    (tmp_path / "train" / "a" / "0.png").write_bytes(b"")
    gpu = DistContext("gpu", torch.device("cuda", 0), "test")
    assert Machine.of(gpu, "auto", str(tmp_path)).jpeg is False
    assert Machine.of(gpu, "auto", None).jpeg is False  # the built-in dataset: PNGs
    assert Machine.of(gpu, "auto", "https://example.com/shards").jpeg is None  # not known: taken as JPEGs
    assert Machine.of(gpu, "gpu", str(tmp_path)).jpeg is None  # asked for: nothing to decide
    plan = resolve(parse_config([str(tmp_path)]), Machine.of(gpu, "auto", str(tmp_path)))
    assert plan.decode == "cpu" and "not JPEGs" in lines(plan)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CPU run's banner")
def test_decode_auto_on_a_cpu_run_is_resolved_in_the_config_and_the_banner(digits, tmp_path, capsys):
    from imagenet.cli import main
    assert main([digits, "-a", "resnet18", "--epochs", "1", "--prof", "1", "-b", "8", "-j", "0",
                 "--image-size", "16", "--val-resize", "16", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "--decode auto" not in out and "workers decode" in out, out  # the default, said as the pipeline line says it
    assert "decode: cpu" in (tmp_path / "prof-config.yaml").read_text().splitlines()[1]  # the decisions line (--prof)


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_getaffinity"), reason="CPU affinity is Linux's")
def test_more_workers_than_cores_get_one_banner_line_and_no_torch_warning(digits, tmp_path, capsys, monkeypatch):
    """torch's DataLoader warns of -j above the usable cores at each loader it builds and each
    start of its workers (three times in the demo on a 2-core machine); the banner says it once."""
    import os
    import warnings

    from imagenet.cli import main
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # this process may use one core
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main([digits, "-a", "resnet18", "--epochs", "1", "--prof", "1", "-b", "8", "-j", "2",
                     "--image-size", "16", "--val-resize", "16", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if "data workers than" in line]
    assert notes == ["=> note: -j 2 asks for more data workers than the 1 CPU core this process may use: all 2 run, "
                     "taking turns on it (-j 1 or fewer gives each a core of its own)"], out
    assert not [w for w in caught if "worker processes in total" in str(w.message)], [str(w.message) for w in caught]


# --decode-share: the workers' share of the GPU decode's JPEGs (imagenet/data/gpu/share.py)
def test_the_gpu_decode_says_the_workers_take_a_share_and_how_to_stop_it():
    for argv in (["DIR"], ["DIR", "--decode", "gpu"]):
        plan = plan_of(argv, machine(16))
        share = [c.line() for c in plan.choices if "--decode-share" in c.flag]
        assert plan.decode == "gpu" and len(share) == 1, lines(plan)
        assert share[0].startswith("the workers decode a share of the training JPEGs while the GPU decode sets the "
                                   "pace: one thread makes the GPU decoder's calls")
        assert share[0].endswith("(--decode-share 0 keeps every JPEG on the GPU)")
    for argv in (["DIR", "--decode-share", "0"], ["DIR", "--decode-share", "0.3"], ["DIR", "--decode", "cpu"],
                 ["--dummy"], ["--dummy", "--decode", "gpu"], ["DIR", "--deterministic"]):
        assert "--decode-share" not in lines(plan_of(argv, machine(16))), argv
    # a share of a decode the workers do alone is said to be unused, with the reason
    plan = plan_of(["DIR", "--decode-share", "0.3"], machine(16, jpeg=False))
    assert plan.decode == "cpu" and plan.notes == ("--decode-share 0.3 is left unused: the workers decode every "
                                                   "image (the training images are not JPEGs: nvJPEG decodes only "
                                                   "JPEGs)",)
