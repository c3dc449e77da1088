// linear_f16.wgsl — the linear layers' matrix product on tensor cores: f16 operands,
// f32 accumulation and output, through WGSL subgroup matrices
// (chromium_experimental_subgroup_matrix: Vulkan cooperative matrices, Metal simdgroup
// matrices). The f16 counterpart of linear.wgsl's product, for mixed precision; the
// host side is mamba_ext/gpu/linear_f16.py, which runs it only on a device that offers
// an f16 x f16 -> f32 subgroup-matrix configuration (Dawn) and falls back otherwise.
//
//   C[i, j] = C0[i, j] + sum_k A(i, k) * B(k, j),  C0 = C (ACCUMULATE), else
//             bias[j] (INIT_BIAS), else 0
//
// SCALED (the fp32 products of linear_split.wgsl: operands scaled by powers of two sA, sB
// and split into f16 planes hi and lo): the contraction is 3 KSEG long, its segments
// reading A's planes hi, hi, lo and B's hi, lo, hi (each plane a KSEG-long operand, lo
// PLANE_A / PLANE_B words after hi; A k-major, B not), and C[i, j] = (C0[i, j] sA sB +
// sum_k ...) / sA / sB, C0 the bias or 0 (not ACCUMULATE: a result matrix loaded from C
// and scaled ran the product 7x slower on an H100, docs/gpu_h200.txt session 35): the bias
// scaled where it is staged, the result unscaled in the result matrices, one factor at a
// time (exact, unless the bias is ~2^80 times the product's terms: then b sA sB may
// overflow). sA, 1/sA at sc[SA], sc[SA + 1]; sB, 1/sB at sc[SB], sc[SB + 1].
//
// The bias is linear.wgsl's epilogue moved before the products: subgroup matrices are
// opaque (no element of a result matrix is addressable), so the workgroup writes the
// bias of its BN columns into TM rows of workgroup memory (sbias) and every result
// matrix starts as a load from there.
//
// Split-K: workgroup z of a grid of depth S takes k = z*KLEN .. (z+1)*KLEN - 1 of a
// product of contraction S*KLEN and writes its C at c_off + z*CSLICE (the host sums the
// S partial products: a weight gradient's product has few tiles of C and a long K).
//
// Size letters: M rows, N columns, K contraction (of the product). Operand layouts,
// chosen by the host per product of a layer Y = X W^T (X (rows, I), W (O, I)):
//   A_KMAJOR: A(i, k) = a[a_off + i*lda + k] (X, dY, X^T), else a[a_off + k*lda + i]
//   B_KMAJOR: B(k, j) = b[b_off + j*ldb + k] (W), else b[b_off + k*ldb + j] (W^T, W, dY)
//   The host uses A k-major and B not (the fast pair, docs/gpu_h200.txt session 23):
//   forward Y = X (W^T) from W's transposed copy; dX = dY W; dW^T = (X^T) dY, stored
//   transposed (C_COLMAJOR). The other layouts stay for the narrow products and tests.
// C (M, N) f32 rows ldc apart from c_off (C_COLMAJOR: columns ldc apart, C[i, j] at
// c[c_off + j*ldc + i]: a weight gradient computed as its transpose); bias (N,) f32 from
// bias_off. Only the first NVALID columns of C are stored (and loaded, and started from
// the bias): a narrow product (x_proj's 80 outputs, dt_proj's 48) runs on operands padded
// to whole tiles with zeros, its last tile partly outside C. Requirements (checked on the
// host): M, N multiples of BM, BN, K of BK, NVALID <= N a multiple of TN; lda, ldb, a_off,
// b_off multiples of 8 (16-byte loads); ldc, c_off multiples of 4.
//
// Constants prepended by the host: the workgroup tile BM x BN, its contraction step BK
// and its invocations WGS (linear_f16.TILES), TM, TN, TK (the subgroup-matrix shape of the
// adapter's configuration), SG (the subgroup size), WM x WN = WGS / SG subgroups per
// workgroup (their grid over the tile), A_KMAJOR, B_KMAJOR, ACCUMULATE, INIT_BIAS,
// C_COLMAJOR, SCALED (with KSEG, PLANE_A, PLANE_B, SA, SB), NVALID, CSLICE, and the
// product's contraction length KLEN and strides LDA, LDB, LDC: with the contraction and
// the strides as uniforms instead, the same kernel ran 4x slower on an H200 (38 against
// 148 TFLOP/s, docs/gpu_h200.txt), so a pipeline is built per product shape. A dispatch
// whose subgroups are not SG wide writes NaN over its tile instead of a wrong product.
//
// Bindings:
// | binding | name | shape                                       | access     |
// |---------|------|---------------------------------------------|------------|
// | 0       | p    | Params: a_off, b_off, c_off, bias_off       | uniform    |
// | 1       | a    | A operand, f16 packed 8 per vec4<u32>       | read       |
// | 2       | b    | B operand, f16 packed 8 per vec4<u32>       | read       |
// | 3       | c    | C (M, N) f32                                | read_write |
// | 4       | bias | bias (N,) f32 (e.g. in the parameter arena) | read       |
// | 5       | sc   | f32 scales: sA, 1/sA at SA; sB, 1/sB at SB  | read       |
//
// Tile: BM x BN outputs per workgroup of WGS invocations (e.g. 128 x 128 of 256); subgroup
// s owns the (BM/WM) x (BN/WN) block at (s / WN, s % WN) as FM x FN result matrices. k
// advances in steps of BK through workgroup memory, double-buffered: the 16-byte
// global loads of the step after next are issued before this step's multiplies, and the
// next step's (loaded one step earlier) are stored into the other buffer after them, so
// one barrier per step separates the two. Each operand is staged in its global layout
// (rows of BK + 8 k-values, or rows of BM or BN + 8 m/n values; the 8 extra keep rows
// 16 bytes apart off one bank) and read back with the matching col_major flag, so no
// operand is transposed on the way.

struct Params {
    a_off : u32, b_off : u32, c_off : u32, bias_off : u32,
}

@group(0) @binding(0) var<uniform> p : Params;
@group(0) @binding(1) var<storage, read> a : array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> b : array<vec4<u32>>;
@group(0) @binding(3) var<storage, read_write> c : array<f32>;
@group(0) @binding(4) var<storage, read> bias : array<f32>;
@group(0) @binding(5) var<storage, read> sc : array<f32>;

const PA : u32 = select(BM, BK, A_KMAJOR) + 8u;   // row of A's staged tile (f16)
const PB : u32 = select(BN, BK, B_KMAJOR) + 8u;   // and of B's
const STAGE_A : u32 = select(BK, BM, A_KMAJOR) * PA;   // one buffer of A (f16)
const STAGE_B : u32 = select(BK, BN, B_KMAJOR) * PB;   // and of B
const WORDS_A : u32 = BM * BK / 8u;  // 16-byte words of A per step
const WORDS_B : u32 = BN * BK / 8u;
const NWA : u32 = (WORDS_A + WGS - 1u) / WGS;     // of them per invocation (at most)
const NWB : u32 = (WORDS_B + WGS - 1u) / WGS;
const FM : u32 = BM / WM / TM;       // result matrices per subgroup, along M
const FN : u32 = BN / WN / TN;       // and along N

var<workgroup> sa : array<f16, 2u * STAGE_A>;
var<workgroup> sb : array<f16, 2u * STAGE_B>;
// (TM, BN): the bias of the tile's columns, in each of TM rows (INIT_BIAS; declared whole
// without it too: Tint checks the size a subgroupMatrixLoad with its stride reads)
var<workgroup> sbias : array<f32, TM * BN>;

// the 16-byte word e (0 .. n * BK / 8 - 1) of an operand's first n x BK tile (rows r0 ..
// r0 + n - 1, k 0 .. BK - 1; n = BM or BN): its place in the staging buffer (x) and its
// global word index (y)
fn tile_word(kmajor : bool, n : u32, e : u32, r0 : u32, ld : u32, off : u32) -> vec2<u32> {
    if (kmajor) {                    // n rows (m or n) x BK / 8 words of 8 k
        let row = e / (BK / 8u);
        let col = (e % (BK / 8u)) * 8u;
        return vec2<u32>(row * (BK + 8u) + col, (off + (r0 + row) * ld + col) / 8u);
    }
    let row = e / (n / 8u);          // BK rows (k) x n / 8 words of 8 m or n
    let col = (e % (n / 8u)) * 8u;
    return vec2<u32>(row * (n + 8u) + col, (off + row * ld + r0 + col) / 8u);
}

// where element (i, j) of C is (C_COLMAJOR: j*LDC + i, else i*LDC + j, from c_off)
fn c_at(c_off : u32, i : u32, j : u32) -> u32 {
    return c_off + select(i * LDC + j, j * LDC + i, C_COLMAJOR);
}

// whether invocation t stages a word i of A (of B) per step (the condition is constant true
// where WGS divides the tile's words)
fn has_a(t : u32, i : u32) -> bool { return WORDS_A % WGS == 0u || t + i * WGS < WORDS_A; }
fn has_b(t : u32, i : u32) -> bool { return WORDS_B % WGS == 0u || t + i * WGS < WORDS_B; }

// global words advance by a fixed step per k step: BK columns, or BK rows
const DA : u32 = select(BK * LDA, BK, A_KMAJOR) / 8u;
const DB : u32 = select(BK * LDB, BK, B_KMAJOR) / 8u;
const NKQ : u32 = select(1u, KSEG / BK, SCALED);     // k steps per segment (SCALED)

// the words from an operand's tile word to those of k step s of slice z: s steps on, or
// (SCALED) the step's place in its segment, in the segment's plane (A: hi, hi, lo; B: hi,
// lo, hi)
fn a_step(z : u32, s : u32) -> u32 {
    if (!SCALED) { return s * DA; }
    let kg = z * (KLEN / BK) + s;
    return (kg % NKQ) * DA + select(0u, PLANE_A, kg / NKQ == 2u);
}

fn b_step(z : u32, s : u32) -> u32 {
    if (!SCALED) { return s * DB; }
    let kg = z * (KLEN / BK) + s;
    return (kg % NKQ) * DB + select(0u, PLANE_B, kg / NKQ == 1u);
}

fn put_a(at : u32, w : vec4<u32>) {
    for (var q = 0u; q < 4u; q++) {
        let h = bitcast<vec2<f16>>(w[q]);
        sa[at + 2u * q] = h.x;
        sa[at + 2u * q + 1u] = h.y;
    }
}

fn put_b(at : u32, w : vec4<u32>) {
    for (var q = 0u; q < 4u; q++) {
        let h = bitcast<vec2<f16>>(w[q]);
        sb[at + 2u * q] = h.x;
        sb[at + 2u * q + 1u] = h.y;
    }
}

@compute @workgroup_size(WGS)
fn linear_f16_product(@builtin(workgroup_id) wg : vec3<u32>,
                      @builtin(local_invocation_index) t : u32,
                      @builtin(subgroup_id) sid : u32,
                      @builtin(subgroup_size) sg_size : u32) {
    if (p.bias_off == 0xffffffffu) { c[0] = bias[0] + sc[SA]; }   // never: keeps bindings 4, 5
    let bm = wg.y * BM;
    let bn = wg.x * BN;
    // this workgroup's K slice (split-K; z = 0 otherwise)
    // (SCALED: the slice's segments are found per k step, a_step / b_step)
    let a_off = p.a_off + select(wg.z * select(KLEN * LDA, KLEN, A_KMAJOR), 0u, SCALED);
    let b_off = p.b_off + select(wg.z * select(KLEN * LDB, KLEN, B_KMAJOR), 0u, SCALED);
    let c_off = p.c_off + wg.z * CSLICE;
    if (sg_size != SG) {             // the host's subgroup layout does not hold: NaN, loudly
        let nan = bitcast<f32>(0x7fc00000u | (p.c_off & 0u));   // (a constant NaN is not WGSL)
        for (var e = t; e < BM * BN; e += WGS) {
            if (bn + e % BN < NVALID) { c[c_at(c_off, bm + e / BN, bn + e % BN)] = nan; }
        }
        return;
    }
    let sm = (sid / WN) * (BM / WM);
    let sn = (sid % WN) * (BN / WN);
    let nk = KLEN / BK;

    var acc : array<array<subgroup_matrix_result<f32, TN, TM>, FN>, FM>;
    if (ACCUMULATE) {
        for (var i = 0u; i < FM; i++) {
            for (var j = 0u; j < FN; j++) {
                if (bn + sn + j * TN < NVALID) {
                    acc[i][j] = subgroupMatrixLoad<subgroup_matrix_result<f32, TN, TM>>(
                        &c, c_at(c_off, bm + sm + i * TM, bn + sn + j * TN), C_COLMAJOR, LDC);
                }
            }
        }
    } else if (INIT_BIAS) {
        for (var e = t; e < TM * BN; e += WGS) {
            var v = 0.0;
            if (bn + e % BN < NVALID) { v = bias[p.bias_off + bn + e % BN]; }
            if (SCALED) { v = v * sc[SA] * sc[SB]; }
            sbias[e] = v;
        }
        workgroupBarrier();
        for (var i = 0u; i < FM; i++) {
            for (var j = 0u; j < FN; j++) {
                acc[i][j] = subgroupMatrixLoad<subgroup_matrix_result<f32, TN, TM>>(
                    &sbias, sn + j * TN, false, BN);
            }
        }
    }

    // this invocation's words of each operand per step (word t + i WGS; the last of them
    // past the tile's words where WGS does not divide them: has_a / has_b)
    var wa : array<vec2<u32>, NWA>;
    var wb : array<vec2<u32>, NWB>;
    for (var i = 0u; i < NWA; i++) { wa[i] = tile_word(A_KMAJOR, BM, t + i * WGS, bm, LDA, a_off); }
    for (var i = 0u; i < NWB; i++) { wb[i] = tile_word(B_KMAJOR, BN, t + i * WGS, bn, LDB, b_off); }
    let a0 = a_step(wg.z, 0u);
    let b0 = b_step(wg.z, 0u);
    for (var i = 0u; i < NWA; i++) { if (has_a(t, i)) { put_a(wa[i].x, a[wa[i].y + a0]); } }
    for (var i = 0u; i < NWB; i++) { if (has_b(t, i)) { put_b(wb[i].x, b[wb[i].y + b0]); } }
    // step 1's words in registers (step 0 is staged); each step then loads the words of
    // the step after next, so a load has two steps of multiplies to arrive in
    let s1 = min(1u, nk - 1u);
    var ra : array<vec4<u32>, NWA>;
    var rb : array<vec4<u32>, NWB>;
    var qa : array<vec4<u32>, NWA>;
    var qb : array<vec4<u32>, NWB>;
    for (var i = 0u; i < NWA; i++) { if (has_a(t, i)) { ra[i] = a[wa[i].y + a_step(wg.z, s1)]; } }
    for (var i = 0u; i < NWB; i++) { if (has_b(t, i)) { rb[i] = b[wb[i].y + b_step(wg.z, s1)]; } }
    workgroupBarrier();

    for (var kt = 0u; kt < nk; kt++) {
        let ca = (kt & 1u) * STAGE_A;
        let cb = (kt & 1u) * STAGE_B;
        let more = kt + 1u < nk;
        let s2 = min(kt + 2u, nk - 1u);      // (past the last step: its words again, unused)
        for (var i = 0u; i < NWA; i++) { if (has_a(t, i)) { qa[i] = a[wa[i].y + a_step(wg.z, s2)]; } }
        for (var i = 0u; i < NWB; i++) { if (has_b(t, i)) { qb[i] = b[wb[i].y + b_step(wg.z, s2)]; } }
        for (var kk = 0u; kk < BK; kk += TK) {
            var l : array<subgroup_matrix_left<f16, TK, TM>, FM>;
            var r : array<subgroup_matrix_right<f16, TN, TK>, FN>;
            for (var i = 0u; i < FM; i++) {
                let mi = sm + i * TM;
                let at = ca + select(kk * PA + mi, mi * PA + kk, A_KMAJOR);
                l[i] = subgroupMatrixLoad<subgroup_matrix_left<f16, TK, TM>>(&sa, at, !A_KMAJOR, PA);
            }
            for (var j = 0u; j < FN; j++) {
                let nj = sn + j * TN;
                let at = cb + select(kk * PB + nj, nj * PB + kk, B_KMAJOR);
                r[j] = subgroupMatrixLoad<subgroup_matrix_right<f16, TN, TK>>(&sb, at, B_KMAJOR, PB);
            }
            for (var i = 0u; i < FM; i++) {
                for (var j = 0u; j < FN; j++) {
                    acc[i][j] = subgroupMatrixMultiplyAccumulate(l[i], r[j], acc[i][j]);
                }
            }
        }
        if (more) {
            let na = ((kt + 1u) & 1u) * STAGE_A;
            let nb = ((kt + 1u) & 1u) * STAGE_B;
            for (var i = 0u; i < NWA; i++) { if (has_a(t, i)) { put_a(na + wa[i].x, ra[i]); } }
            for (var i = 0u; i < NWB; i++) { if (has_b(t, i)) { put_b(nb + wb[i].x, rb[i]); } }
        }
        ra = qa;
        rb = qb;
        workgroupBarrier();
    }

    if (SCALED) {                    // (two factors: their product may leave f32's range)
        for (var i = 0u; i < FM; i++) {
            for (var j = 0u; j < FN; j++) {
                acc[i][j] = subgroupMatrixScalarMultiply(
                    subgroupMatrixScalarMultiply(acc[i][j], sc[SA + 1u]), sc[SB + 1u]);
            }
        }
    }
    for (var i = 0u; i < FM; i++) {
        for (var j = 0u; j < FN; j++) {
            if (bn + sn + j * TN < NVALID) {
                subgroupMatrixStore(&c, c_at(c_off, bm + sm + i * TM, bn + sn + j * TN),
                                    acc[i][j], C_COLMAJOR, LDC);
            }
        }
    }
}
