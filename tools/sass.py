#!/usr/bin/env python3
"""Read the machine code of the CUDA kernels without a GPU: compile one source of the CUDA build to
a cubin (with ptxas's register / spill report), dump its SASS, count the opcodes of a kernel or of a
stretch of it, and compare the code of two builds kernel by kernel.

    tools/sass.py cubin SRC [-D NAME=VALUE ...] [-o OUT.cubin] [--build build-cuda]
        compile SRC (e.g. src/cuda/attention_prefill_mma.cu) with the exact flags of its object
        in the build, into a cubin; prints ptxas's per-kernel resource lines
    tools/sass.py dump CUBIN [--function SUBSTR]
        the SASS (cuobjdump -sass) of every kernel, or of those whose name contains SUBSTR
    tools/sass.py hist CUBIN --function SUBSTR [--between OPCODE N M]
        opcode counts of one kernel; --between VOTE 0 1: only the instructions between the 0th
        and the 1st VOTE (a loop body between two markers)
    tools/sass.py path CUBIN --function SUBSTR RANGE [RANGE ...]
        opcode counts of the instructions whose addresses fall in the RANGEs (0x1ee0-0x1f80 ...):
        one executed path through a loop body, the branches read off `dump`
    tools/sass.py textcmp A.cubin B.cubin [--map FROM=TO ...]
        for each kernel of A: SAME (byte-identical .text), DIFF or MISSING in B, then B's NEW
        ones; --map rewrites B's mangled names before matching (e.g. a new template argument:
        --map ELb0EEEv=EEEv); exit status 1 on any DIFF or MISSING

cuobjdump is not in every CUDA install (this machine's has none); when it is not on PATH or in
$CUDA_HOME/bin, the NVIDIA wheel `nvidia-cuda-cuobjdump` is fetched once with pip into
~/.cache/deltaserve/cuobjdump (a dev tool only: nothing in the engine or its tests needs it).
"""
import argparse
import os
import re
import shlex
import signal
import shutil
import struct
import subprocess
import sys
from collections import Counter

ANON = re.compile(r"(\d+)_GLOBAL__N__")
TOOLS = ("cuobjdump", "nvdisasm")


def normalize(name):
    """A kernel's mangled name with its anonymous namespace (a length-prefixed identifier holding
    per-build hashes, e.g. 57_GLOBAL__N__87a4de5a_24_attention_prefill_mma_cu_c1030769) as _ANON_."""
    out, pos = [], 0
    for m in ANON.finditer(name):
        if m.start() < pos:
            continue
        length = int(m.group(1))
        out.append(name[pos:m.start()] + "_ANON_")
        pos = m.start(1) + len(m.group(1)) + length
    return "".join(out) + name[pos:]


def text_sections(data):
    """{section name: bytes} of every .text.* section of an ELF64 little-endian image (a cubin)."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not an ELF64 little-endian file")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shoff == 0 or shnum == 0 or shoff + shnum * shentsize > len(data):
        raise ValueError("no section headers")
    hdrs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_off = hdrs[shstrndx][4]
    out = {}
    for h in hdrs:
        start = names_off + h[0]
        name = data[start:data.index(b"\0", start)].decode()
        if name.startswith(".text."):
            out[name[len(".text."):]] = data[h[4]:h[4] + h[5]]
    return out


def textcmp(a, b, maps=()):
    """[(status, name)] for every kernel of a: SAME, DIFF or MISSING in b."""
    def renamed(n):
        for frm, to in maps:
            n = n.replace(frm, to)
        return n
    bn = {renamed(normalize(k)): v for k, v in b.items()}
    rows = []
    for k in sorted(a):
        n = normalize(k)
        status = "MISSING" if n not in bn else ("SAME" if bn[n] == a[k] else "DIFF")
        rows.append((status, n))
    an = {normalize(k) for k in a}
    rows += [("NEW", n) for n in sorted(bn) if n not in an]
    return rows


SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def sass_instructions(text):
    """[(address, instruction)] of cuobjdump -sass text (encodings and blank lines dropped)."""
    out = []
    for line in text.splitlines():
        m = SASS_LINE.match(line)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def opcode(instr):
    """The opcode's base name: '@!P0 BRA 0x72c0' -> 'BRA', 'HGMMA.64x256x16.F32.BF16 R24' -> 'HGMMA'."""
    words = instr.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def split_functions(text):
    """{function name: its SASS text} of a cuobjdump -sass listing."""
    funcs, name, body = {}, None, []
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            if name:
                funcs[name] = "\n".join(body)
            name, body = m.group(1), []
        elif name:
            body.append(line)
    if name:
        funcs[name] = "\n".join(body)
    return funcs


def histogram(instrs, between=None):
    """Opcode counts of instrs, or of those strictly between the n-th and m-th marker opcode."""
    if between:
        marker, n, m = between
        idx = [i for i, (_, ins) in enumerate(instrs) if opcode(ins) == marker]
        if max(n, m) >= len(idx):
            raise ValueError(f"only {len(idx)} {marker} instructions")
        instrs = instrs[idx[n] + 1:idx[m]]
    return Counter(opcode(ins) for _, ins in instrs)


def parse_range(text):
    """'0x1ee0-0x1f80' -> (0x1ee0, 0x1f80), both ends included."""
    lo, sep, hi = text.partition("-")
    if not sep:
        raise ValueError(f"range '{text}' is not LO-HI")
    lo, hi = int(lo, 16), int(hi, 16)
    if hi < lo:
        raise ValueError(f"range '{text}' ends before it starts")
    return lo, hi


def path_histogram(instrs, ranges):
    """Opcode counts of the instructions whose address lies in any of the (lo, hi) ranges."""
    return Counter(opcode(ins) for addr, ins in instrs if any(lo <= addr <= hi for lo, hi in ranges))


def find_cuobjdump():
    """cuobjdump (with nvdisasm beside it, which it runs): the CUDA install's, else the NVIDIA
    wheels' (fetched once into ~/.cache/deltaserve/cuobjdump)."""
    for d in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if d and all(os.access(os.path.join(d, "bin", t), os.X_OK) for t in TOOLS):
            return os.path.join(d, "bin", "cuobjdump")
    if all(shutil.which(t) for t in TOOLS):
        return shutil.which("cuobjdump")
    cache = os.path.expanduser("~/.cache/deltaserve/cuobjdump")

    def cached():
        found = {}
        for root, _, files in os.walk(cache):
            for t in TOOLS:
                if t in files:
                    found[t] = os.path.join(root, t)
        return found
    found = cached()
    if len(found) < len(TOOLS):
        import zipfile
        os.makedirs(cache, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", cache]
                       + [f"nvidia-cuda-{t}" for t in TOOLS], check=True)
        for f in os.listdir(cache):
            if f.endswith(".whl"):
                with zipfile.ZipFile(os.path.join(cache, f)) as z:
                    z.extractall(os.path.join(cache, "x"))
        found = cached()
        if len(found) < len(TOOLS):
            raise SystemExit(f"sass.py: the NVIDIA wheels held only {sorted(found)} of {TOOLS}")
        for path in found.values():
            os.chmod(path, 0o755)
    if os.path.dirname(found["cuobjdump"]) != os.path.dirname(found["nvdisasm"]):
        os.environ["NVDISASM_PATH"] = os.path.dirname(found["nvdisasm"])
    return found["cuobjdump"]


def cubin_command(compile_cmd, out, defines):
    """The object's nvcc command turned into a cubin build with ptxas -v and extra -D flags."""
    args = shlex.split(compile_cmd)
    res, skip = [], 0
    for i, a in enumerate(args):
        if skip:
            skip -= 1
            continue
        if a in ("-MD", "-MMD"):
            continue
        if a in ("-MT", "-MF", "-o"):
            skip = 1
            continue
        if a == "-c":
            res += ["-cubin", "-Xptxas", "-v"] + [f"-D{d}" for d in defines]
            continue
        res.append(a)
    return res + ["-o", out]


def cmd_cubin(a):
    src = os.path.abspath(a.src)
    rel = os.path.relpath(src, os.path.abspath(os.path.join(a.build, "..")))
    targets = subprocess.run(["ninja", "-C", a.build, "-t", "targets", "all"], check=True,
                             capture_output=True, text=True).stdout
    obj = next((t.split(":")[0] for t in targets.splitlines()
                if t.split(":")[0].endswith(os.path.basename(rel) + ".o")), None)
    if not obj:
        raise SystemExit(f"sass.py: no object of {rel} in {a.build}")
    cmds = subprocess.run(["ninja", "-C", a.build, "-t", "commands", obj], check=True,
                          capture_output=True, text=True).stdout.strip().splitlines()
    out = os.path.abspath(a.o or "/tmp/" + os.path.basename(rel) + ".cubin")
    cmd = cubin_command(cmds[-1], out, a.D or [])
    r = subprocess.run(cmd, cwd=a.build, capture_output=True, text=True)
    for line in (r.stdout + r.stderr).splitlines():
        if re.search(r"Compiling entry|registers|spill|C75\d\d|error", line):
            print(line)
    if r.returncode:
        raise SystemExit(r.returncode)
    print(f"-> {out}")


def sass_of(cubin):
    return subprocess.run([find_cuobjdump(), "-sass", cubin], check=True, capture_output=True,
                          text=True).stdout


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cubin")
    c.add_argument("src")
    c.add_argument("-D", action="append")
    c.add_argument("-o")
    c.add_argument("--build", default="build-cuda")
    d = sub.add_parser("dump")
    d.add_argument("cubin")
    d.add_argument("--function", default="")
    h = sub.add_parser("hist")
    h.add_argument("cubin")
    h.add_argument("--function", required=True)
    h.add_argument("--between", nargs=3, metavar=("OPCODE", "N", "M"))
    pa = sub.add_parser("path")
    pa.add_argument("cubin")
    pa.add_argument("--function", required=True)
    pa.add_argument("ranges", nargs="+")
    t = sub.add_parser("textcmp")
    t.add_argument("a")
    t.add_argument("b")
    t.add_argument("--map", action="append", default=[])
    a = p.parse_args(argv)
    if a.cmd == "cubin":
        cmd_cubin(a)
    elif a.cmd == "dump":
        for name, body in split_functions(sass_of(a.cubin)).items():
            if a.function in name:
                print(f"Function : {name}\n{body}")
    elif a.cmd in ("hist", "path"):
        funcs = {n: b for n, b in split_functions(sass_of(a.cubin)).items() if a.function in n}
        if len(funcs) != 1:
            raise SystemExit(f"sass.py: {len(funcs)} kernels match '{a.function}': "
                             + ", ".join(sorted(funcs))[:2000])
        name, body = next(iter(funcs.items()))
        if a.cmd == "path":
            hist = path_histogram(sass_instructions(body), [parse_range(r) for r in a.ranges])
        else:
            between = (a.between[0], int(a.between[1]), int(a.between[2])) if a.between else None
            hist = histogram(sass_instructions(body), between)
        print(f"{name}: {sum(hist.values())} instructions")
        for op, n in hist.most_common():
            print(f"  {n:6d} {op}")
    else:
        maps = [tuple(m.split("=", 1)) for m in a.map]
        rows = textcmp(text_sections(open(a.a, "rb").read()),
                       text_sections(open(a.b, "rb").read()), maps)
        for status, name in rows:
            print(f"{status:8s}{name}")
        return 0 if all(s in ("SAME", "NEW") for s, _ in rows) else 1
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends quietly
    sys.exit(main())
