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
    first = next(i for i, line in enumerate(lines) if line.startswith("LoRA-A inputs per GPU (modelled)"))
    assert "decoder.layers.0" not in doctor.stdout
    assert max(map(len, lines)) <= 120 and doctor.stderr == ""
    # how the figures were obtained, before them: rules, not a built model; bytes modelled, none on a GPU
    said = " ".join(" ".join(lines[:first]).split())
    assert "how obtained: decisions from regather's eligibility rules" in said and "bytes modelled" in said
    assert "none measured on a GPU" in said


@pytest.mark.parametrize("argv", [["--model", "qwen3-8b", "--tp", "2", "--seq", "8192"],
                                  ["--recipe", "qwen3-8b-reference"],
                                  ["--front-end", "torchtitan", "--tp", "2", "--seq", "8192"]],
                         ids=["qwen3-8b", "reference-recipe", "torchtitan"])
def test_estimate_fits_120_columns(argv):
    """Its notes reached 295 columns with the reference's recipe; wrapped now, the figures unchanged."""
    out = regather("estimate", *argv)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert max(map(len, out.stdout.splitlines())) <= 120
    # every figure says how it was obtained, above the figures (torchtitan's too)
    head = " ".join(out.stdout.split("\n\n[")[0].split())
    assert "how obtained:" in head and "none measured on a GPU yet" in head


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
    (["estimate", "--model", "qwen3-8b", "--num-experts", "8"], ["--num-experts 8", "Qwen3-8B", "--topk and --moe-ffn"]),
    # issue 48, as a new user met it: each refused before any work, in the sub-command's name
    (["estimate", "--experts", "8"], ["'8'", "sequential, grouped", "the number of experts is --num-experts 8"]),
    (["demo", "--timeout", "0"], ["--timeout", "0 is not a positive number"]),
    (["bench", "--timeout", "0"], ["--timeout", "0 is not a positive number"]),
    (["bench", "--out", "/proc/nope"], ["--out /proc/nope", "cannot write there"]),
    (["estimate", "--model", "qwen3-8b", "--redispatch-expert-inputs"], ["--redispatch-expert-inputs",
                                                                         "Qwen3-8B has no experts"]),
    (["estimate", "--model", "qwen3-8b", "--expert-lora", "per-expert"], ["--expert-lora per-expert",
                                                                          "Qwen3-8B has no experts"]),
    (["estimate", "--later-stage", "--pp", "1"], ["--later-stage needs --pp > 1"]),
    (["estimate", "--targets", "linear_qkv,linear_qkv"], ["linear_qkv named more than once"]),
    (["bench", "--render", "bench.json", "--moe"], ["--render", "--moe", "runs nothing"]),
    (["estimate", "--hiden", "64"], ["unknown flag --hiden", "did you mean --hidden"]),
    (["bench", "--per-expert"], ["--per-expert is now --expert-lora per-expert"]),
    (["bench", "--moe", "--dispatcher", "flex"], ["--dispatcher flex", "alltoall or allgather"]),
    (["estimate", "--model", "qwen3-30b-a3b", "--tp", "4", "--ep", "4", "--dispatcher", "flex"],
     ["--dispatcher flex", "alltoall and allgather"]),
    (["bench", "--lora-alpha", "0"], ["--lora-alpha", "0 is not a positive number"]),
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
        assert "``" not in text and ":mod:" not in text and ":class:" not in text, command  # no raw reST
        assert len(text.split("\n\n")[1]) > 100, command  # a description of what the command does
        assert "--tp TP tensor parallel size" in " ".join(text.split()), command  # every flag has its help
    doctor = " ".join(regather("doctor", "--help").stdout.split())
    assert "sequence parallelism off" in doctor
    # docs/tools.md's convention: 2 for what the parser sees, 1 for a layout refused after parsing
    assert "1 when a finding is an error or a layout is refused after parsing" in doctor
    assert "2 for what the command line's parser refuses" in doctor


# -- issue 48: the CLI as one tool, sizes that are the user's, reports that say what they are ---------------


def test_version():
    from regather import __version__

    for argv in (["--version"], ["estimate", "--version"]):
        done = regather(*argv)
        assert done.returncode == 0 and done.stdout == f"regather {__version__}\n", done


@pytest.mark.parametrize("argv", [["--version"], ["estimate", "--help"], ["estimate", "--seq", "0"],
                                  ["bench", "--strategies", "foo"], ["demo", "--steps", "0"],
                                  ["doctor", "--strategy", "foo"], ["estimate", "--model", "qwen3-8b"],
                                  ["estimate", "--front-end", "torchtitan"]])
def test_parsing_refusals_and_estimate_load_no_torch(argv):
    """The command's parser, its parse-time refusals and estimate (analytic) never import torch: each is
    a fraction of a second where torch's import is one to two (the reason tables they read are torch-free)."""
    import subprocess
    import sys

    code = ("import sys\nfrom regather.tools.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert done.stderr.splitlines()[-1] == "False", done.stderr


def test_custom_sizes_are_the_users():
    """The sizes given win: no preset's query groups or head width inherited, no preset's name, no Bridge
    recipe; the bytes are estimate's for exactly these sizes (bench measures them byte for byte:
    tests/distributed/tools/test_bench.py), and giving the derived sizes changes nothing."""
    import json

    from regather.tools.estimate import Model, Run, estimate

    argv = ["estimate", "--spec", "local", "--hidden", "64", "--layers", "2", "--heads", "4", "--ffn", "128", "--tp",
            "2", "--seq", "64", "--micro-batch", "2", "--dtype", "float32"]
    plain, explicit = regather(*argv, "--json"), regather(*argv, "--json", "--kv-heads", "4", "--head-dim", "16")
    assert plain.returncode == explicit.returncode == 0, plain.stderr + explicit.stderr
    assert plain.stdout == explicit.stdout
    doc = json.loads(plain.stdout)
    assert doc["model"] | {"vocab": None} == {"name": "custom", "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 4,
                                              "head_dim": 16, "ffn": 128, "experts": 0, "moe_ffn": 0, "topk": 0,
                                              "vocab": None}
    # what the sizes leave of the preset: its vocabulary, its gated MLP and q / k norms (the per-GPU total's)
    model = Model(hidden=64, layers=2, heads=4, ffn=128, vocab=doc["model"]["vocab"], gated_mlp=True, qk_norm=True)
    run = Run(tp=2, seq=64, micro_batch=2, dtype="float32", spec="local")
    want = estimate(model, run, tuple(doc["strategies"]), gpu_gib=80)
    assert doc["strategies"] == json.loads(json.dumps(want))
    assert doc["strategies"]["gather"]["adapter_input_by_target"]["linear_proj"] == 2 * 64 * 2 * 64 * 4 // 2
    text = regather(*argv, "--targets", "linear_qkv,linear_fc1")
    assert text.returncode == 0 and text.stdout.startswith("custom: h=64, 2 layers"), text.stdout + text.stderr
    assert "Qwen3-8B" not in text.stdout and "4 heads / 4 kv" in text.stdout
    assert "Bridge PEFT recipe: none, custom sizes are no recipe's model" in text.stdout
    assert "NOT the recipe's targets" not in text.stdout and "reference measured" not in text.stdout


def test_lora_alpha_takes_a_number():
    """torchtitan's alpha is a float: 16.5 passes the parser (here another flag is refused, so nothing runs)."""
    done = regather("bench", "--lora-alpha", "16.5", "--heads", "5")
    assert done.returncode == 1 and "--heads 5 is not divisible by --tp 2" in done.stderr, done.stderr
    assert "alpha" not in done.stderr


def test_one_vocabulary():
    """A flag two commands take is the same flag: spelling, destination, accepted values, the help's own
    text; every flag of every command comes from the vocabulary; every flag says what it does, and one
    whose default is None says what that means."""
    from regather.tools.cli import build_parser
    from regather.tools.estimate.vocabulary import FLAGS

    table = {name: flag for flag in FLAGS for name in flag.names}
    seen: dict = {}
    for command, parser in build_parser().commands.items():
        for action in parser._actions:
            if action.dest in ("help", "version"):
                continue
            flag = table[action.option_strings[0]]  # KeyError: a flag added outside the vocabulary
            assert action.help and action.help.startswith(flag.help), (command, action.option_strings)
            if action.default is None and action.nargs != 0:
                assert "default" in action.help, (command, action.option_strings, action.help)
            shape = (tuple(action.option_strings), action.dest, action.choices, action.type, action.metavar)
            assert seen.setdefault(action.option_strings[0], shape) == shape, (command, action.option_strings)
    shared = {name for name, flag in table.items() if len(flag.commands) > 1}
    assert {"--experts", "--num-experts", "--dispatcher", "--expert-lora", "--tp", "--seq", "--targets"} <= shared


def test_lora_docstring_names_every_field():
    import dataclasses

    import regather

    doc = regather.LoRA.__doc__
    assert all(f"``{f.name}``" in doc for f in dataclasses.fields(regather.LoRA))
    assert "Megatron Bridge's fields" in doc and "regather's additions" in doc


REPORTS = [("cpu-recompute", "regather bench: GPT 2 layers, hidden 512", ["time inside the producers' recomputes"]),
           ("cpu-moe", "regather bench --moe: MoE GPT", ["re-dispatches: rank 0's"]),
           ("cpu-torchtitan", "regather bench --torchtitan: torchtitan llama3", ["LoRA over frozen, allocator: "])]


@pytest.mark.parametrize("name,title,said", REPORTS, ids=[r[0] for r in REPORTS])
def test_bench_report_opens_with_what_ran_on_what_and_its_columns(name, title, said, tmp_path):
    """What a run prints (here: re-printed from the committed bench.json, the same function) opens with the
    model and run, 'measured on CPU', the command and a legend of the columns, before any table."""
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "benchmarks" / "results" / name / "bench.json"
    done = regather("bench", "--render", str(path))
    assert done.returncode == 0, done.stderr
    head = done.stdout.split("\n\n")[0]
    flat = " ".join(head.split())
    assert head.startswith(title) and "measured on CPU (gloo): 2 ranks on" in flat and "\ncommand: regather bench" in head
    assert "\ncolumns:\n" in head and all(s in " ".join(done.stdout.split()) for s in said), head
    assert head.rstrip().endswith("CPU times show relative cost only; absolute times need a GPU.")
    assert max(map(len, done.stdout.splitlines())) <= 120
    if name == "cpu-torchtitan":  # under --ac the report says which bytes count
        summary = json.loads(path.read_text())
        summary["spec"]["ac"] = "selective"
        (tmp_path / "bench.json").write_text(json.dumps(summary))
        flat = " ".join(regather("bench", "--render", str(tmp_path / "bench.json")).stdout.split())
        assert "--ac selective: the saved-tensor hooks see nothing a checkpointed block keeps" in flat
        assert "the allocator column is the figure that counts" in flat
