"""Variants of kernels/linear_f16.wgsl for dev/gpu/gemm_ab.py, each derived from the current
kernel text (so a variant is its difference, not a second copy): name -> function(src) ->
WGSL. gemm_ab.py writes kernels/<name>.wgsl from them on the device's copy of the tree.

linear_f16_direct (not yet run): the operands loaded straight from storage into subgroup
matrices, with no workgroup staging (whose f16 stores cost ~13% of the in_proj product in a
diagnostic, docs/gpu_h200.txt session 20) and no barriers in the k loop; the fragments of
the next k-step are loaded before the multiplies of this one; a and b bind as array<f16>.
linear_f16_rot: each staged word's 2-byte stores in a rotated order (no bank conflicts).
linear_f16_al8: each staged word's eight 2-byte stores from an index the compiler can see is a
multiple of 8 (16 bytes), so that it may merge them into one 16-byte store: the same time as
linear_f16 (in_proj 185 / 196 / 174 TFLOP/s, H100, session 30: the stores stay as they were).
linear_f16_pf1: the global words loaded one k-step ahead instead of two (half the registers
of the prefetch: room for subgroup blocks of 64 x 64): 107-125 TFLOP/s, and 29 with 64 x 64
blocks (session 30).
linear_f16_al8pf1: both (as pf1).
"""
from __future__ import annotations


def _cut(src: str, start: str, end: str) -> tuple[str, str]:
    """(src before `start`, src from `end` on); both must be there."""
    i, j = src.index(start), src.index(end)
    return src[:i], src[j:]


def _loads(l: str, r: str, k: str) -> str:
    """WGSL: left fragments `l` and right fragments `r` of k-step `k` from storage."""
    a_at = f"select(a_off + ({k}) * LDA + mi, a_off + mi * LDA + ({k}), A_KMAJOR)"
    b_at = f"select(b_off + ({k}) * LDB + nj, b_off + nj * LDB + ({k}), B_KMAJOR)"
    return (f"        for (var i = 0u; i < FM; i++) {{\n"
            f"            let mi = bm + sm + i * TM;\n"
            f"            {l}[i] = subgroupMatrixLoad<subgroup_matrix_left<f16, TK, TM>>(\n"
            f"                &a, {a_at}, !A_KMAJOR, LDA);\n"
            f"        }}\n"
            f"        for (var j = 0u; j < FN; j++) {{\n"
            f"            let nj = bn + sn + j * TN;\n"
            f"            {r}[j] = subgroupMatrixLoad<subgroup_matrix_right<f16, TN, TK>>(\n"
            f"                &b, {b_at}, B_KMAJOR, LDB);\n"
            f"        }}\n")


def _mma(l: str, r: str) -> str:
    return (f"        for (var i = 0u; i < FM; i++) {{\n"
            f"            for (var j = 0u; j < FN; j++) {{\n"
            f"                acc[i][j] = subgroupMatrixMultiplyAccumulate({l}[i], {r}[j], acc[i][j]);\n"
            f"            }}\n"
            f"        }}\n")


def direct(src: str) -> str:
    src = src.replace("var<storage, read> a : array<vec4<u32>>;", "var<storage, read> a : array<f16>;")
    src = src.replace("var<storage, read> b : array<vec4<u32>>;", "var<storage, read> b : array<f16>;")
    for buf, n in (("sa", "STAGE_A"), ("sb", "STAGE_B")):
        src = src.replace(f"var<workgroup> {buf} : array<f16, 2u * {n}>;\n", "")
    head, tail = _cut(src, "// the 16-byte word e", "// where element (i, j) of C is")
    src = head + tail
    head, tail = _cut(src, "// whether invocation t stages", "@compute @workgroup_size(WGS)")
    src = head + tail
    head, tail = _cut(src, "    // this invocation's words of each operand per step",
                      "    for (var i = 0u; i < FM; i++) {\n        for (var j = 0u; j < FN; j++) {\n"
                      "            if (bn + sn + j * TN < NVALID) {\n                subgroupMatrixStore")
    frag = ("    var l : array<subgroup_matrix_left<f16, TK, TM>, FM>;\n"
            "    var r : array<subgroup_matrix_right<f16, TN, TK>, FN>;\n"
            "    var l2 : array<subgroup_matrix_left<f16, TK, TM>, FM>;\n"
            "    var r2 : array<subgroup_matrix_right<f16, TN, TK>, FN>;\n")
    body = ("    // fragments straight from storage, the next k-step's loaded before this one's\n"
            "    // multiplies (KLEN is a multiple of 32 >= 2 TK; past the end: the last again)\n"
            + frag + "    {\n" + _loads("l", "r", "0u") + "    }\n"
            + "    for (var k = 0u; k < KLEN; k += 2u * TK) {\n"
            + _loads("l2", "r2", "k + TK") + _mma("l", "r")
            + _loads("l", "r", "min(k + 2u * TK, KLEN - 2u * TK)") + _mma("l2", "r2")
            + "    }\n\n")
    return (head + body + tail).replace("    let nk = KLEN / BK;\n", "")


def _put_head(src: str, head: str, loop: str) -> str:
    """put_a and put_b (the staging of one 16-byte word) with ``head`` as their first lines
    and ``loop`` as the first line of the loop over the word's four f16 pairs (both WGSL,
    for either operand), the rest of their text kept."""
    for op, buf in (("a", "sa"), ("b", "sb")):
        tail = (f"        let h = bitcast<vec2<f16>>(w[q]);\n"
                f"        {buf}[at + 2u * q] = h.x;\n"
                f"        {buf}[at + 2u * q + 1u] = h.y;\n")
        old = (f"fn put_{op}(at : u32, w : vec4<u32>) {{\n"
               f"    for (var q = 0u; q < 4u; q++) {{\n" + tail)
        assert src.count(old) == 1, old
        src = src.replace(old, head.format(op=op) + loop + tail)
    return src


def rotated(src: str) -> str:
    """The staging stores of each 16-byte word in a rotated order: invocation's word at
    staged half x writes its four f16 pairs starting from pair (x / 64) % 4. In one store
    instruction the 32 lanes' words (16-byte aligned: 8 banks of 4 bytes) put 4 lanes on
    each bank; lanes whose words sit 128 bytes apart (the same banks) get different pairs,
    so each store instruction meets no bank conflict instead of 4-way ones."""
    return _put_head(src, "fn put_{op}(at : u32, w : vec4<u32>) {{\n    let rot = (at / 64u) % 4u;\n",
                     "    for (var i = 0u; i < 4u; i++) {\n        let q = (i + rot) % 4u;\n")


def aligned(src: str) -> str:
    """The staging stores of each 16-byte word from ``(at >> 3) << 3``: the same index (every
    staged word starts at a multiple of 8 halves), written so that the compiler knows its
    alignment and may merge the eight 2-byte stores into one 16-byte store."""
    return _put_head(src, "fn put_{op}(at_ : u32, w : vec4<u32>) {{\n    let at = (at_ >> 3u) << 3u;\n",
                     "    for (var q = 0u; q < 4u; q++) {\n")


def prefetch1(src: str) -> str:
    """The words of step kt + 1 loaded at the top of step kt (into qa, qb) and staged after
    its multiplies; no words held from the step before (ra, rb unused)."""
    subs = [("        let s2 = min(kt + 2u, nk - 1u);      "
             "// (past the last step: its words again, unused)\n",
             "        let s2 = min(kt + 1u, nk - 1u);\n"),
            ("put_a(na + wa[i].x, ra[i]);", "put_a(na + wa[i].x, qa[i]);"),
            ("put_b(nb + wb[i].x, rb[i]);", "put_b(nb + wb[i].x, qb[i]);"),
            ("        ra = qa;\n        rb = qb;\n", ""),
            ("    for (var i = 0u; i < NWA; i++) { if (has_a(t, i)) { "
             "ra[i] = a[wa[i].y + s1 * da]; } }\n", ""),
            ("    for (var i = 0u; i < NWB; i++) { if (has_b(t, i)) { "
             "rb[i] = b[wb[i].y + s1 * db]; } }\n", "")]
    for old, new in subs:
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    return src


VARIANTS = {"linear_f16_direct": direct, "linear_f16_rot": rotated, "linear_f16_al8": aligned,
            "linear_f16_pf1": prefetch1, "linear_f16_al8pf1": lambda src: aligned(prefetch1(src))}
