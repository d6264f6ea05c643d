"""tools/bench_variants.py: every variant's timings per case over several bench kernels logs."""
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import bench_variants  # noqa: E402

# Two processes of `bench kernels --only attn_prefill` in the format it prints: the first with the
# default pick (a), the second with a switched off (b picked, a absent from its note). Row 2 of
# the first log has a note for another pick: it must not be credited to the row's variant.
LOG1 = """\
ceilings: D2D copy of 1 GiB: cudaMemcpyAsync 4.19 TB/s
    a: 455 TFLOP/s, generic 27 TFLOP/s; b 470.00 us (438 TFLOP/s; vs generic max abs err 9.77e-04 (of max 3.5)); c 500.50 us (411 TFLOP/s; vs generic max abs err 9.77e-04 (of max 3.5))
  attn_prefill.a           q 4096 after 0 cached, 24q/4kv hd 256     450.00 us  ( 57% of SOL)  fallback 7669.22 us  max abs err 9.77e-04 (of max 3.5)
    zz: 1 TFLOP/s, generic 1 TFLOP/s; b 1.00 us (1 TFLOP/s)
  attn_prefill.a           q 16 after 8192 cached, 24q/4kv hd 256     190.00 us  ( 3% of SOL)  fallback 350.00 us  max abs err 6.10e-05 (of max 0.14)
  gemm.cublaslt            m 16 n 5120 k 6144     19.80 us  (70% of SOL)
"""
LOG2 = """\
    b: 470 TFLOP/s, generic 27 TFLOP/s; c 480.00 us (420 TFLOP/s; vs generic max abs err 9.77e-04 (of max 3.5))
  attn_prefill.b           q 4096 after 0 cached, 24q/4kv hd 256     460.00 us  ( 55% of SOL)  fallback 7669.22 us  max abs err 9.77e-04 (of max 3.5)
"""


def test_parse_credits_the_pick_and_the_note():
    p = bench_variants.parse(LOG1, "attn_prefill")
    assert list(p) == ["q 4096 after 0 cached, 24q/4kv hd 256",
                       "q 16 after 8192 cached, 24q/4kv hd 256"]
    assert p["q 4096 after 0 cached, 24q/4kv hd 256"] == {"a": [450.0], "b": [470.0],
                                                          "c": [500.5]}
    # the second note names another pick (zz): only the row's own timing counts
    assert p["q 16 after 8192 cached, 24q/4kv hd 256"] == {"a": [190.0]}
    assert bench_variants.parse(LOG1, "gemm") == {"m 16 n 5120 k 6144": {"cublaslt": [19.8]}}


def test_merge_and_table_against_a_reference():
    cases = bench_variants.merge([bench_variants.parse(t, "attn_prefill") for t in (LOG1, LOG2)])
    c = cases["q 4096 after 0 cached, 24q/4kv hd 256"]
    assert c == {"a": [450.0], "b": [470.0, 460.0], "c": [500.5, 480.0]}
    t = bench_variants.table(cases, ref="a", variants=["a", "b", "c"]).splitlines()
    assert t[0] == ("| case | a (us) | b (us) | c (us) | b vs a | c vs a |")
    row = t[2].split(" | ")
    assert row[1] == "450.0 (450)"
    assert row[2] == "465.0 (470 / 460)"
    assert row[4] == "+3.3%"  # 465 / 450 - 1
    assert row[5].startswith("+8.9%")  # 490.25 / 450 - 1
    # a case without b or c timings: "-"
    assert t[3].split(" | ")[2] == "-"


def test_concatenated_logs_do_not_carry_a_note_over():
    # a process that printed a note and died before its row, then the next process's log
    text = ("=== attn_k_1.txt\n"
            "    a: 1 TFLOP/s, generic 1 TFLOP/s; b 999.00 us (1 TFLOP/s)\n"
            "=== attn_k_2.txt\n" + LOG1)
    p = bench_variants.parse(text, "attn_prefill")
    assert p["q 4096 after 0 cached, 24q/4kv hd 256"]["b"] == [470.0]


def test_cli(tmp_path):
    f1, f2 = tmp_path / "1.txt", tmp_path / "2.txt"
    f1.write_text(LOG1)
    f2.write_text(LOG2)
    tool = str(REPO / "tools" / "bench_variants.py")
    r = subprocess.run([sys.executable, tool, str(f1), str(f2), "--ref", "a"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "| q 4096 after 0 cached, 24q/4kv hd 256 |" in r.stdout
    assert "b vs a" in r.stdout and "c vs a" in r.stdout
    r = subprocess.run([sys.executable, tool, str(f1), "--family", "gdn_prefill"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "no gdn_prefill case" in r.stderr
