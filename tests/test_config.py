"""Tests for the typed configuration (imagenet/base/config.py) and the CLI's one-line errors."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from imagenet.base.config import parse_config, static_loss_scale
from imagenet.base.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def write_yaml(tmp_path, text, name="recipe.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ------------------------------------------------------------------------------------ defaults


def test_defaults_match_the_classic_reference_script():
    cfg = parse_config([])
    assert cfg.arch == "resnet18"
    assert cfg.epochs == 90
    assert cfg.batch_size == 256
    assert cfg.lr == pytest.approx(0.1)
    assert cfg.momentum == pytest.approx(0.9)
    assert cfg.weight_decay == pytest.approx(1e-4)
    assert cfg.print_freq == 10
    assert cfg.workers == 4
    # The classic script's other defaults: no data given, nothing resumed, single process, fp32.
    assert cfg.data is None
    assert cfg.resume == ""
    assert cfg.evaluate is False and cfg.pretrained is None and cfg.dummy is False
    assert cfg.world_size == -1 and cfg.rank == -1
    assert cfg.seed is None and cfg.gpu is None
    assert cfg.multiprocessing_distributed is False
    assert cfg.fp16 is False and cfg.amp is False and cfg.loss_scale is None
    assert cfg.prof == -1
    assert cfg.precision_name == "fp32"


# --------------------------------------------------------------------------------- classic flags


@pytest.mark.parametrize("argv, field, expected", [
    (["/data/imagenet"], "data", "/data/imagenet"),
    (["-a", "resnet50"], "arch", "resnet50"),
    (["--arch", "resnet101"], "arch", "resnet101"),
    (["-j", "2"], "workers", 2),
    (["--workers", "0"], "workers", 0),
    (["--epochs", "3"], "epochs", 3),
    (["--start-epoch", "2"], "start_epoch", 2),
    (["--start_epoch", "2"], "start_epoch", 2),
    (["-b", "32"], "batch_size", 32),
    (["--batch-size", "64"], "batch_size", 64),
    (["--batch_size", "128"], "batch_size", 128),
    (["--lr", "0.4"], "lr", 0.4),
    (["--momentum", "0.8"], "momentum", 0.8),
    (["--wd", "5e-4"], "weight_decay", 5e-4),
    (["--weight-decay", "3e-5"], "weight_decay", 3e-5),
    (["--weight_decay", "2e-5"], "weight_decay", 2e-5),
    (["-p", "5"], "print_freq", 5),
    (["--print-freq", "7"], "print_freq", 7),
    (["--print_freq", "9"], "print_freq", 9),
    (["--resume", "ckpt.pth.tar"], "resume", "ckpt.pth.tar"),
    (["-e"], "evaluate", True),
    (["--evaluate"], "evaluate", True),
    (["--pretrained"], "pretrained", "DEFAULT"),
    (["--pretrained", "IMAGENET1K_V1"], "pretrained", "IMAGENET1K_V1"),
    (["--world-size", "2"], "world_size", 2),
    (["--world_size", "4"], "world_size", 4),
    (["--world-size", "2", "--rank", "1"], "rank", 1),
    (["--dist-url", "tcp://127.0.0.1:23456"], "dist_url", "tcp://127.0.0.1:23456"),
    (["--dist_url", "tcp://10.0.0.1:1234"], "dist_url", "tcp://10.0.0.1:1234"),
    (["--dist-backend", "gloo"], "dist_backend", "gloo"),
    (["--dist_backend", "nccl"], "dist_backend", "nccl"),
    (["--seed", "7"], "seed", 7),
    (["--gpu", "1"], "gpu", 1),
    (["--multiprocessing-distributed"], "multiprocessing_distributed", True),
    (["--multiprocessing_distributed"], "multiprocessing_distributed", True),
    (["--dummy"], "dummy", True),
    (["--fp16"], "fp16", True),
    (["--fp16", "--loss-scale", "128"], "loss_scale", "128"),
    (["--fp16", "--loss_scale", "dynamic"], "loss_scale", "dynamic"),
    (["--prof", "5"], "prof", 5),
    (["--prof"], "prof", 10),  # the fp16 example's bare --prof
])
def test_classic_flag_is_accepted_with_its_meaning(argv, field, expected):
    cfg = parse_config(argv)
    value = getattr(cfg, field)
    if isinstance(expected, float):
        assert value == pytest.approx(expected)
    else:
        assert value == expected


def test_flags_combine_like_the_reference_script():
    cfg = parse_config(["/data", "-a", "resnet34", "-j", "8", "-b", "512", "--lr", "0.2", "--wd", "5e-5",
                        "-p", "100", "--epochs", "100", "--seed", "1", "--dummy"])
    assert (cfg.data, cfg.arch, cfg.workers, cfg.batch_size) == ("/data", "resnet34", 8, 512)
    assert (cfg.lr, cfg.weight_decay, cfg.print_freq, cfg.epochs, cfg.seed) == (0.2, 5e-5, 100, 100, 1)
    assert cfg.dummy is True


def test_fp16_loss_scale_static_dynamic_and_default():
    assert static_loss_scale(parse_config(["--fp16"])) is None  # default with --fp16: dynamic
    assert static_loss_scale(parse_config(["--fp16", "--loss-scale", "128"])) == 128.0
    assert static_loss_scale(parse_config(["--fp16", "--loss-scale", "dynamic"])) is None
    assert static_loss_scale(parse_config(["--fp16", "--dynamic-loss-scale"])) is None
    assert parse_config(["--fp16"]).precision_name == "fp16"


# ------------------------------------------------------------------------------------------ YAML


def test_yaml_dashed_and_underscored_keys(tmp_path):
    path = write_yaml(tmp_path, (
        "data: /data/tiny\n"
        "arch: resnet34\n"
        "batch-size: 32\n"
        "weight_decay: 0.0005\n"
        "print-freq: 3\n"
        "label_smoothing: 0.1\n"
        "lr: 1\n"  # an integer for a float option is fine
        "fp16: true\n"
        "loss-scale: 256\n"  # YAML types it as an int; the option is a string
        "seed: null\n"
    ))
    cfg = parse_config(["--config", path])
    assert cfg.data == "/data/tiny"
    assert cfg.arch == "resnet34"
    assert cfg.batch_size == 32
    assert cfg.weight_decay == pytest.approx(5e-4)
    assert cfg.print_freq == 3
    assert cfg.label_smoothing == pytest.approx(0.1)
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)
    assert cfg.fp16 is True
    assert static_loss_scale(cfg) == 256.0
    assert cfg.seed is None
    assert cfg.config == path


def test_command_line_wins_over_yaml(tmp_path):
    path = write_yaml(tmp_path, "data: /from/yaml\nbatch-size: 64\nlr: 0.2\nepochs: 5\narch: resnet50\n")
    cfg = parse_config(["/from/cli", "--config", path, "-b", "32", "--epochs", "7"])
    assert cfg.data == "/from/cli"
    assert cfg.batch_size == 32
    assert cfg.epochs == 7
    # What the command line does not give keeps the YAML value, not the built-in default.
    assert cfg.lr == pytest.approx(0.2)
    assert cfg.arch == "resnet50"


def test_yaml_data_is_kept_without_dir_on_the_command_line(tmp_path):
    path = write_yaml(tmp_path, "data: /from/yaml\n")
    assert parse_config(["--config", path]).data == "/from/yaml"


def test_empty_yaml_is_all_defaults(tmp_path):
    path = write_yaml(tmp_path, "# nothing here\n")
    assert parse_config(["--config", path]).batch_size == 256


def test_shipped_demo_recipe_parses():
    cfg = parse_config(["--config", str(REPO / "configs" / "demo.yaml")])
    assert cfg.arch == "resnet18"


def test_unknown_yaml_key_is_named_with_a_suggestion(tmp_path):
    path = write_yaml(tmp_path, "batch-szie: 32\n")
    with pytest.raises(UserError) as exc:
        parse_config(["--config", path])
    msg = str(exc.value)
    assert "batch-szie" in msg
    assert "did you mean" in msg and "batch-size" in msg


def test_unknown_yaml_key_without_close_match(tmp_path):
    path = write_yaml(tmp_path, "zzqqxx: 1\n")
    with pytest.raises(UserError, match="zzqqxx"):
        parse_config(["--config", path])


@pytest.mark.parametrize("text", [
    "epochs: ten\n",                  # string for int
    "epochs: '10'\n",                 # quoted number is still a string
    "epochs: 1.5\n",                  # float for int
    "batch-size: true\n",             # bool for int
    "fp16: 1\n",                      # int for bool
    "fp16: 'yes'\n",                  # string for bool
    "lr: abc\n",                      # string for float
    "lr: false\n",                    # bool for float
    "batch-size: [32, 64]\n",         # list for int
    "arch: [resnet18, resnet50]\n",   # list for str
    "resume: {path: x}\n",            # mapping for str
    "amp-dtype: float8\n",            # not one of the choices
    "lr-schedule: linear\n",
])
def test_wrong_yaml_type_is_a_user_error(tmp_path, text):
    path = write_yaml(tmp_path, text)
    key = text.split(":")[0]
    with pytest.raises(UserError) as exc:
        parse_config(["--config", path])
    assert key in str(exc.value)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("text", [
    "epochs: [1, 2\n",           # unclosed flow sequence
    "a: b: c\n",                 # mapping values not allowed here
    "arch: resnet18\n\tlr: 1\n",  # tab indentation
])
def test_invalid_yaml_syntax_is_a_user_error(tmp_path, text):
    path = write_yaml(tmp_path, text)
    with pytest.raises(UserError, match="not valid YAML"):
        parse_config(["--config", path])


def test_yaml_that_is_not_a_mapping(tmp_path):
    path = write_yaml(tmp_path, "- epochs\n- 3\n")
    with pytest.raises(UserError, match="mapping"):
        parse_config(["--config", path])


def test_missing_config_file(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        parse_config(["--config", str(tmp_path / "nope.yaml")])


@pytest.mark.parametrize("text", ["epochs:\n", "batch-size: null\n", "lr: ~\n"])
def test_yaml_null_for_a_required_number_is_a_user_error(tmp_path, text):
    path = write_yaml(tmp_path, text)
    with pytest.raises(UserError, match=text.split(":")[0]):
        parse_config(["--config", path])


@pytest.mark.parametrize("text", ["output-dir: null\n", "lr-schedule: null\n", "amp-dtype: null\n"])
def test_yaml_null_for_a_required_string_is_a_user_error(tmp_path, text):
    path = write_yaml(tmp_path, text)
    with pytest.raises(UserError, match=text.split(":")[0]):
        parse_config(["--config", path])


def test_yaml_float_in_exponent_notation(tmp_path):
    path = write_yaml(tmp_path, "weight-decay: 1e-4\nlr: 2e-1\n")
    cfg = parse_config(["--config", path])
    assert cfg.weight_decay == pytest.approx(1e-4)
    assert cfg.lr == pytest.approx(0.2)


def test_yaml_config_key_hint_does_not_suggest_itself(tmp_path):
    path = write_yaml(tmp_path, "config: other.yaml\n")
    with pytest.raises(UserError) as exc:
        parse_config(["--config", path])
    assert "did you mean 'config'" not in str(exc.value)


# --------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("argv, fragment", [
    (["-b", "0"], "batch-size"),
    (["--batch-size", "-4"], "batch-size"),
    (["--lr", "-0.1"], "--lr"),
    (["--lr", "0"], "--lr"),
    (["--epochs", "0"], "--epochs"),
    (["-j", "-1"], "--workers"),
    (["--momentum", "-0.5"], "--momentum"),
    (["--wd", "-1e-4"], "--weight-decay"),
    (["--label-smoothing", "1.0"], "--label-smoothing"),
    (["--label-smoothing", "-0.1"], "--label-smoothing"),
    (["--image-size", "224", "--val-resize", "200"], "--val-resize"),
    (["--fp16", "--amp"], "--fp16"),
    (["--fp16", "--loss-scale", "0"], "--loss-scale"),
    (["--fp16", "--loss-scale", "-1"], "--loss-scale"),
    (["--fp16", "--loss-scale", "abc"], "--loss-scale"),
    (["--fp16", "--loss-scale", "inf"], "--loss-scale"),
    (["--fp16", "--dynamic-loss-scale", "--loss-scale", "128"], "--dynamic-loss-scale"),
    (["--loss-scale", "128"], "--fp16"),  # a loss scale without --fp16 means nothing
    (["--amp", "--loss-scale", "128"], "--loss-scale"),
    (["--world-size", "2", "--rank", "2"], "--rank"),
    (["--world-size", "2", "--rank", "5"], "--rank"),
    (["--world-size", "0"], "--world-size"),
    (["--rank", "-2"], "--rank"),
    (["-a", "resnet9000"], "resnet9000"),
    (["--arch", "vgg16"], "vgg16"),
    (["--amp", "--amp-dtype", "float8"], "float8"),
    (["--epochs", "5", "--start-epoch", "5"], "--start-epoch"),
    (["--gpu", "-1"], "--gpu"),
    (["-p", "0"], "--print-freq"),
    (["--max-bad-fraction", "1.5"], "--max-bad-fraction"),
    (["--pretrained", "--weights", "w.pth"], "--pretrained"),
    (["--epochs", "ten"], "--epochs"),
    (["--lr", "fast"], "--lr"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--tune-kernels", "--compile", "off"], "--compile"),
    (["--maxpool-kernel", "triton", "--no-channels-last"], "--no-channels-last"),
    (["--maxpool-kernel", "triton", "--channels-last", "--small-stem"], "--small-stem"),
    (["--maxpool-kernel", "cudnn"], "cudnn"),
    (["--bn-kernel", "triton", "--no-channels-last"], "--no-channels-last"),
    (["--bn-kernel", "triton", "--channels-last", "--sync-bn"], "--sync-bn"),
    (["--bn-kernel", "cudnn", "--no-channels-last"], "--no-channels-last"),
    (["--bn-kernel", "cudnn", "--deterministic"], "--deterministic"),
])
def test_impossible_values_are_user_errors(argv, fragment):
    with pytest.raises(UserError) as exc:
        parse_config(argv)
    msg = str(exc.value)
    assert fragment in msg
    assert "\n" not in msg


def test_rank_below_world_size_is_fine():
    cfg = parse_config(["--world-size", "2", "--rank", "1"])
    assert (cfg.world_size, cfg.rank) == (2, 1)


def test_yaml_values_are_validated_too(tmp_path):
    path = write_yaml(tmp_path, "batch-size: 0\n")
    with pytest.raises(UserError, match="batch-size"):
        parse_config(["--config", path])


def test_yaml_impossible_value_fixed_on_the_command_line(tmp_path):
    # Validation runs on the merged result, so the command line can repair a recipe.
    path = write_yaml(tmp_path, "batch-size: 0\n")
    assert parse_config(["--config", path, "-b", "8"]).batch_size == 8


def test_dynamic_loss_scale_spelled_in_capitals():
    cfg = parse_config(["--fp16", "--dynamic-loss-scale", "--loss-scale", "DYNAMIC"])
    assert static_loss_scale(cfg) is None


# ------------------------------------------------------------------------------- the real CLI


def _main_py(*argv):
    # One thread each: these runs go concurrently on a small machine.
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "main.py", *map(str, argv)], cwd=REPO, text=True, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


# One case per path to an error (argparse, validate(), the YAML loader); the other bad values are
# covered in-process above.
BAD_CLI = {
    "unknown-flag": (["--bogus-flag"], "--bogus-flag"),
    "batch-zero": (["-b", "0"], "batch-size"),
    "fp16-and-amp": (["--fp16", "--amp"], "--fp16"),
}


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory):
    """Run every bad command line (and --help) concurrently."""
    yaml_path = tmp_path_factory.mktemp("cli") / "bad.yaml"
    yaml_path.write_text("batch-szie: 4\n")
    cases = dict(BAD_CLI)
    cases["yaml-unknown-key"] = (["--config", str(yaml_path)], "batch-szie")
    procs = {name: _main_py(*argv) for name, (argv, _) in cases.items()}
    procs["--help"] = _main_py("--help")
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        out[name] = (proc.returncode, stdout, stderr)
    return cases, out


@pytest.mark.parametrize("name", list(BAD_CLI) + ["yaml-unknown-key"])
def test_cli_bad_flags_exit_2_with_one_line(cli_results, name):
    cases, out = cli_results
    rc, stdout, stderr = out[name]
    assert rc == 2, (stdout, stderr)
    assert "Traceback" not in stderr and "Traceback" not in stdout
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error:")
    assert cases[name][1] in lines[0]


def _main_py_before_torch(argv: list, env=None) -> list:
    """main.py with ``argv`` in a child: its stderr lines, the last one saying its exit status and
    whether torch was imported by then (``exit 2 False``)."""
    code = ("import runpy, sys\n"
            f"sys.argv = ['main.py', *{argv!r}]\n"
            "try:\n    runpy.run_path('main.py', run_name='__main__')\n"
            "except SystemExit as e:\n    print('exit', e.code, 'torch' in sys.modules, file=sys.stderr)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    return r.stderr.splitlines()


@pytest.mark.parametrize("argv", [["--bogus-flag"], ["--lr", "-1"], ["--help"]])
def test_main_py_answers_the_command_line_before_importing_torch(argv):
    """A typo, a bad value or --help costs a tenth of a second, not the five of importing torch."""
    lines = _main_py_before_torch(argv)
    assert lines[-1] == f"exit {0 if argv == ['--help'] else 2} False", lines[-20:]


@pytest.mark.parametrize("env, message", [
    ({"RANK": "0"}, "RANK and WORLD_SIZE must be set together"),
    ({"RANK": "4", "WORLD_SIZE": "4"}, "rank 4 is outside 0..3 for world size 4 (RANK/WORLD_SIZE environment)"),
    ({"WORLD_SIZE": "two", "RANK": "0"}, "environment variable WORLD_SIZE='two' is not an integer"),
    ({"SLURM_NTASKS": "2", "SLURM_PROCID": "-1"}, "rank -1 is outside 0..1 for world size 2 (SLURM task environment)"),
])
def test_a_wrong_launch_variable_is_named_before_importing_torch(env, message):
    """The launch environment is read with the flags: a stray or wrong RANK, WORLD_SIZE or SLURM
    variable is one line and exit status 2 before torch is imported."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_"))}
    lines = _main_py_before_torch(["--dummy", "-a", "resnet18"], {**clean, **env})
    assert lines[-1] == "exit 2 False", lines[-20:]
    assert len(lines) == 2 and lines[0].startswith("error: ") and message in lines[0], lines


def test_cli_help(cli_results):
    rc, stdout, stderr = cli_results[1]["--help"]
    assert rc == 0, stderr
    assert "--fp16" in stdout
    assert "--batch-size" in stdout
    assert "Traceback" not in stderr


def test_yaml_epoch_range_is_text_not_a_base_60_number(tmp_path):
    """YAML 1.1 reads 2:26 as 146 (sexagesimal); a recipe means the range."""
    path = tmp_path / "r.yaml"
    path.write_text("epochs: 32\nimage-size: 192\nprogressive-resize: 160\nprogressive-ramp: 2:26\n"
                    "weight-decay: 5e-5\n")
    cfg = parse_config(["--config", str(path)])
    assert cfg.progressive_ramp == "2:26" and cfg.weight_decay == pytest.approx(5e-5)
