"""tools/sass.py without CUDA: the ELF section reader and the kernel-by-kernel .text compare on
hand-built ELF64 images, the anonymous-namespace normalisation of mangled names, the SASS listing
parser and the opcode histogram between markers, and the nvcc command rewrite that must never
write over the build's object file."""
import struct
import sys

import pytest

from server_util import REPO

sys.path.insert(0, str(REPO / "tools"))
import sass  # noqa: E402


def elf(sections):
    """A minimal ELF64 little-endian image with the given {name: bytes} sections."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n in sections) + b".shstrtab\0"
    body, offsets, off = b"", [], 64
    for data in sections.values():
        offsets.append(off + len(body))
        body += data
    strtab_off = off + len(body)
    body += names
    shoff = off + len(body)
    hdr = bytearray(64)
    hdr[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", hdr, 0x28, shoff)
    shnum = len(sections) + 2
    struct.pack_into("<HHH", hdr, 0x3A, 64, shnum, shnum - 1)
    shdrs = [struct.pack("<IIQQQQIIQQ", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)]
    name_off = 1
    for (n, data), o in zip(sections.items(), offsets):
        shdrs.append(struct.pack("<IIQQQQIIQQ", name_off, 1, 0, 0, o, len(data), 0, 0, 16, 0))
        name_off += len(n) + 1
    shdrs.append(struct.pack("<IIQQQQIIQQ", name_off, 3, 0, 0, strtab_off, len(names), 0, 0, 1, 0))
    return bytes(hdr) + body + b"".join(shdrs)


K1 = "_ZN2ds4cuda57_GLOBAL__N__87a4de5a_24_attention_prefill_mma_cu_c103076927attention_kernelILi3EEEv"
K1_OTHER_BUILD = K1.replace("87a4de5a", "0badf00d").replace("c1030769", "deadbeef")


def test_normalize_drops_the_per_build_namespace_hashes():
    assert sass.normalize(K1) == "_ZN2ds4cuda_ANON_27attention_kernelILi3EEEv"
    assert sass.normalize(K1_OTHER_BUILD) == sass.normalize(K1)
    assert sass.normalize("_Z6plain_kernelPf") == "_Z6plain_kernelPf"


def test_text_sections_reads_only_text():
    img = elf({".text." + K1: b"\x01\x02\x03", ".nv.info": b"xx", ".text._Z1fv": b"\x09"})
    got = sass.text_sections(img)
    assert got == {K1: b"\x01\x02\x03", "_Z1fv": b"\x09"}
    with pytest.raises(ValueError):
        sass.text_sections(b"not an elf at all, just bytes" * 4)


def test_textcmp_same_diff_missing_new_and_name_maps():
    a = sass.text_sections(elf({".text." + K1: b"AAAA", ".text._Z1gv": b"BB", ".text._Z1hv": b"C"}))
    renamed = K1_OTHER_BUILD.replace("ILi3EEEv", "ILi3ELb0EEEv")
    b = sass.text_sections(elf({".text." + renamed: b"AAAA", ".text._Z1gv": b"XX",
                                ".text._Z1kv": b"D"}))
    rows = dict((n, s) for s, n in sass.textcmp(a, b, [("ELb0EEEv", "EEEv")]))
    assert rows[sass.normalize(K1)] == "SAME"  # other build hashes + a new template argument
    assert rows["_Z1gv"] == "DIFF"
    assert rows["_Z1hv"] == "MISSING"
    assert rows["_Z1kv"] == "NEW"
    # without the map the renamed kernel does not match
    rows = dict((n, s) for s, n in sass.textcmp(a, b))
    assert rows[sass.normalize(K1)] == "MISSING"


LISTING = """
\tcode for sm_90a
\t\tFunction : _Z1fv
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
                                                                          /* 0x000fe40000000f00 */
        /*0010*/                   VOTE.ANY P0, P0 ;                      /* 0x0000000000ff7806 */
        /*0020*/              @!P0 BRA 0x60 ;                             /* 0x0000000000008947 */
        /*0030*/                   FMUL R24, R24, R13.reuse ;             /* 0x0000000d18187220 */
        /*0040*/                   FMUL R25, R25, R13 ;                   /* 0x0000000d19197220 */
        /*0050*/                   HGMMA.64x256x16.F32.BF16 R24, R184, gdesc[UR20].tnspB, R24 ;
        /*0060*/                   VOTE.ANY P0, P0 ;                      /* 0x0000000000ff7806 */
        /*0070*/                   EXIT ;                                 /* 0x000000000000794d */
\t\tFunction : _Z1gv
        /*0000*/                   EXIT ;                                 /* 0x000000000000794d */
"""


def test_listing_parse_and_histogram_between_markers():
    funcs = sass.split_functions(LISTING)
    assert sorted(funcs) == ["_Z1fv", "_Z1gv"]
    ins = sass.sass_instructions(funcs["_Z1fv"])
    assert [a for a, _ in ins] == [0x0, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70]
    assert sass.opcode("@!P0 BRA 0x60") == "BRA"
    assert sass.opcode("HGMMA.64x256x16.F32.BF16 R24, R184") == "HGMMA"
    assert sass.histogram(ins) == {"MOV": 1, "VOTE": 2, "BRA": 1, "FMUL": 2, "HGMMA": 1,
                                   "EXIT": 1}
    assert sass.histogram(ins, ("VOTE", 0, 1)) == {"BRA": 1, "FMUL": 2, "HGMMA": 1}
    with pytest.raises(ValueError):
        sass.histogram(ins, ("VOTE", 0, 2))


def test_cubin_command_never_writes_the_object():
    cmd = ("/usr/local/cuda/bin/nvcc -forward-unknown-to-host-compiler -DDS_HAVE_CUDA=1 "
           "-I/work/main/src -O3 -MD -MT src/cuda/CMakeFiles/x.dir/a.cu.o "
           "-MF src/cuda/CMakeFiles/x.dir/a.cu.o.d -x cu -c /work/main/src/cuda/a.cu "
           "-o src/cuda/CMakeFiles/x.dir/a.cu.o")
    got = sass.cubin_command(cmd, "/tmp/a.cubin", ["DS_X=0"])
    assert got[-2:] == ["-o", "/tmp/a.cubin"]
    assert "src/cuda/CMakeFiles/x.dir/a.cu.o" not in got
    assert not {"-MD", "-MT", "-MF", "-c"} & set(got)
    i = got.index("-cubin")
    assert got[i:i + 4] == ["-cubin", "-Xptxas", "-v", "-DDS_X=0"]
    assert "/work/main/src/cuda/a.cu" in got and "-O3" in got


def test_path_counts_only_the_given_address_ranges():
    ins = sass.sass_instructions(sass.split_functions(LISTING)["_Z1fv"])
    # the fall-through path: MOV, VOTE, BRA, then the second VOTE and EXIT (skipping 0x30-0x50)
    ranges = [sass.parse_range("0x0-0x20"), sass.parse_range("0x60-0x70")]
    assert sass.path_histogram(ins, ranges) == {"MOV": 1, "VOTE": 2, "BRA": 1, "EXIT": 1}
    assert sass.parse_range("0x1ee0-0x1f80") == (0x1EE0, 0x1F80)
    for bad in ("0x10", "0x20-0x10", "zz-0x10"):
        with pytest.raises(ValueError):
            sass.parse_range(bad)
