"""``dmuon-trace``'s shared conventions: one exit-code convention for every
subcommand, errors on stderr, ``--out`` checked before parsing, subcommands from one table."""

from __future__ import annotations

import io
import os

import pytest

from tracer import cli, progress
from tracer.cli import EXIT_BAD_INPUT, EXIT_NOTHING_FOUND, EXIT_OK, SUBCOMMANDS, main

NCCL_LOG = "nccl/nccl_coll_allreduce_tf_2gpu__nccl_issue203.log"
FR_DIR = "flight_recorder"
NSYS = "nsys/nsys2026.2_h100_2gpu_nccl_sendrecv__nsys-ai_mfu_2gpu_after.sqlite"
INPUTS = {"nccl": NCCL_LOG, "fr": FR_DIR, "nsys": NSYS}


def test_help_lists_every_subcommand_and_the_exit_codes(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    text = capsys.readouterr().out
    assert exc.value.code == 0
    for name in SUBCOMMANDS:
        assert name in text
    assert "0 events written" in text and "3 nothing found" in text and "dmuon-verify check" in text
    assert "check" not in SUBCOMMANDS  # moved to dmuon-verify


@pytest.mark.parametrize("command", sorted(INPUTS))
def test_each_subcommand_writes_events_and_exits_0(shared_fixtures, tmp_path, capsys, command):
    out = tmp_path / "deep" / "events.parquet"
    assert main([command, str(shared_fixtures / INPUTS[command]), "--out", str(out)]) == EXIT_OK
    assert out.is_file() and "wrote" in capsys.readouterr().out


@pytest.mark.parametrize("command", sorted(INPUTS))
def test_out_a_folder_is_a_clear_error_before_parsing(shared_fixtures, tmp_path, capsys, command):
    assert main([command, str(shared_fixtures / INPUTS[command]), "--out", str(tmp_path)]) == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    assert f"Invalid --out {str(tmp_path)!r}: it is a folder" in captured.err and not captured.out


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere: permissions cannot fail")
def test_out_unwritable_is_a_clear_error(shared_fixtures, tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert main(["fr", str(shared_fixtures / FR_DIR), "--out", str(locked / "e.parquet")]) == 2
    assert "is not writable" in capsys.readouterr().err


def test_output_path_problems(tmp_path):
    assert cli.output_path_problem(tmp_path / "a" / "b" / "e.parquet") is None
    assert "is a folder" in cli.output_path_problem(tmp_path)
    (tmp_path / "file").write_text("x")
    assert "is not a folder" in cli.output_path_problem(tmp_path / "file" / "e.parquet")
    (tmp_path / "ro").mkdir()
    os.chmod(tmp_path / "ro", 0o500)
    problem = cli.output_path_problem(tmp_path / "ro" / "e.parquet")
    assert problem is None if os.geteuid() == 0 else "not writable" in problem


@pytest.mark.parametrize("command, name", [("fr", NCCL_LOG), ("nsys", NCCL_LOG), ("fr", NSYS)])
def test_wrong_kind_of_input(shared_fixtures, tmp_path, capsys, command, name):
    rc = main([command, str(shared_fixtures / name), "--out", str(tmp_path / "e.parquet")])
    err = capsys.readouterr().err
    # fr: every file unreadable -> nothing found; nsys: not an SQLite export -> bad input
    assert rc == (EXIT_NOTHING_FOUND if command == "fr" else EXIT_BAD_INPUT)
    assert err.startswith(f"dmuon-trace {command}: error:") and name.split("/")[-1] in err
    assert not (tmp_path / "e.parquet").exists()


def test_missing_path_and_bad_arguments_exit_2(tmp_path, capsys):
    assert main(["fr", str(tmp_path / "absent"), "--out", str(tmp_path / "e.parquet")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["bogus"])
    assert exc.value.code == 2


def test_progress_only_for_big_inputs_on_a_terminal(monkeypatch):
    class Tty:
        def isatty(self):
            return True

    big = progress.PROGRESS_MIN_BYTES
    assert not progress.wants_progress(big)  # pytest captures stderr: not a terminal
    monkeypatch.setattr(progress.sys, "stderr", Tty())
    assert progress.wants_progress(big) and not progress.wants_progress(big - 1)
    assert not progress.wants_progress(big, enabled=False)


def test_training_bar_only_on_a_terminal(monkeypatch):
    """verify-traffic's step bar (verify.run.main) printed into CI logs and pipes before."""
    assert progress.terminal_bar(10, desc="training steps", unit="step") is None  # captured
    monkeypatch.setattr(progress.sys, "stderr", None)  # pythonw, a closed console
    assert progress.terminal_bar(10, desc="training steps", unit="step") is None

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(progress.sys, "stderr", Tty())
    bar = progress.terminal_bar(10, desc="training steps", unit="step")
    bar.update(3)
    bar.close()
    assert "training steps" in progress.sys.stderr.getvalue() and bar.n == 3


# ------------------------------------------------------------ gzip, folders, stderr

PROFILER = "profiler/torch2.13cpu_gloo_ws4_profiler_chrome_trace_collective_events_rank0.json"
FR_JSON = "flight_recorder/torch2.13cpu_gloo_ws4_flight_recorder_dump_fr_trace_json_rank0.json"
GZ_INPUTS = {"nccl": NCCL_LOG, "fr": FR_JSON, "profiler": PROFILER}


@pytest.mark.parametrize("command", sorted(GZ_INPUTS))
@pytest.mark.parametrize("name", ["rank0.json.gz", "rank0_no_extension"])
def test_gzip_inputs_are_read_whatever_the_name(shared_fixtures, tmp_path, capsys, command, name):
    import gzip

    path = tmp_path / name
    path.write_bytes(gzip.compress((shared_fixtures / GZ_INPUTS[command]).read_bytes()))
    out = tmp_path / "e.parquet"
    assert main([command, str(path), "--out", str(out)]) == EXIT_OK, capsys.readouterr().err
    plain = tmp_path / "p.parquet"
    assert main([command, str(shared_fixtures / GZ_INPUTS[command]), "--out", str(plain)]) == 0
    import pyarrow.parquet as pq

    assert pq.read_table(out).num_rows == pq.read_table(plain).num_rows > 0


@pytest.mark.parametrize("command", sorted(GZ_INPUTS))
def test_truncated_gzip_is_named_with_gzip_in_the_reason(shared_fixtures, tmp_path, capsys,
                                                         command):
    import gzip

    blob = gzip.compress((shared_fixtures / GZ_INPUTS[command]).read_bytes())
    path = tmp_path / "cut.gz"
    path.write_bytes(blob[:len(blob) // 2])
    rc = main([command, str(path), "--out", str(tmp_path / "e.parquet")])
    cap = capsys.readouterr()
    assert rc in (EXIT_BAD_INPUT, EXIT_NOTHING_FOUND)
    assert "gzip" in cap.out + cap.err and "cut.gz" in cap.out + cap.err


@pytest.mark.parametrize("command", sorted(GZ_INPUTS))
def test_every_folder_entry_is_read_or_named_and_exit_is_2(shared_fixtures, tmp_path, capsys,
                                                           command):
    folder = tmp_path / "in"
    folder.mkdir()
    good = GZ_INPUTS[command]
    (folder / ("rank0.json" if command != "nccl" else "rank0.log")).write_bytes(
        (shared_fixtures / good).read_bytes())
    (folder / "zz_broken.json").symlink_to(tmp_path / "absent")
    os.mkfifo(folder / "zz_fifo.json")  # never opened: a read would block
    (folder / "zz_notes.json").write_bytes(b"\x00\x01binary" * 100)
    out = tmp_path / "e.parquet"
    assert main([command, str(folder), "--out", str(out)]) == EXIT_BAD_INPUT
    cap = capsys.readouterr()
    assert out.is_file()
    for name in ("zz_broken.json", "zz_fifo.json", "zz_notes.json"):
        assert name in cap.out, (name, cap.out)
    assert "broken symlink" in cap.out and "FIFO" in cap.out
    assert cap.err.startswith(f"dmuon-trace {command}: error: 3 file(s) not read")


@pytest.mark.parametrize("command", ["nccl", "fr", "nsys", "profiler"])
def test_errors_go_to_stderr_in_every_subcommand(tmp_path, capsys, command):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    rc = main([command, str(tmp_path / "absent"), "--out", str(tmp_path / "e.parquet")])
    cap = capsys.readouterr()
    assert rc == EXIT_BAD_INPUT and cap.out == ""
    assert cap.err.startswith(f"dmuon-trace {command}: error:") and "absent" in cap.err
    if command in ("profiler", "nsys"):
        rc = main([command, str(bad), "--out", str(tmp_path / "e.parquet")])
        cap = capsys.readouterr()
        assert rc in (EXIT_BAD_INPUT, EXIT_NOTHING_FOUND)
        assert cap.err.startswith(f"dmuon-trace {command}: error:") and "bad.json" in cap.err
        assert f"dmuon-trace {command}: error" not in cap.out


def test_gzipped_nsys_export_says_so(shared_fixtures, tmp_path, capsys):
    import gzip

    path = tmp_path / "report.sqlite.gz"
    path.write_bytes(gzip.compress((shared_fixtures / NSYS).read_bytes()[:65536]))
    assert main(["nsys", str(path), "--out", str(tmp_path / "e.parquet")]) == EXIT_BAD_INPUT
    assert "gzip-compressed" in capsys.readouterr().err


def test_profiler_without_events_is_nothing_found(tmp_path, capsys):
    import json

    (tmp_path / "rank0.json").write_text(json.dumps({"traceEvents": []}))
    out = tmp_path / "e.parquet"
    assert main(["profiler", str(tmp_path / "rank0.json"), "--out", str(out)]) == EXIT_NOTHING_FOUND
    assert "no collective events" in capsys.readouterr().err and not out.exists()
