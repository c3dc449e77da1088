// linear_f16_direct.wgsl (dev/, an experiment; not yet run) — kernels/linear_f16.wgsl with
// its operands loaded straight from storage into subgroup matrices: no workgroup staging
// (whose f16 stores cost ~13% of the product in a diagnostic, docs/gpu_h200.txt session 20)
// and no barriers in the k loop; the fragments of the next k-step are loaded before the
// multiplies of this one. a and b bind as array<f16>; everything else as the original,
// whose header holds the layouts and constants.

struct Params {
    a_off : u32, b_off : u32, c_off : u32, bias_off : u32,
}

@group(0) @binding(0) var<uniform> p : Params;
@group(0) @binding(1) var<storage, read> a : array<f16>;
@group(0) @binding(2) var<storage, read> b : array<f16>;
@group(0) @binding(3) var<storage, read_write> c : array<f32>;
@group(0) @binding(4) var<storage, read> bias : array<f32>;

const BM : u32 = 128u;
const BN : u32 = 128u;
const BK : u32 = 32u;
const PK : u32 = BK + 8u;            // row of a k-major tile (f16)
const PMN : u32 = BM + 8u;           // row of an m/n-major tile (f16)
const STAGE : u32 = BM * PK;         // one buffer of one operand (>= BK * PMN)
const FM : u32 = BM / WM / TM;       // result matrices per subgroup, along M
const FN : u32 = BN / WN / TN;       // and along N

// (TM, BN): the bias of the tile's columns, in each of TM rows (INIT_BIAS; declared whole
// without it too: Tint checks the size a subgroupMatrixLoad with its stride reads)
var<workgroup> sbias : array<f32, TM * BN>;

// where element (i, j) of C is (C_COLMAJOR: j*LDC + i, else i*LDC + j, from c_off)
fn c_at(c_off : u32, i : u32, j : u32) -> u32 {
    return c_off + select(i * LDC + j, j * LDC + i, C_COLMAJOR);
}

@compute @workgroup_size(256)
fn linear_f16_product(@builtin(workgroup_id) wg : vec3<u32>,
                      @builtin(local_invocation_index) t : u32,
                      @builtin(subgroup_id) sid : u32,
                      @builtin(subgroup_size) sg_size : u32) {
    if (p.bias_off == 0xffffffffu) { c[0] = bias[0]; }   // never: keeps binding 4 in the layout
    let bm = wg.y * BM;
    let bn = wg.x * BN;
    // this workgroup's K slice (split-K; z = 0 otherwise)
    let a_off = p.a_off + wg.z * select(KLEN * LDA, KLEN, A_KMAJOR);
    let b_off = p.b_off + wg.z * select(KLEN * LDB, KLEN, B_KMAJOR);
    let c_off = p.c_off + wg.z * CSLICE;
    if (sg_size != SG) {             // the host's subgroup layout does not hold: NaN, loudly
        let nan = bitcast<f32>(0x7fc00000u | (p.c_off & 0u));   // (a constant NaN is not WGSL)
        for (var e = t; e < BM * BN; e += 256u) {
            if (bn + e % BN < NVALID) { c[c_at(c_off, bm + e / BN, bn + e % BN)] = nan; }
        }
        return;
    }
    let sm = (sid / WN) * (BM / WM);
    let sn = (sid % WN) * (BN / WN);

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
        for (var e = t; e < TM * BN; e += 256u) {
            var v = 0.0;
            if (bn + e % BN < NVALID) { v = bias[p.bias_off + bn + e % BN]; }
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

    // A(i, k) and B(k, j) fragments straight from storage: A_KMAJOR rows of k (row-major
    // TM x TK), else columns; B_KMAJOR columns of k (col-major), else rows
    var l : array<subgroup_matrix_left<f16, TK, TM>, FM>;
    var r : array<subgroup_matrix_right<f16, TN, TK>, FN>;
    var l2 : array<subgroup_matrix_left<f16, TK, TM>, FM>;
    var r2 : array<subgroup_matrix_right<f16, TN, TK>, FN>;
    let a0 = a_off;
    let b0 = b_off;
    for (var i = 0u; i < FM; i++) {
        let mi = bm + sm + i * TM;
        l[i] = subgroupMatrixLoad<subgroup_matrix_left<f16, TK, TM>>(&a, select(a0 + mi, a0 + mi * LDA, A_KMAJOR), !A_KMAJOR, LDA);
    }
    for (var j = 0u; j < FN; j++) {
        let nj = bn + sn + j * TN;
        r[j] = subgroupMatrixLoad<subgroup_matrix_right<f16, TN, TK>>(&b, select(b0 + nj, b0 + nj * LDB, B_KMAJOR), B_KMAJOR, LDB);
    }
    for (var k = 0u; k < KLEN; k += 2u * TK) {
        let k1 = k + TK;                       // KLEN is a multiple of 32 >= 2 TK
        for (var i = 0u; i < FM; i++) {
            let mi = bm + sm + i * TM;
            l2[i] = subgroupMatrixLoad<subgroup_matrix_left<f16, TK, TM>>(&a, select(a0 + k1 * LDA + mi, a0 + mi * LDA + k1, A_KMAJOR), !A_KMAJOR, LDA);
        }
        for (var j = 0u; j < FN; j++) {
            let nj = bn + sn + j * TN;
            r2[j] = subgroupMatrixLoad<subgroup_matrix_right<f16, TN, TK>>(&b, select(b0 + k1 * LDB + nj, b0 + nj * LDB + k1, B_KMAJOR), B_KMAJOR, LDB);
        }
        for (var i = 0u; i < FM; i++) {
            for (var j = 0u; j < FN; j++) {
                acc[i][j] = subgroupMatrixMultiplyAccumulate(l[i], r[j], acc[i][j]);
            }
        }
        let k2 = min(k + 2u * TK, KLEN - 2u * TK);   // (past the end: the last again, unused)
        for (var i = 0u; i < FM; i++) {
            let mi = bm + sm + i * TM;
            l[i] = subgroupMatrixLoad<subgroup_matrix_left<f16, TK, TM>>(&a, select(a0 + k2 * LDA + mi, a0 + mi * LDA + k2, A_KMAJOR), !A_KMAJOR, LDA);
        }
        for (var j = 0u; j < FN; j++) {
            let nj = bn + sn + j * TN;
            r[j] = subgroupMatrixLoad<subgroup_matrix_right<f16, TN, TK>>(&b, select(b0 + k2 * LDB + nj, b0 + nj * LDB + k2, B_KMAJOR), B_KMAJOR, LDB);
        }
        for (var i = 0u; i < FM; i++) {
            for (var j = 0u; j < FN; j++) {
                acc[i][j] = subgroupMatrixMultiplyAccumulate(l2[i], r2[j], acc[i][j]);
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
