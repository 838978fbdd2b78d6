"""--compile and --optimizer-impl through the trainer, and scripts/perf/bench.py train on the CPU."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torchvision

from imagenet.base.errors import UserError
from imagenet.cli import main
from imagenet.models.registry import compile_model
from imagenet.parallel.distributed import free_port
from tests.helpers import ONE_THREAD, fp16_run_args, fused_or_skip, last_checkpoint, tiny_run_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# two ranks on one machine: gloo on the CPU (a one-GPU machine cannot hold two NCCL ranks)
CPU_ONLY = dict(os.environ, CUDA_VISIBLE_DEVICES="")


def test_compiled_training_checkpoints_plain_weights_and_validates(fp16_digits, tmp_path, monkeypatch):
    """The compiled module is only a wrapper: checkpoints hold torchvision's own names, and the
    run validates and resumes as an uncompiled one. (Dynamo traces for real; the 'eager' backend
    skips code generation, which a 2-core CI machine cannot afford. Inductor runs on the GPU
    machine in scripts/perf/bench.py.)"""
    modes = []
    real = torch.compile

    def recording_compile(model, mode=None, **kw):
        modes.append(mode)
        return real(model, backend="eager")

    monkeypatch.setattr(torch, "compile", recording_compile)
    assert main(fp16_run_args(fp16_digits, tmp_path, "--epochs", "1", "--compile", "reduce-overhead")) == 0
    assert modes == ["reduce-overhead"] * 2  # the training model, and validation's evaluator apart
    ckpt = last_checkpoint(tmp_path)
    assert not any(k.startswith(("_orig_mod", "module")) for k in ckpt["state_dict"])
    torchvision.models.resnet18(num_classes=10).load_state_dict(ckpt["state_dict"])
    row = json.loads(open(tmp_path / "metrics.jsonl").readlines()[-1])
    assert row["val_samples"] == 10
    assert main(fp16_run_args(fp16_digits, tmp_path, "--epochs", "2", "--compile", "default", "--resume", "auto")) == 0
    assert modes == ["reduce-overhead"] * 2 + [None] * 2


def test_tune_kernels_turns_on_inductors_tuning_before_compiling(digits, tmp_path, monkeypatch, capsys):
    import torch._inductor.config as inductor
    # Restored by hand: monkeypatch's undo deletes the option from Inductor's config module.
    before, inductor.coordinate_descent_tuning = inductor.coordinate_descent_tuning, False
    seen = []
    real = torch.compile

    def recording_compile(model, mode=None, **kw):
        seen.append(inductor.coordinate_descent_tuning)
        return real(model, backend="eager")

    monkeypatch.setattr(torch, "compile", recording_compile)
    try:
        assert main(tiny_run_args(digits, tmp_path, "--epochs", "1", "--compile", "default", "--tune-kernels")) == 0
    finally:
        inductor.coordinate_descent_tuning = before
    assert seen == [True, True]
    kernels = [line for line in capsys.readouterr().out.splitlines() if line.startswith("=> kernels:")]
    assert len(kernels) == 1 and "Inductor tunes its kernels" in kernels[0]  # on a GPU, after the Triton kernels


def test_a_batch_of_another_shape_compiles_a_static_graph(monkeypatch):
    """A shortened batch (unreadable files) or a second run in one process at another batch size
    compiles a graph of static shapes again, not Dynamo's automatic symbolic-batch graph (which,
    at 1x1 feature maps on a GPU, failed Inductor's stride check; docs/BENCHMARKS.md has the runs)."""
    real, symbolic = torch.compile, []

    def recording_backend(gm, example_inputs):
        shapes = [n.meta["example_value"].shape for n in gm.graph.nodes
                  if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.Tensor)]
        symbolic.append(any(isinstance(d, torch.SymInt) for shape in shapes for d in shape))
        return gm.forward

    monkeypatch.setattr(torch, "compile", lambda model, mode=None, **kw: real(model, backend=recording_backend, **kw))
    torch._dynamo.reset()
    model = compile_model(torch.nn.Linear(4, 2), "default", "gpu")
    for batch in (8, 5, 3):
        model(torch.randn(batch, 4)).sum().backward()
    torch._dynamo.reset()
    assert symbolic == [False, False, False]


def test_compile_is_refused_under_data_parallel():
    with pytest.raises(UserError, match="DataParallel.*multiproc"):
        compile_model(torch.nn.Linear(2, 2), "default", "dp")
    assert isinstance(compile_model(torch.nn.Linear(2, 2), "off", "dp"), torch.nn.Linear)


def test_unknown_compile_mode_is_a_flag_error(digits, tmp_path, capsys):
    assert main(tiny_run_args(digits, tmp_path, "--compile", "fastest")) == 2
    assert "--compile" in capsys.readouterr().err


def test_fused_optimizer_on_the_cpu_trains_like_foreach(fp16_digits, tmp_path):
    """--optimizer-impl fused (the GPU default) through the whole loop, fp16 with skips decided on
    the device, against the host-decided foreach run: same data, same weights to rounding."""
    fused_or_skip([{"params": [torch.nn.Parameter(torch.zeros(1))]}])
    runs = {}
    for impl in ("foreach", "fused"):
        out = tmp_path / impl
        assert main(fp16_run_args(fp16_digits, out, "--epochs", "1", "--optimizer-impl", impl)) == 0
        runs[impl] = (last_checkpoint(out), json.loads(open(out / "metrics.jsonl").readline()))
    (a, row_a), (b, row_b) = runs["foreach"], runs["fused"]
    assert a["optimizer"]["param_groups"][0]["foreach"] and b["optimizer"]["param_groups"][0]["fused"]
    assert row_a["skipped_steps"] == row_b["skipped_steps"] and row_a["loss_scale"] == row_b["loss_scale"]
    assert 0 < row_a["skipped_steps"] < row_a["steps"], row_a  # steps skipped and steps taken, both
    for k, v in a["state_dict"].items():
        if v.is_floating_point():
            torch.testing.assert_close(v, b["state_dict"][k], rtol=1e-4, atol=1e-5, msg=k)


def bench(*args):
    return subprocess.run([sys.executable, "scripts/perf/bench.py", "train", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_bench_train_prints_a_table_on_the_cpu(tmp_path):
    out = tmp_path / "rows.json"
    r = bench("--arch", "resnet18", "--image-size", "16", "--num-classes", "10", "--batch-size", "4",
              "--warmup", "1", "--steps", "2", "--windows", "2", "--matrix", "--precisions", "fp32,fp16",
              "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "| fp16 | channels_last |" in r.stdout and "| fp32 | contiguous |" in r.stdout
    rows = json.loads(out.read_text())
    assert len(rows) == 4 and all(row["img_per_s"] > 0 and row["min"] <= row["img_per_s"] <= row["max"]
                                  for row in rows)


def test_bench_refuses_a_batch_that_does_not_divide(tmp_path):
    r = subprocess.run([sys.executable, "-m", "multiproc", "--nproc-per-node", "2", "--log-dir", str(tmp_path),
                        "scripts/perf/bench.py", "train",
                        "--arch", "resnet18", "--image-size", "16", "--batch-size", "5", "--steps", "1"],
                       cwd=REPO, capture_output=True, text=True, timeout=300, env=CPU_ONLY)
    assert r.returncode == 2 and "does not divide" in r.stdout + r.stderr


def test_bench_runs_over_two_simulated_nodes_with_ddp_options(tmp_path):
    """The scaling issue's CPU part: bench.py under two launchers (--nnodes 2, one process each,
    gloo on 127.0.0.1) trains as one DDP world of 2 and reports from rank 0; DDP options and
    --profile pass."""
    port = free_port()
    bench_args = ["scripts/perf/bench.py", "train", "--arch", "resnet18", "--image-size", "16", "--num-classes", "10",
                  "--batch-size", "4", "--warmup", "1", "--steps", "1", "--windows", "2", "--precision", "fp32",
                  "--ddp-bucket-mb", "1", "--ddp-bucket-view", "--profile", "1"]
    launchers = [subprocess.Popen([sys.executable, "-m", "multiproc", "--nproc-per-node", "1", "--nnodes", "2",
                                   "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                                   "--log-dir", str(tmp_path / f"logs{node}"), *bench_args],
                                  cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=dict(CPU_ONLY, **ONE_THREAD))
               for node in (0, 1)]
    outs = [p.communicate(timeout=300) for p in launchers]
    assert [p.returncode for p in launchers] == [0, 0], outs
    assert "DistributedDataParallel, rank 0 of 2" in outs[0][0] and "| fp32 | contiguous |" in outs[0][0]
    # every rank runs the profiled steps (their all-reduces need each other); rank 0 prints them
    assert "profile of 1 steps" in outs[0][0] and "profile of" not in outs[1][0]


@pytest.fixture(scope="module")
def jpeg_folder(tmp_path_factory):
    pytest.importorskip("skimage")
    root = tmp_path_factory.mktemp("jpegs") / "bench"
    r = subprocess.run([sys.executable, "scripts/perf/make_benchmark_imagefolder.py", str(root), "--classes", "3",
                        "--train-per-class", "8", "--val-per-class", "1"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return root


def bench_main(capsys, *args) -> tuple:
    """scripts/perf/bench.py's main() in this process, for the checks that end before any work
    (a bench.py process spends ~5 s importing torch first): (exit status, stderr)."""
    sys.path.insert(0, os.path.join(REPO, "scripts", "perf"))
    import bench
    try:
        code = bench.main([str(a) for a in args])
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    return code, capsys.readouterr().err


def bench_data(*args):
    return subprocess.run([sys.executable, "scripts/perf/bench.py", "data", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_bench_classic_row_is_plain_torchvision(jpeg_folder):
    """The baseline is what the reference script runs, nothing of ours in a worker or the main
    process: torchvision's ImageFolder and transforms, a plain DataLoader; the same seed gives
    the very batches a hand-written reference loop gets."""
    from types import SimpleNamespace

    from torch.utils.data import DataLoader, RandomSampler
    from torchvision import datasets, transforms
    sys.path.insert(0, os.path.join(REPO, "scripts", "perf"))
    import bench
    args = SimpleNamespace(dir=str(jpeg_folder), image_size=32, batch_size=4, workers=0)
    torch.manual_seed(5)
    ours = [b for _, b in zip(range(3), bench.plain_torchvision_loader(args, torch.device("cpu"), 3))]
    torch.manual_seed(5)
    ref_set = datasets.ImageFolder(str(jpeg_folder / "train"), transforms.Compose([
        transforms.RandomResizedCrop(32), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
        transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))]))
    ref = DataLoader(ref_set, batch_size=4, sampler=RandomSampler(ref_set, num_samples=12), drop_last=True)
    for (a, ta, skipped), (b, tb) in zip(ours, ref):
        assert torch.equal(a, b) and torch.equal(ta, tb) and skipped == []
    assert len(ours) == 3


@pytest.mark.parametrize("pipeline", ["classic", "fast"])
def test_bench_data_names_a_wrong_folder_in_one_line(tmp_path, capsys, pipeline):
    code, err = bench_main(capsys, "data", tmp_path / "nowhere", "--pipelines", pipeline)
    assert code == 2 and "Traceback" not in err, err
    assert err.startswith("error: ") and "does not exist" in err


def test_bench_data_compares_pipelines_and_can_train_on_every_batch(jpeg_folder):
    """The loader alone (classic vs fast side by side, a ratio line, the last line '... N img/s'),
    then the same loader feeding a training step on every batch, with a profile of the ops."""
    small = ["--workers", "1", "--batch-size", "4", "--image-size", "32", "--warmup", "2", "--batches", "2",
             "--windows", "2"]
    r = bench_data(jpeg_folder, *small, "--pipelines", "classic,trainer-classic,fast")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert any(line.startswith("bench data: classic") for line in lines) and "x classic (plain torchvision)" in r.stdout
    assert lines[-1].startswith("fast pipeline, 1 workers:") and lines[-1].endswith(" img/s")
    assert float(lines[-1].split()[-2]) > 0
    r = bench_data(jpeg_folder, *small, "--pipelines", "fast", "--train", "fp32", "--train-arch", "resnet18",
                   "--profile", "1")
    assert r.returncode == 0, r.stderr
    assert "each batch trains resnet18 fp32" in r.stdout
    assert "profile of 1 batches (fast)" in r.stdout and "convolution" in r.stdout  # the training step's ops


def test_bench_data_refuses_the_gpu_pipeline_without_a_gpu(jpeg_folder, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    code, err = bench_main(capsys, "data", jpeg_folder, "--pipelines", "gpu")
    assert code == 2 and "needs a CUDA GPU" in err


@pytest.mark.parametrize("args, message", [
    (["train", "--matrix", "--layouts", "channels-last"], "--layouts: unknown channels-last"),
    (["train", "--matrix", "--precisions", "fp8"], "--precisions: unknown fp8"),
    (["train", "--arch", "resnet5"], "invalid choice: 'resnet5'"),
    (["data", "DIR", "--pipelines", "fats"], "--pipelines: unknown fats"),
])
def test_bench_names_a_bad_option_value_and_exits_2(args, message, tmp_path, capsys):
    code, err = bench_main(capsys, *[tmp_path if a == "DIR" else a for a in args])
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["bench", "--groups", "nope"], "unknown bench group(s) ['nope']"),
    (["recipe", "--variants", "zz"], "unknown recipe variant(s) ['zz']"),
    (["jpeg", "--e2e-rows", "gpu"], "--e2e-rows: 'gpu' is not DECODE:PRECISION[:COMPILE]"),
    (["decode", "--decode-jpeg", "torchvision,nvjpeg@2"], "--decode-jpeg: 'torchvision,nvjpeg@2'; give GPU JPEG "
                                                          "decoders of the trainer, comma-separated, of "
                                                          "torchvision,torchcodec"),
    (["shrink", "--shrink-pipelines", "cpu,nope"], "--shrink-pipelines: unknown ['nope']"),
    (["family", "--family-rows", "typed,nope"], "--family-rows: unknown ['nope']"),
    (["family", "--family-archs", "resnet18,resnet19"], "--family-archs: unknown ['resnet19']"),
    (["largebatch", "--largebatch-variants", "sgd-b128,adam-b2048"], "--largebatch-variants: 'adam-b2048' is not"),
    (["largebatch", "--largebatch-variants", "lars-b2048-lr10-cos"], "'lars-b2048-lr10-cos' has 'cos'"),
])
def test_gpu_verify_names_a_bad_option_value_before_any_work(args, message, tmp_path):
    """The GPU matrix is run in scarce device time: a typo must end it at once, with exit 2."""
    r = subprocess.run([sys.executable, "scripts/perf/gpu_verify.py", *args, "--out", str(tmp_path)], cwd=REPO,
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
    assert not list(tmp_path.glob("*.log"))  # failed before making data (make_jpeg.log, prepare-jpeg.log, ...)


def test_gpu_verify_loads_by_path_and_lists_every_phase_in_its_help():
    """gpu_verify.py is a thin entry over scripts/perf/verify/: loaded by its file path (not run as
    a script, so its folder is not on sys.path) it still finds its phases, and --help names each
    one of its PHASES table with the line that says what it measures."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_verify_by_path", os.path.join(REPO, "scripts", "perf",
                                                                                     "gpu_verify.py"))
    gv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gv)
    assert {"smoke", "suite", "e2e", "precision", "multigpu", "bench", "recipe", "jpeg", "scaling", "shrink",
            "defaults", "shards", "decode", "family", "largebatch"} <= set(gv.PHASES)
    help_text = gv.parser().format_help()
    for name, (phase, what) in gv.PHASES.items():
        assert callable(phase) and f"gpu_verify.py {name:<10} # {what}" in help_text
    assert gv.parser().parse_args(["decode", "--decode-workers", "2"]).decode_workers == "2"


def test_largebatch_variants_scale_the_recipes_rate():
    sys.path.insert(0, os.path.join(REPO, "scripts", "perf"))
    from verify.accuracy import largebatch_flags
    assert largebatch_flags("sgd-b128", 0.05) == "-b 128 --lr=0.05"
    assert largebatch_flags("sgd-b2048-linear", 0.05) == "-b 2048 --lr=0.8 --warmup-epochs 2"
    assert largebatch_flags("sgd-b2048-sqrt", 0.05) == "-b 2048 --lr=0.2 --warmup-epochs 2"
    assert largebatch_flags("lars-b2048-lr10-poly", 0.05) == (
        "-b 2048 --lr-schedule poly --lr-poly-power 2 --lr-end 0.0001 --lr=10 --warmup-epochs 2 --optimizer lars")
    # MLPerf's weight decay for LARS, a warm-up of one epoch
    assert largebatch_flags("lars-b2048-lr10-poly-wd0.00005-w1", 0.05) == (
        "-b 2048 --lr-schedule poly --lr-poly-power 2 --lr-end 0.0001 --wd 5e-05 --lr=10 --warmup-epochs 1 "
        "--optimizer lars")
    assert largebatch_flags("sgd-b128-w3", 0.05) == "-b 128 --lr=0.05 --warmup-epochs 3"


def test_a_phase_starts_at_most_max_runs_at_once(tmp_path):
    """gpu_verify's --max-runs: the next run starts as one ends, and results keep the runs' order."""
    import argparse
    sys.path.insert(0, os.path.join(REPO, "scripts", "perf"))
    from verify.common import run_group
    stamp = (f"{sys.executable} -c \"import time; open('OUT/span', 'w').write(str(time.time())); time.sleep(0.6); "
             "open('OUT/span', 'a').write(' ' + str(time.time()))\"")
    runs = [{"name": f"r{k}", "cmd": stamp} for k in range(5)]
    results = run_group(runs, argparse.Namespace(out=str(tmp_path), max_runs=2))
    assert [r["name"] for r in results] == [f"r{k}" for k in range(5)] and all(r["rc"] == 0 for r in results)
    spans = [tuple(map(float, (tmp_path / f"r{k}" / "span").read_text().split())) for k in range(5)]
    most = max(sum(1 for a, b in spans if a <= t < b) for t, _ in spans)
    assert most <= 2, spans  # (two at once, unless a loaded machine staggered their start-ups)


def test_every_recipe_variant_is_flags_main_accepts_with_the_stem_recipe():
    """gpu_verify.py recipe's variants: each a set of main.py flags the stem recipe's config takes;
    the eager triangular one differs from ramp-eager by its schedule alone."""
    import importlib
    import shlex

    from imagenet.base.config import parse_config
    sys.path.insert(0, os.path.join(REPO, "scripts", "perf"))  # where gpu_verify.py finds its package
    accuracy = importlib.import_module("verify.accuracy")
    cfgs = {name: parse_config(["DIR", "--config", os.path.join(REPO, "configs", "fashion-mnist-stem.yaml"),
                                *shlex.split(flags)]) for name, flags in accuracy.RECIPE_VARIANTS.items()}
    eager, tri = cfgs["ramp-eager"], cfgs["ramp-eager-triangular"]
    assert (eager.lr_schedule, tri.lr_schedule, tri.compile, tri.progressive_resize) == ("cosine", "triangular", "off", 32)
    assert cfgs["ramp"].compile != "off" and cfgs["ramp"].progressive_resize == 32


def test_gpu_verify_cuts_its_runs_at_the_deadline_and_says_how_far_they_got(tmp_path, capsys):
    """--deadline: a call's limit must not take the tables with it. A run still going at the
    deadline is ended (with what it started), reported with the epochs it finished and left out of
    every mean; a run not yet started is not started; a finished run is as before."""
    import argparse
    import json
    import time
    sys.path.insert(0, os.path.join(REPO, "scripts", "perf"))
    from verify.common import run_group, seed_accs, table

    def fake(name: str, epochs: int, then: str) -> dict:  # writes its epochs' rows, then `then`
        rows = "; ".join(f"echo '{json.dumps(dict(val_acc1=90.0 + e, val_samples=10, img_per_s=100.0))}' "
                         f">> OUT/metrics.jsonl" for e in range(epochs))
        return {"name": name, "cmd": f"{rows}; {then}", "env": {}}

    args = argparse.Namespace(out=str(tmp_path), max_runs=1, ends=time.time() + 3)  # one at a time
    t0 = time.time()
    results = run_group([fake("v-s0", 2, "true"), fake("v-s1", 1, "sleep 60 & wait"), fake("v-s2", 0, "true")],
                        args)
    assert time.time() - t0 < 20  # the sleeping run and its child did not hold the call
    assert subprocess.run(["pgrep", "-f", "^sleep 60$"], capture_output=True).returncode == 1  # nor outlive it
    done, cut, unstarted = results
    assert not done["cut"] and done["acc1"] == 91.0 and done["epochs"] == 2
    assert cut["cut"] and cut["acc1"] == 90.0 and cut["epochs"] == 1
    assert unstarted["name"] == "v-s2" and unstarted["cut"] and unstarted["epochs"] == 0
    assert seed_accs(results, "v") == [91.0]  # a cut run's last epoch is no final figure
    table(results, "v-s0")
    out = capsys.readouterr().out
    assert "| v-s1 | cut at --deadline: 90.00 after 1 epoch(s) |" in out and "v-s2: not started (--deadline)" in out


def test_defaults_phase_starts_each_cold_run_from_empty_compile_caches(tmp_path, monkeypatch):
    """gpu_verify.py defaults: a "cold" first-step wait is a start with nothing compiled, so the
    multiproc cold start must not read the graphs the one-process cold start just left; the warm
    starts read the caches the cold ones filled."""
    import argparse
    import importlib
    sys.path.insert(0, os.path.join(REPO, "scripts", "perf"))
    speed = importlib.import_module("verify.speed")
    seen = []

    def fake_run_one(name, cmd, env, args):  # notes what the run found, then "compiles" into the cache
        cache = env["TORCHINDUCTOR_CACHE_DIR"]
        seen.append((name, os.path.isdir(cache) and bool(os.listdir(cache))))
        os.makedirs(cache, exist_ok=True)
        open(os.path.join(cache, f"graph-of-{name}"), "w").close()
        return {"name": name, "rc": 0}

    monkeypatch.setattr(speed, "run_one", fake_run_one)
    monkeypatch.setattr(speed, "first_step", lambda log: 1.0)
    args = argparse.Namespace(defaults_rows="new-fp16,new-multiproc-fp16", old=None, defaults_stage="compile",
                              skip_cold=False, e2e_timeout=10, out=str(tmp_path), budget=100,
                              defaults_epochs=1, defaults_steps=1)
    speed.phase_defaults(args)
    assert seen == [("cold-new-fp16", False), ("cold-new-multiproc-fp16", False),
                    ("warm-new-fp16", True), ("warm-new-multiproc-fp16", True)]
