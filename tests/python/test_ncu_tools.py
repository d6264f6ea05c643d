"""tools/ncu_sass_summary.py and scripts/gpu_ncu.sh without a GPU: the summary of Nsight Compute's
SASS source-counter CSV (instruction and never-executed counts, stalls by reason, hottest
instructions, one block per kernel name), its clear errors, and the wrapper's plumbing run against
a stand-in ncu that answers like the real one."""
import lzma
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "ncu_sass_summary.py"
SCRIPT = REPO / "scripts" / "gpu_ncu.sh"

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued '
          'Samples)","Instructions Executed","stall_barrier","stall_long_sb","stall_no_inst",'
          '"stall_barrier (Not-issued)"')


def block(name, rows):
    lines = [f'"Kernel Name","{name}",', HEADER]
    for addr, src, samples, executed, bar, lsb, noi in rows:
        lines.append(f'"{addr}","{src}","{samples}","0","{executed}","{bar}","{lsb}","{noi}","99"')
    return "\n".join(lines)


SASS = "\n".join([
    block("void k_fused<(bool)1>(int)", [
        ("0x10", "      LDC R1, c[0x0][0x28]", 10, 64, 0, 0, 10),
        ("0x20", "@P0   BRA 0x40", 60, 64, 50, 0, 10),
        ("0x30", "      MUFU.SIN R2, R3", 0, 0, 0, 0, 0),
        ("0x40", "      LDG.E R4, [R2]", 30, 64, 0, 30, 0),
    ]),
    block("void k_plain(int)", [
        ("0x10", "      EXIT", 5, 64, 0, 5, 0),
    ]),
    block("void k_fused<(bool)1>(int)", [  # a second launch of the first kernel
        ("0x10", "      LDC R1, c[0x0][0x28]", 1, 64, 0, 0, 1),
    ]),
]) + "\n"


def run_tool(path, *args):
    return subprocess.run([sys.executable, str(TOOL), str(path), *args], capture_output=True,
                          text=True, timeout=60)


def test_summary_counts_reasons_and_hot_instructions(tmp_path):
    f = tmp_path / "sass.csv"
    f.write_text(SASS)
    r = run_tool(f, "--top", "2")
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0] == "void k_fused<(bool)1>(int)"
    assert out[1] == "  SASS instructions 4, never executed 1, stall samples 100"
    # reasons as percent of the kernel's samples, largest first; the "(Not-issued)" twin ignored
    assert out[2] == "  by reason: barrier 50%, long_sb 30%, no_inst 20%"
    assert out[3].startswith("  #1") and "BRA 0x40" in out[3] and out[3].endswith("barrier 50, no_inst 10")
    assert out[4].startswith("  #3") and "LDG.E" in out[4] and out[4].endswith("long_sb 30")
    assert out[5] == "void k_plain(int)"
    assert out.count("void k_fused<(bool)1>(int)") == 1  # one block per kernel name by default
    r_all = run_tool(f, "--all")
    assert r_all.returncode == 0 and r_all.stdout.count("void k_fused<(bool)1>(int)") == 2
    # xz input, as gpu_ncu.sh stores it
    fx = tmp_path / "sass.csv.xz"
    fx.write_bytes(lzma.compress(SASS.encode()))
    assert run_tool(fx, "--top", "2").stdout == r.stdout


def test_summary_errors_are_clear(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("nothing here\n")
    r = run_tool(empty)
    assert r.returncode == 1 and "no kernel blocks" in r.stderr
    bad = tmp_path / "bad.csv"
    bad.write_text('"Kernel Name","k",\n"Address","Source"\n"0x10","NOP"\n')
    r = run_tool(bad)
    assert r.returncode == 1 and "has no column" in r.stderr


FAKE_NCU = r"""#!/usr/bin/env bash
# Stand-in for ncu: records its arguments; "-o REP" writes REP.ncu-rep and runs the command after
# the options; "-i REP --page details|source" prints a details page or the SASS CSV.
echo "$*" >> "$FAKE_LOG"
if [ "$1" = "-i" ]; then
  case "$*" in
    *"--page details"*) echo "details of k_fused" ;;
    *"--page source"*) cat "$FAKE_CSV" ;;
  esac
  exit 0
fi
while (($#)); do
  case "$1" in
    -o) touch "$2.ncu-rep"; shift 2 ;;
    --kernel-name|--launch-skip|--launch-count|--set|--import-source) shift 2 ;;
    -f) shift ;;
    *) break ;;
  esac
done
exec "$@"
"""


def test_gpu_ncu_script_plumbing(tmp_path):
    fake = tmp_path / "ncu"
    fake.write_text(FAKE_NCU)
    fake.chmod(0o755)
    csv = tmp_path / "in.csv"
    csv.write_text(SASS)
    log = tmp_path / "calls.log"
    out = tmp_path / "out"
    env = {"PATH": "/usr/bin:/bin", "NCU": str(fake), "FAKE_LOG": str(log), "FAKE_CSV": str(csv),
           "OUT": str(out)}
    r = subprocess.run(["bash", str(SCRIPT), "--kernels", "k_fused|k_plain", "--count", "3",
                        "--skip", "1", "--", "bash", "-c", "echo profiled-command-ran"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = log.read_text().splitlines()
    assert calls[0].startswith("--kernel-name regex:k_fused|k_plain --launch-skip 1 --launch-count 3 "
                               "--set full")
    assert "profiled-command-ran" in (out / "ncu_run.log").read_text()
    assert (out / "ncu_details.txt").read_text().strip() == "details of k_fused"
    assert lzma.decompress((out / "sass.csv.xz").read_bytes()).decode() == SASS
    summary = (out / "ncu_sass_summary.txt").read_text()
    assert "SASS instructions 4, never executed 1" in summary and summary in r.stdout
    # refusals: no command, a bad count, no ncu
    for args, env2, why in (([], env, "give the command"),
                            (["--count", "0", "--", "true"], env, "--count takes"),
                            (["--", "true"], {**env, "NCU": str(tmp_path / "none")}, "not found")):
        bad = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env2,
                             timeout=60)
        assert bad.returncode == 2 and why in bad.stderr, bad.stderr
