"""Hostile NCCL log inputs: no input becomes a wrong event
silently. Op-name look-alikes are issues with file:line, bytes before a prefix are removed
and counted, time zones convert to UTC (or the line is an issue), oversized numbers name
their field in an excerpt, gzip is read whatever the name, and every file of a folder is
read or named with its reason (the CLI then exits 2).
"""

from __future__ import annotations

import gzip
import os

import pyarrow.parquet as pq
import pytest

from tracer.cli import EXIT_BAD_INPUT, EXIT_NOTHING_FOUND, EXIT_OK, main
from tracer.nccl import formats as fmt
from tracer.nccl.log import NcclLogError, nccl_logs_to_table, parse_nccl_logs
from tracer.nccl.records import MAX_LINE_ISSUES

P = "node-01:100:100 [0] NCCL INFO "
INIT = P + "comm 0xc0 rank 0 nranks 2 cudaDev 0 busId 1000 commId 0x55 - Init COMPLETE"
COLL = ("AllReduce: opCount 1a sendbuff 0x1 recvbuff 0x2 count 64 datatype 7 op 0 root 0 "
        "comm 0xc0 [nranks=2] stream 0x7f")
TT = "nccl_coll_tp_allgather_reducescatter__torchtitan_issue1369.log"


def _parse(*lines: str):
    return parse_nccl_logs([("mem", [ln + "\n" for ln in lines])])


# ------------------------------------------------------------------ op names

LOOKALIKES = ["All-Reduce", "All Reduce", "All\u200bReduce", "All\u00a0Reduce", "AllReduce ",
              " AllReduce", "\u200bAllReduce", "AllReduce\u200b", "All_Reduce", "All.Reduce",
              "AllRedu\u0441e", "\uff21llReduce", "Reduce\u200bScatter", "All\ufeffGather",
              "All\u2060Gather", "Send\u200b", "All\x00Reduce", "AllReduce\t", "All  Reduce",
              "All\\Reduce", "A\u0301llReduce"]


@pytest.mark.parametrize("name", LOOKALIKES)
def test_op_name_lookalikes_after_a_prefix_are_issues_not_events(name):
    res = _parse(INIT, P + COLL.replace("AllReduce", name), P + COLL)
    assert [(e.op, e.source_ref) for e in res.events] == [("all_reduce", "mem:3")]
    (issue,) = res.issues
    assert issue.line_no == 2 and "no event" in issue.reason
    assert len(issue.text) <= fmt.EXCERPT_CHARS + 40


@pytest.mark.parametrize("name", ["All-Reduce", "All Reduce", "All\u200bReduce",
                                  "Reduce Scatter", "All-Gather", "All5Reduce", "All - Gather"])
def test_split_op_names_without_a_prefix_are_issues(name):
    res = _parse(INIT, COLL.replace("AllReduce", name))
    assert res.events == []
    (issue,) = res.issues
    assert issue.line_no == 2
    assert "split by or after characters that are not ASCII letters" in issue.reason


@pytest.mark.parametrize("text", ["stepReduce", "AlReduce", "xGather", "eScatter", "Al-Reduce",
                                  "x\u200bGather", "n\u00e9Reduce"])
def test_glued_letters_before_a_name_that_ends_a_longer_one_are_issues(text):
    res = _parse(COLL.replace("AllReduce", text))
    assert res.events == [] and [i.line_no for i in res.issues] == [1]


def test_glued_text_with_one_reading_stays_an_unattributed_event():
    res = _parse("step 3 loss 2.5 " + COLL, "x" + COLL.replace("AllReduce", "Send"),
                 "0x7f00" + COLL, "loss 2.5 " + COLL.replace("AllReduce", "Reduce"),
                 "0x7f0c74002f00" + COLL.replace("AllReduce", "Reduce"),
                 "(x) " + COLL.replace("AllReduce", "Gather"))
    assert [e.op for e in res.events] == ["all_reduce", "send", "all_reduce", "reduce",
                                          "reduce", "gather"]
    assert res.issues == [] and res.stats.unattributed == 6


@pytest.mark.parametrize("text, reason", [
    (P + COLL.replace("count 64", "count 6x4"), "field 'count' is not followed by a decimal"),
    (P + COLL.replace(" recvbuff 0x2", ""), "field 'recvbuff' missing"),
    (P + COLL.replace("AllReduce: opCount", "AllReduce:opCount"), "its 'opCount' is not written"),
    (P + COLL.replace("AllReduce: opCount", "AllReduce: opcount"), "its 'opCount' is not written"),
    (P + COLL.replace("comm 0xc0", "comm 0xc\x000"), "malformed COLL line"),
    (P + COLL.replace("comm 0xc0", "comm 0x" + "c" * 100), "comm field of 102 characters"),
])
def test_malformed_fields_are_issues_at_their_line_and_do_not_swallow_the_next(text, reason):
    res = _parse(INIT, text, "plain program output")
    assert res.events == [] and res.stats.plain_lines == 1
    (issue,) = res.issues
    assert issue.line_no == 2 and reason in issue.reason


# ------------------------------------------------------------------ bytes before the prefix

@pytest.mark.parametrize("junk, kind, n", [
    ("\ufeff", "BOM", 1), ("\x1b[32m", "ANSI escape", 1), ("\x1b[1;36m\x1b[0m", "ANSI escape", 2),
    ("\r", "CR", 1), ("\x00" * 5, "NUL", 5), ("\ufeff\x1b[0m\r", None, 3),
    ("\x1b]0;title\x07", "ANSI escape", 1),
])
def test_bytes_before_the_prefix_are_removed_and_counted(junk, kind, n):
    res = _parse(junk + INIT, junk + P + COLL + "\x1b[0m")
    ((ev,),) = [res.events]
    assert (ev.host, ev.pid, ev.rank, ev.group_id) == ("node-01", 100, 0, "0x55")
    assert res.issues == []
    total = sum(res.stats.stripped.values())
    assert total == 2 * n + 1 if "\x1b" not in junk or kind != "ANSI escape" else total >= 2 * n
    if kind:
        assert res.stats.stripped[kind] >= n
    assert "removed before parsing" in res.summary()


def test_a_bom_file_is_one_process_not_two(tmp_path):
    path = tmp_path / "rank0.log"
    path.write_bytes(b"\xef\xbb\xbf" + (INIT + "\n" + P + COLL + "\n").encode())
    res = parse_nccl_logs(path)
    assert {(c.host, c.pid) for c in res.comms} == {("node-01", 100)}
    assert res.stats.stripped == {"BOM": 1} and res.events[0].rank == 0


def test_colours_inside_a_message_are_presentation_and_zero_width_is_not():
    res = _parse(P + "\x1b[1mAllReduce\x1b[0m" + COLL[len("AllReduce"):],
                 P + COLL.replace("AllReduce", "All\u200bReduce"))
    assert [e.op for e in res.events] == ["all_reduce"]
    assert [i.line_no for i in res.issues] == [2]


# ------------------------------------------------------------------ timestamps

@pytest.mark.parametrize("stamp, utc", [
    ("2026-05-05 06:16:47", "2026-05-05 06:16:47"),
    ("2026-05-05T06:16:47Z", "2026-05-05 06:16:47"),
    ("2026-05-05 08:16:47+0200", "2026-05-05 06:16:47"),
    ("2026-05-05 08:16:47+02:00", "2026-05-05 06:16:47"),
    ("2026-05-05 08:16:47 +02", "2026-05-05 06:16:47"),
    ("2026-05-05T01:16:47.250-05:00", "2026-05-05 06:16:47.25"),
    ("2026-05-05 06:16:47 UTC", "2026-05-05 06:16:47"),
    ("2026-05-06 00:16:47+18:00", "2026-05-05 06:16:47"),
])
def test_time_zones_are_converted_to_utc(stamp, utc):
    res = _parse(f"[{stamp}] " + P + COLL)
    assert res.issues == []
    assert res.events[0].t_start_ns == fmt.timestamp_ns(utc)


@pytest.mark.parametrize("stamp, why", [
    ("[2026-02-30 06:16:47] ", "no day 30"), ("[2026-05-05 24:00:00] ", "no clock 24:00:00"),
    ("[2026-05-05 06:16:47+2400] ", "no offset +24:00"), ("[9999-01-01 00:00:00] ", "outside"),
    ("[05/05/2026 06:16:47] ", "not a timestamp format read here"),
    ("[06:16:47.123] ", "not a timestamp format read here"),
    ("[2026-05-05 06:16:47 CEST] ", "not a timestamp format read here"),
])
def test_unreadable_timestamps_are_issues_naming_the_line(stamp, why):
    res = _parse(INIT, stamp + P + COLL)
    assert [(e.t_start_ns, e.op) for e in res.events] == [(None, "all_reduce")]
    (issue,) = res.issues
    assert issue.line_no == 2 and why in issue.reason and "t_start_ns empty" in issue.reason


def test_unreadable_timestamps_on_the_fast_path_are_issues(tmp_path):
    path = tmp_path / "ts.log"
    path.write_text("".join(f"[2026-02-{d:02d} 06:16:47.5] " + P + COLL + "\n"
                            for d in (27, 28, 29, 30)))
    res = nccl_logs_to_table(path)
    assert res.table.column("t_start_ns").null_count == 2
    assert [i.line_no for i in res.issues] == [3, 4]


# ------------------------------------------------------------------ oversized numbers

@pytest.mark.parametrize("old, new, field", [
    ("count 64", "count 99999999999999999999999", "count 99999999999999999999999 out of range"),
    ("count 64", "count " + "9" * 5000, "count <more than 40 digits>"),
    ("count 64", "count 4611686018427387904", "count * dtype bytes"),
    ("[nranks=2]", "[nranks=4294967296]", "nranks 4294967296"),
    ("AllReduce", "Broadcast", None),
])
def test_oversized_numbers_name_the_field_in_an_excerpt(old, new, field):
    line = P + COLL.replace(old, new)
    if field is None:  # root of a rooted op
        line = line.replace("root 0", "root -99999999999")
        field = "root -99999999999"
    res = _parse(line)
    (issue,) = res.issues
    assert issue.reason.startswith(field.split(" out")[0]) and "record skipped" in issue.reason
    assert "CollRecord" not in issue.text and len(issue.text) <= fmt.EXCERPT_CHARS + 40
    word = field.split()[0] if field != "count * dtype bytes" else "count"
    assert word in issue.text


# ------------------------------------------------------------------ gzip and folders

def test_gzip_is_read_whatever_its_name(shared_fixtures, tmp_path):
    text = (shared_fixtures / "nccl" / TT).read_bytes()
    (tmp_path / "a.log.gz").write_bytes(gzip.compress(text))
    (tmp_path / "nccl.node01.123").write_bytes(gzip.compress(text))  # no extension
    (tmp_path / "plain.log").write_bytes(text)
    res = nccl_logs_to_table(tmp_path)
    assert res.table.num_rows == 3 * 7 and res.issues == [] and res.unread == []


def test_truncated_gzip_is_read_up_to_the_damage_and_named(shared_fixtures, tmp_path):
    text = (shared_fixtures / "nccl" / TT).read_bytes() * 400
    blob = gzip.compress(text)
    path = tmp_path / "cut.gz"
    path.write_bytes(blob[:len(blob) // 2])
    res = nccl_logs_to_table(path)
    assert 0 < res.table.num_rows < 2800
    ((name, reason),) = res.unread
    assert name == str(path) and "gzip stream ends early" in reason
    assert any(i.file == str(path) and "not read to its end" in i.reason for i in res.issues)
    with pytest.raises(NcclLogError):
        nccl_logs_to_table(path, strict=True)


@pytest.fixture()
def mixed_folder(shared_fixtures, tmp_path):
    text = (shared_fixtures / "nccl" / TT).read_bytes()
    folder = tmp_path / "logs"
    folder.mkdir()
    (folder / "good.log").write_bytes(text)
    (folder / "crashed.log").write_bytes(b"\0" * 100 + text)  # zero-filled, then the log
    (folder / "events.parquet").write_bytes(b"PAR1\0\0\x15\x04" * 50)
    (folder / "garbage.gz").write_bytes(gzip.compress(os.urandom(4000)))
    (folder / "broken").symlink_to(tmp_path / "absent")
    os.mkfifo(folder / "fifo")
    return folder


def test_every_file_of_a_folder_is_read_or_named(mixed_folder):
    res = nccl_logs_to_table(mixed_folder)
    assert sorted(os.path.basename(f) for f in res.files) == ["crashed.log", "good.log"]
    assert res.table.num_rows == 14 and res.stats.stripped == {"NUL": 100}
    reasons = {os.path.basename(f): r for f, r in res.unread}
    assert sorted(reasons) == ["broken", "events.parquet", "fifo", "garbage.gz"]
    assert reasons["broken"] == "broken symlink" and "FIFO" in reasons["fifo"]
    assert reasons["events.parquet"].startswith("binary (a NUL byte at offset 4")
    assert "decompressed" in reasons["garbage.gz"]
    assert {os.path.basename(i.file) for i in res.issues if i.line_no == 0} == set(reasons)


def test_cli_exits_2_naming_skipped_files_and_writes_the_rest(mixed_folder, tmp_path, capsys):
    out = mixed_folder / "out.parquet"  # inside the input folder: never read back
    assert main(["nccl", str(mixed_folder), "--out", str(out)]) == EXIT_BAD_INPUT
    cap = capsys.readouterr()
    assert pq.read_table(out).num_rows == 14
    assert "files not read (or not to their end): 4" in cap.out and "events.parquet" in cap.out
    assert cap.err.startswith("dmuon-trace nccl: error: 4 file(s) not read")
    assert main(["nccl", str(mixed_folder), "--out", str(out), "--glob", "*.log"]) == EXIT_OK
    assert main(["nccl", str(mixed_folder), "--out", str(tmp_path / "s.parquet"),
                 "--strict"]) == EXIT_BAD_INPUT
    assert "--strict" in capsys.readouterr().err and not (tmp_path / "s.parquet").exists()


def test_cli_binary_only_is_nothing_found_with_the_reason(mixed_folder, tmp_path, capsys):
    rc = main(["nccl", str(mixed_folder / "events.parquet"), "--out", str(tmp_path / "e.parquet")])
    cap = capsys.readouterr()
    assert rc == EXIT_NOTHING_FOUND and "binary" in cap.err and "no file could be read" in cap.err


def test_cli_gzip_log_gives_events_not_invalid_utf8(shared_fixtures, tmp_path, capsys):
    path = tmp_path / "rank0.log.gz"
    path.write_bytes(gzip.compress((shared_fixtures / "nccl" / TT).read_bytes()))
    assert main(["nccl", str(path), "--out", str(tmp_path / "e.parquet")]) == EXIT_OK
    assert "invalid UTF-8" not in capsys.readouterr().out


# ------------------------------------------------------------------ bounded issue lists

def test_issues_per_line_are_bounded_and_counted():
    res = _parse(P + "AllReduce: opCount 1 " * 1000)  # 999 incomplete, the last one pending
    assert len(res.issues) == MAX_LINE_ISSUES + 2
    assert res.issues[-2].reason.startswith(f"{999 - MAX_LINE_ISSUES:,d} more issue(s)")
    assert "at end of input" in res.issues[-1].reason


def test_long_non_ascii_lines_give_the_same_records_and_readable_issues(tmp_path):
    """A line over LONG_LINE bytes with non-ASCII text is read one byte a character; its
    hosts and excerpts are decoded back (an excerpt's own '…' kept), and a record after an
    incomplete one keeps its prefix (host 'nöde', not None)."""
    unit = "n\u00f6de:1:1 [0] NCCL INFO " + COLL + " \u00b2 All\u200bReduce: opCount 1 "
    line = unit * (2 * fmt.LONG_LINE // len(unit.encode()) + 1)
    path = tmp_path / "long.log"
    path.write_text(line + "\n" + P + COLL + "\n", encoding="utf-8")
    res = nccl_logs_to_table(path)
    hosts = set(res.table.column("host").to_pylist())
    assert hosts == {"n\u00f6de", "node-01"}
    assert all("\u00c3" not in i.reason + i.text for i in res.issues)  # no mojibake
    assert any("n\u00f6de" in i.text for i in res.issues)
    mem = nccl_logs_to_table([("m", [line + "\n", P + COLL + "\n"])])
    assert mem.table.num_rows == res.table.num_rows
    assert [i.reason for i in mem.issues] == [i.reason for i in res.issues]


def test_an_excerpt_of_a_long_non_ascii_line_keeps_its_marks():
    text = fmt.from_byte_text(fmt.excerpt(("\u00e9" * 300).encode().decode("latin-1"), 10))
    assert text.endswith("more chars)") and "\u00e9" in text and "\u00c3" not in text


def test_a_record_after_an_incomplete_one_keeps_its_prefix():
    res = _parse(P + "AllReduce: opCount 1 sendbuff 0x1 " + P.replace("node-01", "node-02") + COLL,
                 P + "All-Reduce: opCount 1 " + P.replace("node-01", "node-03") + COLL)
    assert [e.host for e in res.events] == ["node-02", "node-03"]
    assert [i.line_no for i in res.issues] == [1, 2]
