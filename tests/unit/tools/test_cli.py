"""The ``regather`` console script as a user meets it (run as a subprocess, as installed): one story across
doctor and estimate, bad input refused the same way by every command, ``--help`` that says what a flag does.

Each call starts a fresh interpreter that imports torch (about 2 s of CPU), so the matrix stays small."""

import re

import pytest
from regather_console import NOT_INSTALLED, regather, script

pytestmark = pytest.mark.timeout(300)

if script() is None:
    pytest.skip(NOT_INSTALLED, allow_module_level=True)


def test_doctor_and_estimate_print_the_same_saving():
    """The issue's check: doctor's summary and estimate's row for the strategy doctor looks at."""
    argv = ["--model", "qwen3-8b", "--tp", "2", "--seq", "8192"]
    doctor, estimate = regather("doctor", *argv), regather("estimate", *argv)
    assert doctor.returncode == 0 and estimate.returncode == 0, (doctor.stderr, estimate.stderr)
    saved = re.search(r"this run saves (\d[\d.]* GB \([\d.]+ GiB\))", doctor.stdout).group(1)
    row = re.search(r"\[regather\]\n.*\n  saved vs gather\s+: (.*)\n", estimate.stdout).group(1)
    assert saved == row
    assert "= regather estimate's 'regather' row with the same arguments" in doctor.stdout
    # the summary first; one line per adapter only with --verbose
    lines = doctor.stdout.splitlines()
    assert lines[3].startswith("LoRA-A inputs per GPU") and "decoder.layers.0" not in doctor.stdout
    assert max(map(len, lines)) <= 120 and doctor.stderr == ""


@pytest.mark.parametrize("argv", [["--model", "qwen3-8b", "--tp", "2", "--seq", "8192"],
                                  ["--recipe", "qwen3-8b-reference"],
                                  ["--front-end", "torchtitan", "--tp", "2", "--seq", "8192"]],
                         ids=["qwen3-8b", "reference-recipe", "torchtitan"])
def test_estimate_fits_120_columns(argv):
    """Its notes reached 295 columns with the reference's recipe; wrapped now, the figures unchanged."""
    out = regather("estimate", *argv)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert max(map(len, out.stdout.splitlines())) <= 120


def test_doctor_verbose_lists_every_adapter():
    from regather.tools.estimate import PRESETS, Run, saved_vs_gather

    out = regather("doctor", "--recompute-adapter-inputs", "--verbose").stdout
    assert sum(line.startswith("[INFO   ] adapter: decoder.layers.") for line in out.splitlines()) == 4 * 36
    run = Run(tp=2, seq=8192, micro_batch=1, dtype="bfloat16", spec="te", attention_keeps_output=True)
    saved = saved_vs_gather(PRESETS["qwen3-8b"], run, "regather-recompute")
    assert f"saving: estimated LoRA-A input memory saved per GPU: {saved:,} bytes" in out


def test_doctor_and_estimate_apply_the_runs_te_release_rule():
    """TE 2.20.2 is read: doctor's qkv / fc1 rebuild their input from TE's fused norm (TE's ln_out released)
    and estimate --spec te assumes it by default; 2.21.0 is not: doctor shows qkv / fc1 keeping TE's ln_out
    with the rule's reason, and the saving without the release (estimate's row for 2.21.0, less than 2.20.2's)."""
    from regather.tools.estimate import PRESETS, Run, saved_vs_gather

    argv = ["--model", "qwen3-8b", "--tp", "2", "--seq", "8192", "--recompute-adapter-inputs"]
    read, newer = regather("doctor", *argv, "--te-version", "2.20.2"), regather("doctor", *argv, "--te-version", "2.21.0")
    estimate = regather("estimate", "--model", "qwen3-8b", "--tp", "2", "--seq", "8192", "--spec", "te")
    assert read.returncode == newer.returncode == estimate.returncode == 0, (read.stderr, newer.stderr, estimate.stderr)
    flat = {name: " ".join(out.stdout.split()) for name, out in (("read", read), ("newer", newer), ("est", estimate))}
    assert "Transformer Engine 2.20.2: qkv / fc1 release the ln_out TE keeps" in flat["read"]
    assert "linear_qkv x35, layers 1-35: regather, input recomputed from the fused LayerNorm of the TE base" in flat["read"]
    assert "linear_fc1 x36: regather, input recomputed from the fused LayerNorm of the TE base" in flat["read"]
    assert "(TE 2.20.2, the newest read, assumed) qkv / fc1 rebuilt from the norm's input TE keeps" in flat["est"]
    why = ("TE's ln_out is kept: Transformer Engine 2.21.0 is outside the versions read (2.3 to 2.20): whether its "
           "backward reads the LayerNorm output it keeps is not known")
    for kind in ("linear_qkv", "linear_fc1"):
        assert f"{kind} x36: regather, input kept (recompute asked: {why})" in flat["newer"]
    saved = {name: re.search(r"this run saves (\d[\d.]* GB)", flat[name]).group(1) for name in ("read", "newer")}
    run = dict(tp=2, seq=8192, micro_batch=1, dtype="bfloat16", spec="te", attention_keeps_output=True)
    want = {name: saved_vs_gather(PRESETS["qwen3-8b"], Run(**run, te_version=v), "regather-recompute")
            for name, v in (("read", "2.20.2"), ("newer", "2.21.0"))}
    assert want["newer"] < want["read"]
    assert saved == {name: f"{n / 1e9:.3f} GB" for name, n in want.items()}


REFUSED = [
    (["doctor", "--strategy", "foo"], ["'foo'", "gather", "regather", "lowrank"]),
    (["doctor", "--targets", "linear_qkv,foo"], ["foo", "linear_qkv, linear_proj, linear_fc1, linear_fc2"]),
    (["doctor", "--tp", "3"], ["sequence 8192 is not divisible by TP 3"]),
    (["estimate", "--tp", "3", "--no-sp"], ["heads 32", "query groups 8", "TP 3"]),
    (["estimate", "--strategies", "regather,foo"], ["'foo'", "regather-recompute"]),
    (["estimate", "--seq", "0"], ["--seq", "0 is not a positive integer"]),
    (["bench", "--strategies", "foo"], ["'foo'", "regather"]),
    (["bench", "--torchtitan", "--tp", "1"], ["--tp 1", "at least 2 ranks"]),
    (["demo", "--steps", "0"], ["--steps", "0 is not a positive integer"]),
    (["demo", "--tp", "3"], ["--heads 4 is not divisible by --tp 3"]),
    (["bench", "--heads", "5"], ["--heads 5 is not divisible by --tp 2"]),
    (["bench", "--targets", "linear_foo"], ["'linear_foo'", "linear_qkv"]),
    (["bench", "--canonical", "--targets", "linear_qkv"], ["'linear_qkv'", "name the projections", "linear_q"]),
    (["bench", "--render", "/nonexistent/bench.json"], ["/nonexistent/bench.json", "No such file"]),
    (["bench", "--targets", "linear_q"], ["'linear_q'", "linear_qkv", "with --canonical"]),
    (["doctor", "--te-version", "abc"], ["'abc'", "2.18"]),
    (["estimate", "--model", "qwen3-8b", "--experts", "8"], ["--experts 8", "Qwen3-8B", "--topk and --moe-ffn"]),
    ]


@pytest.mark.parametrize("argv,names", REFUSED, ids=[" ".join(argv) for argv, _ in REFUSED])
def test_bad_input_is_one_line_naming_the_value(argv, names):
    """Non-zero exit, one line on stderr naming the value and what is accepted, no traceback, nothing run."""
    done = regather(*argv)
    assert done.returncode != 0 and done.stdout == "", (done.returncode, done.stdout)
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"regather {argv[0]}") and all(n in done.stderr for n in names), done.stderr


def test_doctor_takes_estimates_dtype_names():
    """``--dtype bf16`` as estimate takes it: the same report as ``bfloat16``."""
    short, long = regather("doctor", "--dtype", "bf16"), regather("doctor", "--dtype", "bfloat16")
    assert short.returncode == long.returncode == 0, short.stderr
    assert short.stdout == long.stdout


def test_render_refuses_a_file_that_is_not_a_bench_json(tmp_path):
    for text, why in (("{bad", "not a bench.json (Expecting"), ("[1]", 'not a bench.json (no "spec")')):
        (tmp_path / "bench.json").write_text(text)
        done = regather("bench", "--render", str(tmp_path / "bench.json"))
        assert done.returncode == 1 and done.stdout == "" and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.startswith(f"regather bench: --render {tmp_path / 'bench.json'}: {why}")
        assert len(done.stderr.splitlines()) == 1


@pytest.mark.parametrize("argv,status", [(["estimate", "--strategies", "foo"], 2), (["bench", "--strategies", "foo"], 2),
                                         (["bench", "--targets", "linear_foo"], 2),
                                         (["bench", "--canonical", "--targets", "linear_qkv"], 1)])
def test_exit_status_2_for_the_parser_1_after_parsing(argv, status):
    done = regather(*argv)
    assert done.returncode == status, done.stderr
    assert done.stderr.rstrip().endswith("(--help lists the options)") == (status == 2), done.stderr


def test_help_says_what_a_flag_does():
    for command in ("doctor", "estimate", "bench", "demo"):
        text = regather(command, "--help").stdout
        assert "(default: True)" not in text and "(default: False)" not in text and "(default: None)" not in text
    doctor = " ".join(regather("doctor", "--help").stdout.split())
    assert "sequence parallelism off" in doctor
    # docs/tools.md's convention: 2 for what the parser sees, 1 for a layout refused after parsing
    assert "1 when a finding is an error or a layout is refused after parsing" in doctor
    assert "2 for what the command line's parser refuses" in doctor
