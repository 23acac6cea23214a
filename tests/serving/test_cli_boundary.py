"""The command line at its edges (issue 39): output files that are not regular files, Ctrl-C,
the progress bar of ``demo`` and ``generate``, and the messages that named the wrong option.

Refusals are checked before the work, as in ``tests/serving/test_cli_errors.py``: loading the model or
setting up the demo fails the test. Nothing here loads the real model (``tests/serving/test_real_model.py``
runs ``generate`` with it); the bar is tested on a ``rich`` console forced to be a terminal.
"""

from __future__ import annotations

import io
import os
import re
import select
import signal
import stat
import subprocess
import sys

import numpy as np
import pytest
from helpers import run_main
from rich.console import Console

import cupaged.demo
import cupaged.models
import cupaged.models.cli
from cupaged import resolve_device
from cupaged.__main__ import main
from cupaged.demo import DemoConfig, ModelConfig, TinyDecoder
from cupaged.demo.real import PROMPTS

GENERATE = ["generate", "--model", "smollm2", "--device", "cpu"]
DEMO = ["demo", "--device", "cpu"]


# ------------------------------------------------------------------------- output files


def commands_with(option: str, path: str) -> list[list[str]]:
    """Every command line that takes ``option`` (``--json``: generate and demo; ``--plot``)."""
    lines = [[*DEMO, option, path]]
    if option == "--json":
        lines.append([*GENERATE, option, path, "hi"])
    return lines


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_a_fifo_is_refused_when_parsing_not_written_after_the_run(
    option, tmp_path, no_work, capsys
):
    """A FIFO's write waits for a reader: the run ended in a hang. Refused, and never opened."""
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    for argv in commands_with(option, str(fifo)):
        status, line = run_main(argv, capsys)
        assert status == 1, line
        assert f"argument {option}: expected a regular file to write, got '{fifo}' (a FIFO)" in (
            line
        ), line
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and os.listdir(tmp_path) == ["out.fifo"]


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_a_device_is_refused_when_parsing(option, no_work, capsys):
    """``/dev/full`` passed the old check (it exists, is no folder, is writable) and failed after
    the run."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    for argv in commands_with(option, "/dev/full"):
        status, line = run_main(argv, capsys)
        assert status == 1, line
        assert "expected a regular file to write, got '/dev/full' (a character device)" in line


def test_a_folder_that_takes_no_new_file_is_refused_when_parsing(no_work, capsys):
    """``/sys`` takes no new file, even for root, whom ``os.access`` says yes to: the file is
    tried, created and removed, when parsing."""
    if not os.path.isdir("/sys/kernel"):
        pytest.skip("no sysfs here")
    for argv in commands_with("--json", "/sys/x.json"):
        status, line = run_main(argv, capsys)
        assert status == 1, line
        assert "argument --json: expected a file this user can write, got '/sys/x.json' (" in line
    assert not os.path.exists("/sys/x.json")


def test_the_parse_check_writes_nothing_and_leaves_no_file(tmp_path, rng):
    from cupaged.models.cli import output_file

    new = tmp_path / "new.json"
    assert output_file(str(new)) == str(new)
    assert not new.exists()  # created to try it, then removed
    existing = tmp_path / "old.json"
    data = rng.bytes(100)
    existing.write_bytes(data)
    before = os.stat(existing)
    assert output_file(str(existing)) == str(existing)
    after = os.stat(existing)
    assert existing.read_bytes() == data and after.st_mtime_ns == before.st_mtime_ns
    assert os.listdir(tmp_path) == ["old.json"]


def test_the_final_write_refuses_a_fifo_put_there_since_without_waiting(tmp_path, rng):
    """The file can be swapped for a FIFO during the run: the last write refuses it at once,
    with a reader (a regular write would fill it) or without one (a regular open would wait)."""
    from cupaged.demo.report import write_output

    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError):  # no reader: ENXIO
        write_output(fifo, rng.bytes(10))
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(ValueError, match="expected a regular file to write, got '.*out.fifo'"):
            write_output(fifo, rng.bytes(10))
        assert os.read(reader, 10) == b""  # nothing was written into it
    finally:
        os.close(reader)


def test_the_demos_json_refuses_a_fifo_with_a_reader(tmp_path):
    """``write_json`` wrote into a FIFO that had a reader (and waited for one that had none)."""
    from cupaged import CacheSpec
    from cupaged.demo import MemoryReport, write_json

    fifo = tmp_path / "run.json"
    os.mkfifo(fifo)
    report = MemoryReport.compute(CacheSpec(1, 1, 64, "float32", 16), 20, 256, [])
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(ValueError, match="expected a regular file to write"):
            write_json(fifo, {"requests": 1}, report, [])
        assert os.read(reader, 10) == b""  # nothing was written into it
    finally:
        os.close(reader)


def test_the_final_write_replaces_what_a_regular_file_held(tmp_path, rng):
    from cupaged.demo.report import write_output

    target = tmp_path / "out.json"
    target.write_bytes(rng.bytes(1000))
    data = rng.bytes(10)
    write_output(target, data)
    assert target.read_bytes() == data


# ----------------------------------------------------------------------- exit statuses


def interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("command", ["demo", "generate"])
def test_ctrl_c_is_one_line_and_status_130(command, monkeypatch, capsys):
    """A KeyboardInterrupt where the work runs: the demo's serving loop, generate's model load."""
    monkeypatch.setattr(cupaged.demo.Demo, "run", interrupt)
    monkeypatch.setattr(cupaged.models, "load_model", interrupt)
    argv = [*DEMO, "--requests", "1"] if command == "demo" else [*GENERATE, "hi"]
    status, line = run_main(argv, capsys)
    assert (status, line) == (130, "cupaged: interrupted")


SERVE_THEN_SAY_SO = """
import sys
import cupaged.demo
from cupaged.__main__ import main

serve = cupaged.demo.Demo.run

def run(self, on_step=None):
    print("serving", flush=True)
    return serve(self, on_step)

cupaged.demo.Demo.run = run
sys.exit(main(["demo", "--device", "cpu", "--requests", "5000", "--new-tokens", "100"]))
"""


def test_sigint_while_the_demo_serves_ends_it_with_one_line_and_130():
    """A real SIGINT, sent while the engine runs (a run of minutes): one line, status 130."""
    process = subprocess.Popen(
        [sys.executable, "-c", SERVE_THEN_SAY_SO],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready, _, _ = select.select([process.stdout], [], [], 120)
        assert ready and process.stdout.readline() == "serving\n", process.stderr.read()
        select.select([], [], [], 1.0)  # let it step a while: the signal lands in the engine
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    assert process.returncode == 130, err
    assert err == "cupaged: interrupted\n", err


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "cupaged: error: expected a command: demo, example, generate or model (see cupaged"),
        (["model"], "cupaged model: error: expected an action: fetch (see cupaged model --help)"),
    ],
)
def test_no_command_is_a_one_line_refusal_with_status_1(argv, message, capsys):
    """argparse's habit was status 2 and the whole help on stdout; the docs say 1, one line."""
    try:
        main(argv)
    except SystemExit as exit_info:
        status = exit_info.code
    else:
        status = None
    captured = capsys.readouterr()
    assert status == 1 and captured.out == "", (status, captured.out)
    assert captured.err.startswith(message) and captured.err.count("\n") == 1, captured.err


def test_the_docstrings_say_every_refusal_exits_1():
    for module in (sys.modules["cupaged.__main__"], cupaged.models.cli):
        text = " ".join(module.__doc__.split())
        assert "status 2" not in text and "status 1" in text and "130" in text, module.__name__


# ------------------------------------------------------------------------- progress bar

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def last_frame(output: str) -> str:
    """The bar as it stands at the end of ``output`` (a terminal's text, without its escapes)."""
    return ANSI.sub("", output.split("\r")[-1]).strip()


def terminal() -> Console:
    return Console(file=io.StringIO(), force_terminal=True, width=110)


def test_the_bar_ends_at_the_count_it_reached_and_stays():
    """Samples that end at EOS generate fewer tokens than the total counts (277 of 316): the
    bar ends at the count, made its total, and is left on the screen (not erased)."""
    from cupaged.models.cli import token_progress

    console = terminal()
    with token_progress(console, 316, "decoding") as progress:
        for done in (0, 100, 277):
            progress(done)
    output = console.file.getvalue()
    frame = last_frame(output)
    assert re.fullmatch(r"decoding ━+ 277/277 tokens [\d,]+ tokens/s 0:00:\d\d", frame), frame
    assert output.rstrip().endswith("\x1b[?25h")  # cursor shown again, no line erased after


def test_the_bar_writes_nothing_where_there_is_no_terminal():
    from cupaged.models.cli import token_progress

    console = Console(file=io.StringIO(), width=110)
    assert not console.is_terminal
    with token_progress(console, 10, "generating") as progress:
        progress(10)
    assert console.file.getvalue() == ""


def test_generate_reports_every_step_to_the_bar_and_it_ends_at_eos(rng):
    """``generate``'s bar counts the engine's tokens; a prompt that ends at EOS at once leaves
    the count short of the total, and the bar ends at the count."""
    from cupaged.models import generate
    from cupaged.models.cli import token_progress

    model = TinyDecoder(ModelConfig(), np, seed=int(rng.integers(1000)))
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 19)]
    first = generate(model, model.make_cache(16, 16), prompts[:1], 1)[0][0][0]
    counts = []
    console = terminal()
    with token_progress(console, 2 * 6, "generating") as progress:

        def step(done: int) -> None:
            counts.append(done)
            progress(done)

        outputs = generate(model, model.make_cache(16, 16), prompts, 6, eos_id=first, on_step=step)
    generated = sum(len(samples[0]) for samples in outputs)
    assert outputs[0][0] == [first] and generated < 12
    assert counts == sorted(counts) and counts[-1] == generated
    assert f"{generated}/{generated} tokens" in last_frame(console.file.getvalue())


def test_the_seeded_demo_generates_every_token_its_total_counts():
    config = DemoConfig(device="cpu", requests=3, new_tokens=4, prompt_len=20, num_blocks=40)
    session = cupaged.demo.Demo(config)
    counts = []
    run = session.run(on_step=counts.append)
    assert counts[-1] == run.summary["tokens_generated"] == session.total_tokens


def test_the_demo_leaves_its_bar_on_a_terminal(monkeypatch, capsys):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich: the console is a terminal
    argv = [*DEMO, "--requests", "2", "--new-tokens", "3", "--prompt-len", "20"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    done = int(re.search(r"tokens generated\s*│\s*(\d+)", ANSI.sub("", out)).group(1))
    # What stands on the screen above the summary: the bar's last frame, not an erased line.
    before_summary = out[: out.index("cupaged demo")]
    frame = last_frame(before_summary.rstrip("\n"))
    assert re.fullmatch(rf"decoding ━+ {done}/{done} tokens .*", frame), repr(before_summary)


# ------------------------------------------------------------------------------ messages


@pytest.mark.skipif(resolve_device(None) == "cuda", reason="needs a machine without a GPU")
@pytest.mark.parametrize("command", ["generate", "demo", "example"])
def test_a_missing_gpu_names_the_option_to_use(command, no_work, capsys):
    argv = [command, "--device", "cuda"]
    if command == "generate":
        argv += ["--model", "smollm2", "hi"]
    status, line = run_main(argv, capsys)
    assert status == 1, line
    assert f"cupaged {command}: error: --device cuda: expected a usable GPU, got none (" in line
    assert "use --device cpu" in line and "device='cpu'" not in line, line


def test_a_block_size_too_small_for_the_pool_is_named(no_work, capsys):
    status, line = run_main([*DEMO, "--block-size", "7"], capsys)
    assert status == 1, line
    assert (
        "--num-blocks 20 of --block-size 7: expected room for one sequence of --max-len 256 "
        in (line)
    ), line
    assert "at least 39 blocks of 7 tokens, got 20" in line, line


def test_more_requests_than_the_real_model_has_prompts_are_refused(no_work, capsys):
    status, line = run_main([*DEMO, "--model", "smollm2", "--requests", "50"], capsys)
    assert status == 1, line
    assert f"--requests: expected at most the {len(PROMPTS)} built-in prompts" in line, line
    assert line.endswith("got 50 (see cupaged demo --help)"), line


def test_the_demos_default_requests_depend_on_the_model():
    assert DemoConfig().requests == 32
    assert DemoConfig(model="smollm2").requests == len(PROMPTS)
    assert DemoConfig(model="smollm2", requests=3).requests == 3


@pytest.mark.parametrize("value", ["1e39", "1e-50"])  # inf, 0 in float32
@pytest.mark.parametrize("command", ["generate", "demo"])
def test_kv_scales_past_float32_are_refused_when_parsing(command, value, no_work, capsys):
    base = [*GENERATE] if command == "generate" else [*DEMO]
    argv = [*base, "--kv-dtype", "float8_e4m3", "--kv-scales", value]
    status, line = run_main([*argv, "hi"] if command == "generate" else argv, capsys)
    assert status == 1, line
    assert (
        "argument --kv-scales: expected 'auto' or a positive number, finite in float32, got "
        in line
    ), line
